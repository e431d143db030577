"""The head's side of a ring: the member RPC (``Member``, ``dial``) and ``RemoteChain``.

A ``Member`` is the head's connection to one node, with a reader thread that sorts what comes
back (replies to requests, results, errors); ``RemoteChain`` is the ``Chain`` over the members
(docs/design.md 2). Forming a ring lives in ``edgespec.head.formation``.

Failure semantics (``edgespec.errors``, docs/design.md 5.4): a broken connection or missed
heartbeats raise ``NodeLost`` (the only thing that makes a head re-plan); an ERROR a stage sends
about this head's work raises ``StageFailure`` (that request ends; the ring is intact); a node
held by another head answers ``busy``, raised as ``RingBusy`` naming the holder.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgespec.batch import Batch, Result
from edgespec.errors import NodeLost, RingBusy, RingError, StageFailure, TakenOver
from edgespec.head.planner import Plan
from edgespec.seqs import N_SEQ
from edgespec.tree.kvop import KvOp
from edgespec.wire import FieldTag, Kind, Message
from edgespec.wire import control as ctl
from edgespec.wire.auth import AuthError
from edgespec.wire.frames import message_result, send_batch
from edgespec.wire.transport import Connection, TransportError, connect

log = logging.getLogger("edgespec.ring")

Address = tuple[str, int]

__all__ = ["Address", "Member", "RemoteChain", "connect_members", "dial", "head_identity"]

#: ERROR codes from a node that mean a node of the ring is gone, not that the work was bad.
LOST_CODES = frozenset({"next_lost", "taken_over"})

#: Deadlines of the formation steps (seconds). Loading cuts windows from the model file on
#: the node (about 8 s per 0.5B shard here), so it gets the most.
CONNECT_TIMEOUT_S = 10.0
LOAD_TIMEOUT_S = 900.0
LINK_TIMEOUT_S = 60.0
HEALTH_LAP_TIMEOUT_S = 120.0


def head_identity(what: str | None = None) -> dict[str, Any]:
    """Who this head is, as a node shows it to a second head it refuses: a random id (the
    same for every connection of this process's head), pid, host, what and since when."""
    if what is None:
        # `edgespec serve` (console script) or `python -m edgespec serve` (.../__main__.py).
        cli = len(sys.argv) > 1 and "edgespec" in sys.argv[0]
        what = f"edgespec {sys.argv[1]}" if cli else "a Python head"
    ident = {"id": secrets.token_hex(8), "pid": os.getpid(), "host": socket.gethostname(),
             "what": what, "since": time.time()}
    if SERVING_URL is not None:
        ident["url"] = SERVING_URL
    return ident


#: Set by `edgespec serve` before it opens its ring: the URL it will answer at, which the
#: nodes then show as their holder's (so `ring rebalance` anywhere can go through it).
SERVING_URL: str | None = None


def _node_error(name: str, op: str, code: str, message: str) -> RingError:
    if code == "busy":
        return RingBusy(f"{message}")
    return RingError(f"{name}: {op} failed: {code}: {message}")


def dial(address: Address, key: bytes, head_id: str, timeout: float = CONNECT_TIMEOUT_S,
          target: Address | None = None) -> Connection:
    """Connect to a node, turning each way it can fail into one RingError line that names
    the node and the fix."""
    host, port = address
    th, tp = target or address
    try:
        return connect(th, tp, key, node_id=head_id, timeout=timeout)
    except AuthError as e:
        text = str(e)
        if "mismatch" in text:
            raise RingError(f"node at {host}:{port} holds another ring key ({text})") from e
        raise RingError(f"node at {host}:{port} failed the handshake: {text}") from e
    except ConnectionRefusedError as e:
        raise RingError(f"no node listening at {host}:{port} (connection refused): is "
                        f"`edgespec node` running there, on that port?") from e
    except TimeoutError as e:
        raise RingError(f"node at {host}:{port} did not answer within {timeout:.0f} s") from e
    except OSError as e:
        raise RingError(f"cannot reach node at {host}:{port}: {e}") from e


#: Health checks to every node this often (seconds); a node that does not answer within
#: DEAD_AFTER_S is declared lost. Override with EDGESPEC_HEARTBEAT_S / EDGESPEC_DEAD_AFTER_S.
HEARTBEAT_S = float(os.environ.get("EDGESPEC_HEARTBEAT_S", "0.5"))
DEAD_AFTER_S = float(os.environ.get("EDGESPEC_DEAD_AFTER_S", "2.0"))


@dataclass
class Member:
    """The head's connection to one node, with a reader thread that sorts what comes back."""

    name: str
    address: Address
    conn: Connection
    results: queue.Queue
    replies: dict[int, queue.Queue] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    alive: bool = True
    last_rtt_ms: float = 0.0
    taken_over: str | None = None  # the node's word when another head took it on purpose
    lost: Exception | None = None  # why the connection ended, once it has

    def start(self) -> None:
        self.thread = threading.Thread(target=self._read, name=f"edgespec-head-{self.name}",
                                       daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except Exception as e:  # connection lost: every waiter learns it
                log.debug("head: connection to %s ended: %s", self.name, e)
                err = (TakenOver(self.taken_over) if self.taken_over is not None else
                       NodeLost(f"lost node {self.name} ({self.address[0]}:"
                                f"{self.address[1]}): its connection closed"))
                self.results.put(err)
                # Under the lock a request registering now either is told here or sees
                # ``alive`` false (``_call``): none waits out its deadline for a dead node.
                with self.lock:
                    self.alive = False
                    self.lost = err
                    for q in self.replies.values():
                        q.put(err)
                return
            rid = msg.request_id
            if rid and rid in self.replies:
                with self.lock:
                    q = self.replies.get(rid)
                if q is not None:
                    q.put(msg)
                    continue
            if msg.kind == Kind.RESULT:
                self.results.put(message_result(msg))
            elif msg.kind == Kind.ERROR:
                meta = msg.meta
                code = str(meta.get("code"))
                text = f"{self.name}: {code}: {meta.get('message')}"
                if code == "taken_over":
                    self.taken_over = str(meta.get("message"))
                err: RingError = (TakenOver(text) if code == "taken_over" else NodeLost(text)
                                  if code in LOST_CODES else StageFailure(text, code, msg.lap_id))
                err.lap = msg.lap_id  # type: ignore[attr-defined]
                self.results.put(err)
            elif msg.kind == Kind.CLOSE:
                continue
            else:
                log.warning("head: unexpected %s from %s", msg.kind.name, self.name)

    def request(self, op: str, timeout: float = 600.0, blob: bytes | None = None,
                **body: Any) -> Message:
        """Send the control request ``op`` (checked against its type first: the head never
        sends what a node would refuse) and return the node's REPLY, checked against the
        op's answer type (``edgespec.wire.control``)."""
        return self._call(op, timeout, blob, body)[0]

    def ask(self, op: str, timeout: float = 600.0, blob: bytes | None = None,
            **body: Any) -> Any:
        """``request``, returning the typed answer (e.g. ``ctl.HealthReply``)."""
        return self._call(op, timeout, blob, body)[1]

    def _call(self, op: str, timeout: float, blob: bytes | None,
              body: dict[str, Any]) -> tuple[Message, ctl.Reply]:
        try:
            msg = ctl.request_message(ctl.make_request(op, blob, **body), blob=blob)
        except ctl.ControlError as e:
            raise RingError(f"{self.name}: {op} not sent: {e}") from None
        msg.request_id = self.conn.next_request_id()
        q: queue.Queue = queue.Queue()
        with self.lock:
            if self.lost is not None:
                raise self.lost
            self.replies[msg.request_id] = q
        try:
            t = time.perf_counter()
            self.conn.send(msg)
            try:
                reply = q.get(timeout=timeout)
            except queue.Empty:
                raise NodeLost(f"{self.name} ({self.address[0]}:{self.address[1]}) did not "
                               f"answer {op!r} within {timeout:.0f} s") from None
            self.last_rtt_ms = (time.perf_counter() - t) * 1e3
        finally:
            with self.lock:
                self.replies.pop(msg.request_id, None)
        if isinstance(reply, Exception):
            raise reply
        if reply.kind == Kind.ERROR:
            raise _node_error(self.name, op, str(reply.meta.get("code")),
                              str(reply.meta.get("message")))
        try:
            return reply, ctl.parse_reply(op, reply)
        except ctl.ControlError as e:
            raise RingError(f"{self.name}: malformed answer: {e}") from None

    def close(self) -> None:
        self.conn.close("head leaving")


#: What ``RemoteChain.wake`` puts among the results.
WOKEN = object()


class RemoteChain:
    """The ``Chain`` over a ring of nodes (see ``edgespec.head.chain``)."""

    def __init__(self, members: list[Member], plan: Plan, n_vocab: int,
                 encoding: str = "f32", n_seq_max: int = N_SEQ) -> None:
        self.members = members
        self.plan = plan
        self.n_vocab = n_vocab
        self.n_seq_max = n_seq_max  # sequences every stage's context holds
        self.n_stages = len(plan.windows)
        self.encoding = encoding
        self._first = members[plan.windows[0].node]
        self._results = members[0].results  # shared by all members
        self.bytes_sent = 0
        # Laps this head put into the ring (those of every slot). A stage reports a failed
        # batch to the head of the ring; one that some other member sent is logged here, not
        # raised into a generation.
        self._laps: collections.deque[int] = collections.deque(maxlen=1024)
        # Laps given up by ``abandon``: their results and errors are dropped on arrival.
        self._abandoned: collections.deque[int] = collections.deque(maxlen=1024)
        self._kv_lap = secrets.randbits(30) | (1 << 30)
        self._closed = threading.Event()
        self.heartbeat_s = HEARTBEAT_S
        self.dead_after_s = DEAD_AFTER_S
        self._heartbeat = threading.Thread(target=self._beat, name="edgespec-heartbeat",
                                           daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        """Notice a dead or hung node within ``dead_after_s``: a crashed node closes its
        connection (seen at once by the reader); a hung one stops answering health checks."""
        while not self._closed.wait(self.heartbeat_s):
            for m in self.members:
                if self._closed.is_set() or not m.alive:
                    continue
                try:
                    # ``ping``, not ``health``: a heartbeat must never wait on a slow probe.
                    m.request("ping", timeout=self.dead_after_s)
                except Exception as e:
                    if self._closed.is_set():
                        return
                    m.alive = False
                    self._results.put(NodeLost(f"node {m.name} ({m.address[0]}:"
                                               f"{m.address[1]}) stopped answering: {e}"))
                    return

    def submit(self, batch: Batch) -> None:
        self._laps.append(batch.lap)
        send_batch(self._first.conn, batch)

    def kv(self, ops: Sequence[KvOp], release: Sequence[int] = ()) -> None:
        if ops or release:
            meta: dict = {"stage": 0}
            if release:
                meta["release"] = [int(k) for k in release]
            self._first.conn.send(Message(Kind.KV_OPS, {FieldTag.KV_OPS: list(ops),
                                                         FieldTag.META: meta},
                                          lap_id=self._kv_lap))

    def prune(self, nodes: Iterable[int], lap: int = 0) -> None:
        arr = np.fromiter((int(n) for n in nodes), dtype=np.int32)
        if not len(arr):
            return
        msg = Message(Kind.PRUNE, {FieldTag.NODES: arr}, lap_id=lap)
        for m in self.members:
            with contextlib.suppress(TransportError):
                m.conn.send(msg)

    def has_result(self) -> bool:
        return not self._results.empty()

    def wake(self) -> None:
        """Make the ``next_result(wakes=True)`` waiting now (or the next one) return None:
        the reader has other work (the ring's loop: a new request)."""
        self._results.put(WOKEN)

    def next_result(self, timeout: float | None = 120.0, wakes: bool = False
                    ) -> Result | None:
        while True:
            try:
                item = self._results.get(timeout=timeout)
            except queue.Empty:
                raise NodeLost(f"no result from the ring within {timeout} s") from None
            if item is WOKEN:
                if wakes:
                    return None
                continue
            if isinstance(item, Exception):
                lap = getattr(item, "lap", None)
                if lap is not None and lap in self._abandoned:
                    log.debug("dropping an error about an abandoned batch: %s", item)
                    continue
                if lap is not None and lap not in self._laps and lap != self._kv_lap:
                    log.warning("ignoring an error about a batch this head did not send: %s",
                                item)
                    continue
                raise item
            if item.lap in self._abandoned:
                continue
            return item

    def abandon(self) -> None:
        """Give up on every batch in flight (after a stage failure): their results and
        errors are dropped when they arrive, so the next generation starts clean."""
        self._abandoned.extend(self._laps)
        self._abandoned.append(self._kv_lap)
        self._laps.clear()
        self._kv_lap = secrets.randbits(30) | (1 << 30)

    def close(self) -> None:
        self._closed.set()
        for m in self.members:
            m.close()



def connect_members(addresses: Sequence[Address], key: bytes, head_id: str,
                     proxy: Callable[[Address], Address] | None) -> list[Member]:
    """Authenticated connections to ``addresses`` (all or none: a failure closes the rest)."""
    members: list[Member] = []
    # One queue for every member: the last stage answers batches, but a middle stage answers
    # for a batch it dropped whole (every row pruned), and any stage may report an error.
    results: queue.Queue = queue.Queue()
    try:
        for host, port in addresses:
            conn = dial((host, port), key, head_id,
                         target=proxy((host, port)) if proxy else None)
            m = Member(conn.peer_node or f"{host}:{port}", (host, port), conn, results)
            m.start()
            members.append(m)
    except BaseException:
        for m in members:
            m.close()
        raise
    return members


