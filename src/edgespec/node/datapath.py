"""A node's data path (docs/design.md 5.1, 5.2): one ``HostedStage`` per hosted window, its
inbox and worker thread, and ``StageLoop``, the part of ``edgespec.node.daemon.Node`` that
takes batches, KV operations and prunes off the wire, runs them in ring order, and forwards
the result to the next link (in-process, or over TCP to the next node) or to the head.

Frames of the data path (all over authenticated connections, ``edgespec.wire.transport``):

- TOKENS / HIDDEN: a batch for one of this node's stages (``META.stage``). It joins that
  stage's queue; the stage's thread applies its KV operations, drops rows of pruned tree
  nodes, runs the window, and sends the hidden states to the next stage (node to node) or,
  on the last stage, the target tokens to the head. Batches of other sequences waiting behind
  it join its decode (one llama.cpp batch, docs/design.md 5.7) and go on separately.
- KV_OPS: KV operations ordered with the batches (they travel the ring like a batch); its
  ``META.release`` names requests that ended, whose samplers the last stage frees.
- PRUNE: tree nodes rejected by the head's verifier. Applied at once, so rows of those nodes
  still queued or in flight are dropped before they cost compute.

A failure inside a stage is reported to the head as an ERROR frame; the node keeps serving.
A link to the next node that breaks is dropped (reported to the head as ``next_lost``, which it
treats as a lost node) and dialled afresh whenever the ring is linked again; a new plan's load
drops every link first. Apart from the control plane in ``daemon.py``; ``Node`` inherits
``StageLoop`` and supplies the state it reads (``hosted``, ``server``, ``name``, ``_lock``,
``_out_conns``, ``_stop``, ``key``, ``node_id``). Linking (``_op_connect``) is here, beside the
links it makes. Log lines keep the node's logger, ``edgespec.node``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgespec.laps import cpu_now, now, stamps_from_meta
from edgespec.node.merge import MERGE_MAX_ROWS, gather
from edgespec.node.worker import StageWorker
from edgespec.wire import FieldTag, Kind, Message, WireError, error_message, kv_ops_list
from edgespec.wire import control as ctl
from edgespec.wire.frames import frame_batch, result_message, send_batch
from edgespec.wire.server import FrameServer
from edgespec.wire.transport import Connection, Frame, TransportError, connect

log = logging.getLogger("edgespec.node")

#: Seconds to dial the next node when linking (a node that does not answer fails the link).
LINK_TIMEOUT_S = 10.0
#: Request keys one KV_OPS frame may release (``META.release``).
MAX_RELEASE = 1024
#: Batches up to this many rows may run on the thread that read them (a decode lap, a small
#: tree). While it runs, that connection is not read; small batches keep what the node then
#: sends on small too, so two nodes that feed each other (a ring of several rounds) never
#: both wait on a full socket buffer.
INLINE_MAX_ROWS = 16


@dataclass
class HostedStage:
    """One hosted window: its runtime, its place in the ring, and its worker thread."""

    stage: int
    layer_range: tuple[int, int]
    runtime: Any
    is_last: bool
    worker: StageWorker = field(init=False)
    inbox: queue.Queue = field(default_factory=queue.Queue)
    next_local: HostedStage | None = None
    next_conn: Connection | None = None
    next_stage: int = -1
    head_conn: Connection | None = None
    encoding: str = "f32"
    thread: threading.Thread | None = None
    busy_s: float = 0.0
    batches: int = 0
    merged: int = 0  # decodes that took more than one batch (edgespec.node.merge)
    pending: int = 0  # items posted, not finished; run_lock: held by whoever runs one
    count_lock: threading.Lock = field(default_factory=threading.Lock)
    run_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.worker = StageWorker([self.runtime], is_last=self.is_last)

    def post(self, item: tuple) -> None:
        """Queue work (a batch, KV operations) for the stage's thread."""
        with self.count_lock:
            self.pending += 1
        self.inbox.put(item)

    def stop(self) -> None:
        """End the stage's thread after the item it runs; what is queued is dropped (the
        stage is unloaded: the plan it was for is over)."""
        with contextlib.suppress(queue.Empty):
            while True:
                self.inbox.get_nowait()
        self.inbox.put(None)

    def claim_idle(self) -> bool:
        """True if nothing is queued or running: the caller then runs its item itself, in
        order (whatever is posted meanwhile runs after it), and calls ``finished()``."""
        with self.count_lock:
            if self.pending:
                return False
            self.pending = 1
            return True

    def finished(self) -> None:
        with self.count_lock:
            self.pending -= 1


class _LinkLost(Exception):
    """The link to the next node is gone (the head re-plans the ring)."""


class StageLoop:
    """The data path of a ``Node``: frame handlers for TOKENS / HIDDEN, KV_OPS and PRUNE, one
    loop per hosted stage, and the links to the next node."""

    hosted: dict[int, HostedStage]
    server: FrameServer
    name: str
    _lock: threading.RLock
    _out_conns: dict[tuple[str, int], Connection]
    _stop: threading.Event
    key: bytes
    node_id: str

    # ------------------------------------------------------------------ data path

    def _hosted(self, msg_stage: int) -> HostedStage:
        hosted = self.hosted.get(msg_stage)
        if hosted is None:
            raise WireError(f"stage {msg_stage} is not hosted by node {self.name}")
        return hosted

    def _on_batch(self, conn: Connection, frame: Frame) -> Message | None:
        try:
            try:
                batch, hidden, stage, meta = frame_batch(frame)
            except (ValueError, KeyError) as e:  # schema-valid frame, inconsistent contents
                raise WireError(f"bad batch: {e}") from None
            # Lap timing (docs/design.md 8.1): earlier stages' stamps, then this stage's arrival.
            batch.timing = stamps_from_meta(meta.get("timing"))
            batch.timing.append([stage, now(), 0, 0, 0])
            hosted = self._hosted(stage)
            if hidden is None and hosted.stage != 0:
                raise WireError(f"stage {stage} takes hidden states, not token ids")
            if hidden is not None and hosted.stage == 0:
                raise WireError("stage 0 takes token ids, not hidden states")
            self._check_batch(hosted, batch, hidden)
            # A batch for an idle stage runs here, on the thread that read it: handing it to
            # the stage's thread costs a thread wake-up per hop (docs/design.md 8.3). Only when
            # nothing else waits on this connection, so a PRUNE or control frame behind it is
            # not held up by its compute.
            inline = (len(batch) <= INLINE_MAX_ROWS and not conn.has_unread()
                      and hosted.claim_idle())
        except WireError as e:
            # Answered here rather than by the server's generic reply, so that the ERROR
            # carries the batch's lap id: the head (directly, or through the previous node's
            # relay in _read_next) fails exactly that lap and ignores refusals of batches
            # it never sent.
            self.server.errors += 1
            log.warning("%s: refused a %s batch from %s: %s", self.name, frame.kind.name,
                        conn.peer_node, e)
            err = error_message("bad_payload", str(e), request_id=frame.header.request_id)
            err.lap_id = frame.header.lap_id
            return err
        if inline:
            try:
                with hosted.run_lock:
                    self._process(hosted, ("batch", batch, hidden))
            finally:
                hosted.finished()
        else:
            hosted.post(("batch", batch, hidden))
        return None

    def _check_batch(self, hosted: HostedStage, batch: Any, hidden: np.ndarray | None) -> None:
        """Refuse, before it is queued, a batch this stage could never run: the sender gets
        an ERROR reply at once, and a bad frame never reaches llama.cpp. Only checks that do
        not depend on the KV cache belong here; position continuity is the runtime's (it is
        known only when the batch's turn comes)."""
        rt = hosted.runtime
        n = len(batch)
        n_seq_max = int(getattr(rt, "n_seq_max", 0) or 0)
        if n_seq_max:
            top = batch.seq_ids.max_id()
            if top >= n_seq_max:
                raise WireError(f"seq id {top} outside 0..{n_seq_max - 1} of stage {hosted.stage}")
        if hidden is None:
            n_vocab = int(getattr(rt, "n_vocab", 0) or 0)
            if n_vocab and n and int(batch.tokens.max()) >= n_vocab:
                raise WireError(f"token id {int(batch.tokens.max())} outside the vocabulary "
                                f"0..{n_vocab - 1}")
        else:
            n_embd = int(getattr(rt, "n_embd", 0) or 0)
            if hidden.ndim != 2 or hidden.shape[0] != n or (n_embd and hidden.shape[1] != n_embd):
                raise WireError(f"stage {hosted.stage} takes hidden states [{n}, {n_embd}], got "
                                f"{list(hidden.shape)}")

    def _on_kv(self, conn: Connection, frame: Frame) -> None:
        msg = frame.decode()
        ops = kv_ops_list(msg[FieldTag.KV_OPS])
        hosted = self._hosted(int(msg.meta.get("stage", 0)))
        release = msg.meta.get("release")
        if release is not None and (not isinstance(release, list) or len(release) > MAX_RELEASE
                                    or not all(type(k) is int for k in release)):
            raise WireError("META.release must be a list of request keys")
        if ops:
            hosted.post(("kv", ops, msg.lap_id))
        if release:
            hosted.post(("release", release, msg.lap_id))
        return None

    def _on_prune(self, conn: Connection, frame: Frame) -> None:
        msg = frame.decode()
        nodes = np.asarray(msg[FieldTag.NODES]).tolist()
        for hosted in list(self.hosted.values()):
            hosted.worker.prune(msg.lap_id, nodes, ())
        return None

    def _run_hosted(self, hosted: HostedStage) -> None:
        behind: collections.deque = collections.deque()  # taken off the inbox, not run yet
        cap = int(getattr(hosted.runtime, "n_batch", 0) or MERGE_MAX_ROWS)
        yielded: tuple | None = None  # a prefill chunk that let decodes go first, once
        while True:
            item = behind.popleft() if behind else hosted.inbox.get()
            if item is None:
                return
            items = [item]
            if item[0] == "batch" and (behind or not hosted.inbox.empty()):
                # merged decodes, decodes first: design.md 5.7
                items = gather(hosted.inbox, item, cap, behind,
                               decodes_first=item is not yielded)
                yielded = item if items[0] is not item else None
            try:
                with hosted.run_lock:
                    if len(items) == 1:
                        self._process(hosted, items[0])
                    else:
                        self._process_merged(hosted, items)
            finally:
                for _ in items:
                    hosted.finished()

    def _process(self, hosted: HostedStage, item: tuple) -> None:
        """Run one item of a stage (a batch or KV operations) and pass the result on."""
        kind, a, b = item
        try:
            if kind in ("kv", "release"):  # release: samplers of requests that ended
                (hosted.worker.apply_ops if kind == "kv" else hosted.worker.release)(a)
                self._send_on(hosted, kind, (a, b))
                return
            stamp = a.timing[-1] if a.timing else [hosted.stage, 0, 0, 0, 0]
            stamp[2], cpu = now(), cpu_now()
            t = time.perf_counter()
            batch, out = hosted.worker.run(a, b)
            hosted.busy_s += time.perf_counter() - t
            stamp[3], stamp[4] = now(), cpu_now() - cpu
            hosted.batches += 1
            self._pass_on(hosted, batch, out)
        except Exception as e:
            self._report(hosted, e, a.lap if kind == "batch" else int(b or 0))

    def _process_merged(self, hosted: HostedStage, items: list[tuple]) -> None:
        """Run several batches (``gather``) as one decode, then pass each on by itself with
        its own lap id, META and timing stamp; every stamp carries the shared compute window
        (arrival stays each batch's own)."""
        stamps = [a.timing[-1] if a.timing else [hosted.stage, 0, 0, 0, 0]
                  for _, a, _ in items]
        t0, cpu = now(), cpu_now()
        t = time.perf_counter()
        try:
            outs = hosted.worker.run_many([(a, b) for _, a, b in items])
        except Exception as e:  # a pending prune op failed: every batch fails, as in run()
            outs = [e] * len(items)
        hosted.busy_s += time.perf_counter() - t
        t1, cpu = now(), cpu_now() - cpu
        hosted.batches += len(items)
        hosted.merged += 1
        for (_, a, _), stamp, res in zip(items, stamps, outs, strict=True):
            stamp[2], stamp[3], stamp[4] = t0, t1, cpu
            try:
                if isinstance(res, BaseException):
                    raise res
                self._pass_on(hosted, *res)
            except Exception as e:
                self._report(hosted, e, a.lap)

    def _pass_on(self, hosted: HostedStage, batch: Any, out: np.ndarray | None) -> None:
        """Forward a run batch: targets to the head (last stage), else hidden states on."""
        if hosted.is_last:
            targets = out if out is not None else np.zeros(0, np.int32)
            msg = result_message(batch, targets)
            msg.fields[FieldTag.META] = {"timing": batch.timing}
            self._to_head(hosted, msg)
        elif out is None:
            # Every row was pruned on the way: the head still expects an answer.
            self._send_on(hosted, "empty", batch)
        else:
            self._send_on(hosted, "batch", (batch, out))

    def _report(self, hosted: HostedStage, e: Exception, lap: int) -> None:
        """Tell the head that an item of ``lap`` failed here; the stage keeps serving."""
        if isinstance(e, _LinkLost):  # the head treats it as a lost node (re-plans)
            log.warning("%s", e)
            msg = error_message("next_lost", str(e))
        else:
            log.error("stage %d failed", hosted.stage, exc_info=e)
            msg = error_message("stage_failed", f"stage {hosted.stage} on {self.name}: "
                                f"{type(e).__name__}: {e}")
        msg.lap_id = lap
        self._to_head(hosted, msg)

    def _read_next(self, out: Connection) -> None:
        """Read what the next node sends back on our link to it. Nothing is expected but an
        ERROR (it refused a batch we passed on) or its goodbye; an ERROR is relayed to the
        head of the stages that feed that link, so the head learns its lap failed at once
        instead of waiting for a result that will never come."""
        while True:
            try:
                msg = out.recv()
            except Exception as e:  # link closed (or broken): the next send reports it
                if not out.closed and not self._stop.is_set():
                    log.warning("link to next node %s closed: %s", out.peer_node, e)
                self._drop_link(out)
                return
            if msg.kind != Kind.ERROR:
                continue
            text = f"next node {out.peer_node}: {msg.meta.get('code')}: {msg.meta.get('message')}"
            log.warning("%s", text)
            with self._lock:
                heads = {id(s.head_conn): s for s in self.hosted.values()
                         if s.next_conn is out and s.head_conn is not None}
            for hosted in heads.values():
                err = error_message("next_refused", f"stage {hosted.stage} on {self.name}: {text}")
                err.lap_id = msg.lap_id
                self._to_head(hosted, err)

    def _to_head(self, hosted: HostedStage, msg: Message) -> None:
        conn = hosted.head_conn
        if conn is None:
            log.warning("stage %d: no head connected; dropping %s", hosted.stage, msg.kind.name)
            return
        try:
            conn.send(msg)
        except TransportError as e:
            log.warning("stage %d: head unreachable: %s", hosted.stage, e)

    def _send_on(self, hosted: HostedStage, kind: str, payload: Any) -> None:
        """Pass work to the next stage: in-process when this node hosts it, else over TCP."""
        if hosted.is_last:
            return
        if kind == "empty":
            batch = payload
            # Every row was pruned: rather than send a placeholder on through the ring (which
            # would cost compute), tell the head directly that nothing of it survived. The
            # batch's KV operations (a new leaf's prefix copy, a decided round's commit) still
            # go on, in ring order: the later stages must apply them exactly as this one did.
            if batch.pre_ops:
                self._send_on(hosted, "kv", (list(batch.pre_ops), batch.lap))
            self._to_head(hosted, result_message(batch.select(np.zeros(len(batch), bool)),
                                               np.zeros(0, np.int32)))
            return
        if hosted.next_local is not None:
            if kind in ("kv", "release"):
                hosted.next_local.post((kind, *payload))
            else:
                batch, hidden = payload
                # A copy, not a view: the hidden states live in this window's capture buffer,
                # which its next decode overwrites while the next window may still be queued.
                batch.timing.append([hosted.next_local.stage, now(), 0, 0, 0])
                hosted.next_local.post(("batch", batch, np.array(hidden, copy=True)))
            return
        conn = hosted.next_conn
        if conn is None or conn.closed:
            raise _LinkLost(f"stage {hosted.stage} on {self.name} has no live link to the next "
                            f"stage ({hosted.next_stage}); the ring must be linked again")
        try:
            if kind in ("kv", "release"):
                items, lap = payload
                ops, meta = ((list(items), {"stage": hosted.next_stage}) if kind == "kv" else
                             ([], {"stage": hosted.next_stage, "release": list(items)}))
                conn.send(Message(Kind.KV_OPS, {FieldTag.KV_OPS: ops, FieldTag.META: meta},
                                  lap_id=int(lap or 0)))
            else:
                batch, hidden = payload
                send_batch(conn, batch, hidden, hosted.encoding, hosted.next_stage, batch.timing)
        except TransportError as e:
            self._drop_link(conn)
            raise _LinkLost(f"stage {hosted.stage} on {self.name}: link to the next node "
                            f"{conn.peer_node} broke: {e}") from e

    def _drop_link(self, conn: Connection) -> None:
        """Forget a broken link to a next node; the next ``connect`` dials it afresh."""
        with self._lock:
            self._out_conns = {a: c for a, c in self._out_conns.items() if c is not conn}
            for hosted in self.hosted.values():
                if hosted.next_conn is conn:
                    hosted.next_conn = None
        with contextlib.suppress(Exception):
            conn.close()

    # ------------------------------------------------------------------ linking

    def _op_connect(self, conn: Connection, req: ctl.Connect, blob: Any) -> ctl.ConnectReply:
        """Wire each hosted stage to its successor (``edgespec.wire.control.Connect``).
        Results and errors go to this connection."""
        fresh: dict[tuple[str, int], Connection] = {}
        for stage, link in req.links.items():
            hosted = self._hosted(stage)
            hosted.head_conn = conn
            hosted.next_local, hosted.next_conn = None, None
            if link == "head":
                continue
            hosted.next_stage = link.stage
            if isinstance(link, ctl.NextLocal):
                hosted.next_local = self._hosted(link.local)
                continue
            addr = (link.host, link.port)
            out = fresh.get(addr)
            if out is None:
                # Linking (or re-linking) dials afresh: an old link may lead to a node process
                # that died and came back on the same address (its state is gone).
                with self._lock:
                    old = self._out_conns.pop(addr, None)
                if old is not None:
                    old.close("re-linking")
                try:
                    out = connect(addr[0], addr[1], self.key, node_id=self.node_id,
                                  timeout=LINK_TIMEOUT_S)
                except Exception as e:
                    raise RuntimeError(f"{self.name} cannot reach the next node at "
                                       f"{addr[0]}:{addr[1]}: {e}") from e
                fresh[addr] = out
                with self._lock:
                    self._out_conns[addr] = out
                threading.Thread(target=self._read_next, args=(out,), daemon=True,
                                 name=f"edgespec-next-{addr[0]}:{addr[1]}").start()
                log.info("%s: linked stage %d to %s at %s:%d", self.name, hosted.stage,
                         out.peer_node, *addr)
            hosted.next_conn = out
        for hosted in self.hosted.values():
            hosted.head_conn = conn
        return ctl.ConnectReply(connected=sorted(self.hosted))
