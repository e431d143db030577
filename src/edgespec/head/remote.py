"""Forming a ring of nodes, and the head's side of it (``RemoteChain``).

``form_ring`` connects to every node, profiles them (optional), plans the windows, has each
node load its windows (cutting them from the model file it has, checked by fingerprint),
wires every stage to its successor (node to node), runs a health lap, and returns the chain.
Every step has a deadline and is announced through ``log_fn``. The ring state (nodes, plan,
model, and nodes that left it) is saved so that ``edgespec chat``/``serve`` and Python can
attach to it later (``attach``) and ``ring status``/``down``/``rebalance`` know every node.

Failure semantics (``edgespec.errors``): a broken connection or missed heartbeats raise
``NodeLost`` (the only thing that makes a head re-plan); an ERROR a stage sends about this
head's work raises ``StageFailure`` (that request ends; the ring is intact); a node held by
another head answers ``busy``, raised as ``RingBusy`` naming the holder.
"""

from __future__ import annotations

import collections
import contextlib
import json
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
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.auth import AuthError
from edgespec.chain import Batch, Result
from edgespec.errors import NodeLost, RingBusy, RingError, StageFailure
from edgespec.frames import batch_message, message_result
from edgespec.head.planner import NodeProfile, Plan, PlanError, model_memory, plan_ring
from edgespec.transport import Connection, TransportError, connect
from edgespec.wire import FieldTag, Kind, KvOp, Message, control_message

log = logging.getLogger("edgespec.ring")

Address = tuple[str, int]

__all__ = ["RingError", "NodeLost", "StageFailure", "RingBusy", "RemoteChain", "form_ring",
           "reform_ring", "attach_chain", "head_identity"]

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
    return {"id": secrets.token_hex(8), "pid": os.getpid(), "host": socket.gethostname(),
            "what": what, "since": time.time()}


def _node_error(name: str, op: str, code: str, message: str) -> RingError:
    if code == "busy":
        return RingBusy(f"{message}")
    return RingError(f"{name}: {op} failed: {code}: {message}")


def _dial(address: Address, key: bytes, head_id: str, timeout: float = CONNECT_TIMEOUT_S,
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


def state_path() -> Path:
    from edgespec.models import home

    return home() / "ring.json"


@dataclass
class _Member:
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

    def start(self) -> None:
        self.thread = threading.Thread(target=self._read, name=f"edgespec-head-{self.name}",
                                       daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except Exception as e:  # connection lost: every waiter learns it
                self.alive = False
                err = NodeLost(f"lost node {self.name} ({self.address[0]}:{self.address[1]}): "
                               f"{e}")
                self.results.put(err)
                with self.lock:
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
                err: RingError = (NodeLost(text) if code in LOST_CODES
                                  else StageFailure(text, code, msg.lap_id))
                err.lap = msg.lap_id  # type: ignore[attr-defined]
                self.results.put(err)
            elif msg.kind == Kind.CLOSE:
                continue
            else:
                log.warning("head: unexpected %s from %s", msg.kind.name, self.name)

    def request(self, op: str, timeout: float = 600.0, blob: bytes | None = None,
                **body: Any) -> Message:
        msg = control_message(op, blob=blob, **body)
        msg.request_id = self.conn.next_request_id()
        q: queue.Queue = queue.Queue()
        with self.lock:
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
        return reply

    def close(self) -> None:
        self.conn.close("head leaving")


class RemoteChain:
    """The ``Chain`` over a ring of nodes (see ``edgespec.chain``)."""

    def __init__(self, members: list[_Member], plan: Plan, n_vocab: int,
                 encoding: str = "f32") -> None:
        self.members = members
        self.plan = plan
        self.n_vocab = n_vocab
        self.n_stages = len(plan.windows)
        self.encoding = encoding
        self._first = members[plan.windows[0].node]
        self._results = members[0].results  # shared by all members
        self.bytes_sent = 0
        # Laps this head put into the ring. A stage reports a failed batch to the head of the
        # ring; one that some other member sent is logged here, not raised into a generation.
        self._laps: collections.deque[int] = collections.deque(maxlen=256)
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
        msg = batch_message(batch, stage=0)
        self._first.conn.send(msg)

    def kv(self, ops: Sequence[KvOp]) -> None:
        if ops:
            self._first.conn.send(Message(Kind.KV_OPS, {FieldTag.KV_OPS: list(ops),
                                                         FieldTag.META: {"stage": 0}},
                                          lap_id=self._kv_lap))

    def prune(self, nodes: Iterable[int], ops: Sequence[KvOp] = (), lap: int = 0) -> None:
        arr = np.fromiter((int(n) for n in nodes), dtype=np.int32)
        if not len(arr):
            return
        msg = Message(Kind.PRUNE, {FieldTag.NODES: arr}, lap_id=lap)
        for m in self.members:
            with contextlib.suppress(TransportError):
                m.conn.send(msg)

    def has_result(self) -> bool:
        return not self._results.empty()

    def next_result(self, timeout: float | None = 120.0) -> Result:
        while True:
            try:
                item = self._results.get(timeout=timeout)
            except queue.Empty:
                raise NodeLost(f"no result from the ring within {timeout} s") from None
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


# ----------------------------------------------------------------------- forming a ring

def _connect_members(addresses: Sequence[Address], key: bytes, head_id: str,
                     proxy: Callable[[Address], Address] | None) -> list[_Member]:
    """Authenticated connections to ``addresses`` (all or none: a failure closes the rest)."""
    members: list[_Member] = []
    # One queue for every member: the last stage answers batches, but a middle stage answers
    # for a batch it dropped whole (every row pruned), and any stage may report an error.
    results: queue.Queue = queue.Queue()
    try:
        for host, port in addresses:
            conn = _dial((host, port), key, head_id,
                         target=proxy((host, port)) if proxy else None)
            m = _Member(conn.peer_node or f"{host}:{port}", (host, port), conn, results)
            m.start()
            members.append(m)
    except BaseException:
        for m in members:
            m.close()
        raise
    return members


def _holder_of(health: dict, head: dict | None) -> dict | None:
    """The other head holding a node, from its health answer (None if free or ours)."""
    holder = health.get("holder")
    if not isinstance(holder, dict) or (head is not None and holder.get("id") == head.get("id")):
        return None
    return holder


def form_ring(addresses: Sequence[Address], model: str | os.PathLike[str], key: bytes, *,
              ranges: Sequence[tuple[int, int]] | None = None, stages: int | None = None,
              rounds: int = 1, n_ctx: int = 4096, n_seq_max: int = 256, encoding: str = "f32",
              profile: bool = True, proxy: Callable[[Address], Address] | None = None,
              head_id: str = "head", log_fn: Callable[[str], None] = log.info,
              send_shards: bool = False, head: dict | None = None,
              take_over: bool = False) -> RemoteChain:
    """Connect, (profile,) plan, load, wire and check a ring over ``addresses``.

    ``head`` is this head's identity (``head_identity()``); a node held by another head is
    refused with RingBusy naming it, unless ``take_over``.
    """
    from edgespec.nodeinfo import describe_holder
    from edgespec.shard import fingerprint, read_info

    head = head or head_identity()
    hold = {"head": head, "take_over": bool(take_over)}
    model_path = Path(model).resolve()
    info = read_info(model_path)
    fp = fingerprint(model_path)
    log_fn(f"connecting to {len(addresses)} node(s): "
           + ", ".join(f"{h}:{p}" for h, p in addresses))
    members = _connect_members(addresses, key, head_id, proxy)
    try:
        profiles = []
        for m in members:
            h = m.request("health", timeout=CONNECT_TIMEOUT_S).meta
            # The node's own name (what mDNS and `ring status` show), not its id.
            m.name = str(h.get("name") or m.name)
            other = _holder_of(h, head)
            if other is not None and not take_over:
                raise RingBusy(f"{m.name} ({m.address[0]}:{m.address[1]}) is held by "
                               f"{describe_holder(other)}; stop it, go through it (`edgespec "
                               f"chat --server URL` for a running serve), or pass --take-over")
            prof = NodeProfile(h["node_id"], h.get("name", m.name), m.address[0], m.address[1],
                               free_mem=int(h.get("free_ram") or 0), rtt_ms=m.last_rtt_ms)
            if profile and ranges is None and not send_shards:
                log_fn(f"profiling {m.name} on {model_path.name}...")
                try:
                    p = m.request("profile", timeout=LOAD_TIMEOUT_S, model_path=str(model_path),
                                  fingerprint=fp).meta
                    prof.ms_per_layer = {int(b): float(v) for b, v in p["ms_per_layer"].items()}
                except (RingBusy, NodeLost):
                    raise
                except RingError as e:  # e.g. the node lacks the model: it gets the median
                    log_fn(f"{m.name}: not profiled ({e})")
            profiles.append(prof)
        measured = [p.ms_per_layer for p in profiles if p.ms_per_layer]
        for p in profiles:
            if measured and not p.ms_per_layer:
                p.ms_per_layer = {b: float(np.median([mp.get(b, 0.0) for mp in measured]))
                                  for b in measured[0]}
        if ranges is None and stages is not None and stages != len(members) * rounds:
            raise RingError(f"{stages} stages requested but {len(members)} nodes x {rounds} "
                            f"rounds")
        layer_bytes = max(1, model_path.stat().st_size // max(1, info.n_layer))
        try:
            plan = plan_ring(info.n_layer, layer_bytes, profiles, rounds=rounds, ranges=ranges,
                             memory=model_memory(model_path), n_ctx=n_ctx)
        except PlanError as e:
            raise RingError(f"cannot plan the ring: {e}") from e
        log_fn("ring plan:\n" + plan.table())
        # Load: every node its windows (cut from its own copy of the model).
        for i, m in enumerate(members):
            wins = [[w.stage, w.start, w.stop, w.stage == len(plan.windows) - 1]
                    for w in plan.windows if w.node == i]
            log_fn(f"loading on {m.name}: " + ", ".join(
                f"stage {s} (layers {a}-{b - 1})" for s, a, b, _ in wins) + "...")
            # A node without the model file (or with send_shards) gets its windows sent.
            load = {"model_path": "" if send_shards else str(model_path), "fingerprint": fp,
                    "windows": wins, "n_ctx": n_ctx, "n_seq_max": n_seq_max,
                    "encoding": encoding, **hold}
            if m.request("load", timeout=LOAD_TIMEOUT_S, **load).meta.get("need_shards"):
                log_fn(f"{m.name} lacks the model file: sending its windows")
                load["shard_paths"] = _send_windows(m, model_path, fp, wins)
                m.request("load", timeout=LOAD_TIMEOUT_S, **load)
        log_fn("linking the stages...")
        link_stages(members, plan.windows, proxy, hold)
        chain = RemoteChain(members, plan, info.n_vocab, encoding)
        log_fn(f"health lap: {health_lap(chain):.0f} ms")
        return chain
    except BaseException:
        for m in members:
            m.close()
        raise


def link_stages(members: Sequence[_Member], windows: Sequence[Any],
                proxy: Callable[[Address], Address] | None, hold: dict) -> None:
    """Wire each stage to its successor (node to node, or in-process on the same node); the
    last stage answers the head. Nodes dial their links afresh (a node that came back on the
    same address holds nothing of the old ring)."""
    for i, m in enumerate(members):
        links: dict[str, Any] = {}
        for w in windows:
            if w.node != i:
                continue
            if w.stage == len(windows) - 1:
                links[str(w.stage)] = "head"
                continue
            nxt = windows[w.stage + 1]
            if nxt.node == i:
                links[str(w.stage)] = {"local": nxt.stage, "stage": nxt.stage}
            else:
                host, port = members[nxt.node].address
                if proxy:
                    host, port = proxy((host, port))
                links[str(w.stage)] = {"host": host, "port": port, "stage": nxt.stage}
        m.request("connect", timeout=LINK_TIMEOUT_S, links=links, **hold)


def _send_windows(m: _Member, model_path: Path, fp: str, wins: list) -> dict[str, str]:
    """Cut this node's windows here and send them (resumable, sha256-checked, cached by
    fingerprint on the node: a shard it already holds is not sent again)."""
    from edgespec.models import home
    from edgespec.shard import cut_window
    from edgespec.transfer import send_shard

    def request(op: str, blob: bytes | None = None, **body: Any) -> Message:
        return m.request(op, blob=blob, timeout=120, **body)

    paths = {}
    for stage, a, b, _last in wins:
        local = cut_window(model_path, (a, b), home() / "shards" /
                           f"{model_path.stem}.{fp[:12]}.L{a:03d}-{b:03d}.gguf")
        remote, sent = send_shard(request, local, fp, a, b, name=m.name)
        log.info("shard %d:%d -> %s: %d bytes sent", a, b, m.name, sent)
        paths[str(stage)] = remote
    return paths


def alive_nodes(addresses: Sequence[Address], key: bytes, timeout: float = DEAD_AFTER_S
                ) -> list[Address]:
    """The addresses whose node accepts our key and answers a ping in time."""
    alive = []
    for host, port in addresses:
        try:
            conn = connect(host, port, key, node_id="head-probe", timeout=max(timeout, 2.0))
        except Exception:
            continue
        try:
            conn.request(control_message("ping"), timeout=max(timeout, 2.0))
            alive.append((host, port))
        except Exception:
            pass
        finally:
            conn.close()
    return alive


def reform_ring(addresses: Sequence[Address], model: str | os.PathLike[str], key: bytes,
                **form_kwargs: Any) -> RemoteChain:
    """A new ring over the nodes of ``addresses`` that answer now (after a node loss, or to
    take back nodes that returned).

    Windows are re-planned over them (memory permitting; otherwise the planner's error says
    how many layers do not fit) and loaded afresh.
    """
    alive = alive_nodes(addresses, key)
    if not alive:
        raise NodeLost("no node of the ring is reachable any more")
    log.warning("forming the ring over %d reachable node(s): %s", len(alive),
                ", ".join(f"{h}:{p}" for h, p in alive))
    form_kwargs.pop("ranges", None)
    return form_ring(alive, model, key, **form_kwargs)


def health_lap(chain: RemoteChain) -> float:
    """One token through every stage and back (then cleared); returns the lap time in ms."""
    t = time.perf_counter()
    chain.submit(Batch(np.array([0], np.int32), np.array([0], np.int32), [[0]],
                       np.zeros(1, np.int32), np.ones(1, bool), lap=0x7FFFFFFF))
    res = chain.next_result(timeout=HEALTH_LAP_TIMEOUT_S)
    if len(res.targets) != 1:
        raise RingError("health lap returned no token")
    chain.kv([KvOp(1, 0, -1, -1)])
    return (time.perf_counter() - t) * 1e3


# ----------------------------------------------------------------------- ring state file

def node_addresses(state: dict, *, include_left: bool = True) -> list[Address]:
    """The addresses of a saved ring's nodes (and of nodes that left it, for rebalance)."""
    rows = list(state.get("nodes", []))
    if include_left:
        rows += list(state.get("left", []))
    out: list[Address] = []
    for n in rows:
        a = (str(n["host"]), int(n["port"]))
        if a not in out:
            out.append(a)
    return out


def save_state(chain: RemoteChain, model: Path, extra: dict | None = None,
               known: Sequence[Address] = (), reason: str = "") -> Path:
    """Write the ring in force (nodes, plan) and, under ``left``, every ``known`` node that is
    not in it any more (so ``status``, ``down`` and ``rebalance`` still know it)."""
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    members = {m.address for m in chain.members}
    old_left: list[dict] = []
    names: dict[Address, str] = {}
    with contextlib.suppress(RingError, ValueError, OSError, KeyError):
        old = load_state()
        old_left = list(old.get("left", []))
        names = {a: n for n, a in named_nodes(old)}
    left = [n for n in old_left if (n["host"], int(n["port"])) not in members]
    for host, port in known:
        if (host, port) not in members and all((n["host"], int(n["port"])) != (host, port)
                                               for n in left):
            left.append({"name": names.get((host, port), f"{host}:{port}"), "host": host,
                         "port": port, "since": time.time(),
                         "reason": reason or "not in the ring"})
    state = {"model": str(model), "created": time.time(),
             "nodes": [{"name": m.name, "host": m.address[0], "port": m.address[1]}
                       for m in chain.members],
             "plan": chain.plan.as_dict(), "left": left, **(extra or {})}
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)
    return path


def load_state(path: str | os.PathLike[str] | None = None) -> dict:
    p = Path(path) if path else state_path()
    if not p.exists():
        raise RingError(f"no ring is up (no state at {p}): run `edgespec ring up` first")
    try:
        state = json.loads(p.read_text())
        if not isinstance(state, dict) or "nodes" not in state or "plan" not in state:
            raise ValueError("missing nodes or plan")
    except ValueError as e:
        raise RingError(f"the ring state at {p} is unreadable ({e}); run `edgespec ring up` "
                        f"again") from None
    return state


def named_nodes(state: dict) -> list[tuple[str, Address]]:
    """(name, address) of every node a saved ring knows: its members, then those that left."""
    out: list[tuple[str, Address]] = []
    for n in list(state.get("nodes", [])) + list(state.get("left", [])):
        a = (str(n["host"]), int(n["port"]))
        if all(a != b for _, b in out):
            out.append((str(n.get("name") or f"{a[0]}:{a[1]}"), a))
    return out


def unload_nodes(nodes: Sequence[tuple[str, Address]], key: bytes, *, head: dict | None = None,
                 take_over: bool = False, say: Callable[[str], None] = log.info,
                 warn: Callable[[str], None] = log.warning) -> list[Address]:
    """Tell each node to unload its windows (freeing their memory); returns those that did.
    A node that is gone is reported and skipped; one held by another head refuses (RingBusy
    text) unless ``take_over``."""
    done = []
    for name, (host, port) in nodes:
        try:
            m = _connect_members([(host, port)], key, "head", None)[0]
        except RingError as e:
            warn(f"{name}: unreachable ({e})")
            continue
        try:
            m.request("unload", timeout=60, head=head or head_identity(), take_over=take_over)
            say(f"{name}: windows unloaded")
            done.append((host, port))
        except RingError as e:
            warn(f"{name}: not unloaded ({e})")
        finally:
            m.close()
    return done


def ring_report(state: dict, key: bytes, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The ring as it is: one row per node of the saved plan (and per node that left it),
    from what each node says now (windows held, link to the next stage, holder, memory).

    ``state`` per row: ``loaded`` (holds its windows of the plan and is linked), ``not
    loaded``, ``other windows``, ``loaded, link down``, ``unreachable``, or for a node that
    left the ring ``left`` / ``returned`` (answers again: ``ring rebalance`` takes it back)."""
    wins = state["plan"]["windows"]
    n_stages = len(wins)
    rows: list[dict[str, Any]] = []
    entries = [(i, n, False) for i, n in enumerate(state["nodes"])]
    entries += [(None, n, True) for n in state.get("left", [])]
    for index, n, left in entries:
        host, port = str(n["host"]), int(n["port"])
        plan = {int(s): (int(a), int(b)) for s, node, a, b in wins if node == index}
        row: dict[str, Any] = {"name": n.get("name") or f"{host}:{port}", "address":
                               f"{host}:{port}", "plan": plan, "held": {}, "holder": None,
                               "free_ram": None, "rss": None, "rtt_ms": None, "left": left,
                               "reason": n.get("reason")}
        try:
            m = _connect_members([(host, port)], key, "status", None)[0]
        except RingError as e:
            row["state"] = "left" if left else "unreachable"
            row["error"] = str(e)
            rows.append(row)
            continue
        try:
            h = m.request("health", timeout=timeout).meta
            row.update(name=str(h.get("name") or row["name"]), rtt_ms=m.last_rtt_ms,
                       free_ram=h.get("free_ram"), rss=h.get("rss"), holder=h.get("holder"),
                       node_id=h.get("node_id"))
            stages = h.get("stages") or {}
            row["held"] = {int(s): tuple(v.get("range", ())) for s, v in stages.items()}
            links_ok = all(v.get("next") not in (None, "none") or v.get("is_last")
                           for v in stages.values())
            if left:
                row["state"] = "returned"
            elif not row["held"]:
                row["state"] = "not loaded"
            elif row["held"] != plan:
                row["state"] = "other windows"
            elif not links_ok and n_stages > 1:
                row["state"] = "loaded, link down"
            else:
                row["state"] = "loaded"
        except RingError as e:
            row["state"] = "unreachable"
            row["error"] = str(e)
        finally:
            m.close()
        rows.append(row)
    return rows


# ----------------------------------------------------------------------- finding nodes

def _local_networks() -> list[Any]:
    """The IPv4 networks this host has an interface on (the head's own LAN segments)."""
    import ipaddress

    import ifaddr  # a zeroconf dependency

    nets = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(f"{ip.ip}/{ip.network_prefix}",
                                                     strict=False))
    return nets


def pick_address(addresses: Sequence[str]) -> str | None:
    """The address of a node's mDNS record to connect to.

    A node bound to every interface advertises all its addresses (LAN, VPN, container
    bridges...), in no useful order. Prefer one on a network the head itself is on, then any
    other routable IPv4 address, then IPv6; skip unspecified and IPv6 link-local addresses
    (the latter need a scope the transport does not carry). Loopback is kept last: it is right
    only for a node on this very host.
    """
    import ipaddress

    nets = _local_networks()
    ranked = []
    for i, text in enumerate(addresses):
        try:
            ip = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            continue
        if ip.is_unspecified or (ip.version == 6 and ip.is_link_local):
            continue
        if ip.is_loopback:
            rank = 3
        elif ip.version == 4 and any(ip in net for net in nets if not net.is_loopback):
            rank = 0
        else:
            rank = 1 if ip.version == 4 else 2
        ranked.append((rank, i, text))  # ties keep the record's order
    return min(ranked)[2] if ranked else None


def discover(expect: int | None, timeout: float, key: bytes | None = None,
             log_fn: Callable[[str], None] = log.warning) -> list[Address]:
    """Node addresses found over mDNS (compatible protocol only).

    With ``key``, only nodes that prove it (and answer a ping) count: an advertiser that fails
    the handshake or stalls is skipped, named in the log, and does not count toward
    ``expect``; browsing goes on for real nodes until ``timeout``.
    """
    from edgespec.discovery import browse

    deadline = time.monotonic() + timeout
    good: list[Address] = []
    skipped: dict[Address, str] = {}
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        want = None if expect is None else expect + len(skipped)
        for n in browse(timeout=left, expect=want):
            if not n.compatible:
                if (n.name, n.port) not in skipped:
                    log_fn(f"ignoring {n.name}: protocol {n.proto} (we speak another)")
                skipped[(n.name, n.port)] = "incompatible protocol"
                continue
            host = pick_address(n.addresses)
            if host is None:
                log_fn(f"ignoring {n.name}: its mDNS record has no usable address "
                       f"({', '.join(n.addresses) or 'none'})")
                skipped[(n.name, n.port)] = "no usable address"
                continue
            addr = (host, n.port)
            if addr in good or addr in skipped:
                continue
            if key is not None:
                try:
                    conn = _dial(addr, key, "head-probe",
                                 timeout=max(1.0, min(CONNECT_TIMEOUT_S, left)))
                    try:
                        conn.request(control_message("ping"), timeout=5.0)
                    finally:
                        conn.close()
                except Exception as e:
                    skipped[addr] = str(e)
                    log_fn(f"skipping {n.name} at {host}:{n.port}: {e}")
                    continue
            good.append(addr)
        if expect is None or len(good) >= expect:
            break
    if expect is not None and len(good) < expect:
        extra = (f"; skipped {len(skipped)} that failed: "
                 + "; ".join(f"{a[0]}:{a[1]} ({why})" for a, why in skipped.items())
                 if skipped else "")
        raise RingError(f"found {len(good)} usable node(s) over mDNS within {timeout:.0f} s, "
                        f"expected {expect}{extra}: is `edgespec node` running on each device, "
                        f"on this LAN, with this ring key?")
    return good[:expect] if expect is not None else good


def parse_nodes(spec: str) -> list[Address]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RingError(f"bad node address {part!r}: expected host:port")
        out.append((host, int(port)))
    if not out:
        raise RingError("no node addresses given")
    return out


def attach_chain(state: dict, key: bytes, *, head: dict | None = None,
                 take_over: bool = False) -> RemoteChain:
    """Reconnect to the nodes of a saved ring and take over as its head.

    Raises NodeLost when a node of the plan is unreachable or no longer holds its windows
    (it restarted), so the caller can re-form the ring instead of decoding garbage.
    """
    from edgespec.head.planner import Window
    from edgespec.nodeinfo import describe_holder

    head = head or head_identity()
    addresses = [(n["host"], int(n["port"])) for n in state["nodes"]]
    try:
        members = _connect_members(addresses, key, "head", None)
    except RingError as e:
        if "another ring key" in str(e):
            raise
        raise NodeLost(str(e)) from e
    try:
        windows = [Window(s, node, a, b) for s, node, a, b in state["plan"]["windows"]]
        for i, (m, n) in enumerate(zip(members, state["nodes"], strict=True)):
            h = m.request("health", timeout=CONNECT_TIMEOUT_S).meta
            m.name = str(h.get("name") or n.get("name") or m.name)
            other = _holder_of(h, head)
            if other is not None and not take_over:
                raise RingBusy(f"the ring is held by {describe_holder(other)} (node {m.name}); "
                               f"go through it (`edgespec chat --server URL` for a running "
                               f"serve), stop it, or pass --take-over")
            held = {int(s): tuple(v.get("range", ())) for s, v in (h.get("stages") or {}).items()}
            want = {w.stage: (w.start, w.stop) for w in windows if w.node == i}
            if held != want:
                raise NodeLost(f"{m.name} holds {sorted(held.items()) or 'nothing'} instead of "
                               f"its windows {sorted(want.items())} (it restarted?)")
        profiles = [NodeProfile(m.name, m.name, m.address[0], m.address[1]) for m in members]
        plan = Plan(profiles, windows, int(state["plan"]["n_layer"]))
        link_stages(members, windows, None, {"head": head, "take_over": bool(take_over)})
    except BaseException:
        for m in members:
            m.close()
        raise
    from edgespec.shard import read_info

    chain = RemoteChain(members, plan, read_info(state["model"]).n_vocab,
                        state.get("encoding", "f32"))
    chain.kv([KvOp(1, 0, -1, -1), KvOp(3, 0)])
    return chain


# ------------------------------------------------------------------------ Ring constructors

def _head_for(cls, chain: RemoteChain, model: Path, *, spec: str = "auto", draft=None,
              drafter: str = "auto", n_ctx: int = 4096, on_close=None, recover=None,
              draft_quant: str = "q4_0", **engine: Any):
    from edgespec.head.local import make_drafter
    from edgespec.llamacpp import Tokenizer, load_model

    tok_model = load_model(model, vocab_only=True)

    def close() -> None:
        tok_model.close()
        if on_close is not None:
            on_close()

    drafter_obj = make_drafter(model, draft, drafter, draft_quant)
    ring = cls(chain, Tokenizer(tok_model), model_name=model.stem, spec=spec,
               drafter_factory=lambda: drafter_obj, n_ctx=n_ctx, on_close=close,
               engine_options=engine, recover=recover)
    ring.draft_name = Path(draft).name if draft is not None else None
    return ring


def _recovering(model: Path, key_bytes: bytes, known: list[Address], head: dict,
                extra: dict, **form: Any) -> Callable[[Exception], RemoteChain]:
    """The recovery of a saved ring: re-form over the known nodes that answer, and save the
    plan now in force (``ring status`` shows it; the lost nodes are listed as left)."""

    def recover(exc: Exception) -> RemoteChain:
        chain = reform_ring(known, model, key_bytes, head=head, profile=False, **form)
        with contextlib.suppress(OSError):
            save_state(chain, model, extra, known=known, reason=f"lost: {exc}")
        return chain

    return recover


def attach(cls, state: str | os.PathLike[str] | None = None, *, key: str | None = None,
           take_over: bool = False, **kwargs: Any):
    """A head for the ring saved by ``edgespec ring up``.

    A node that restarted or vanished since is handled like a loss: the ring is re-formed
    over the nodes that answer (and the state file updated)."""
    from edgespec.auth import load_key

    st = load_state(state)
    key_bytes = load_key(key or st.get("key_file"))
    head = head_identity()
    n_ctx = int(st.get("n_ctx", 4096))
    model = Path(st["model"])
    extra = {k: st[k] for k in ("encoding", "n_ctx", "key_file") if k in st}
    known = node_addresses(st)
    recover = _recovering(model, key_bytes, known, head, extra, n_ctx=n_ctx,
                          encoding=st.get("encoding", "f32"), take_over=take_over)
    try:
        chain = attach_chain(st, key_bytes, head=head, take_over=take_over)
    except NodeLost as e:
        log.warning("the saved ring is not intact (%s); re-forming it", e)
        chain = recover(e)
    return _head_for(cls, chain, model, n_ctx=n_ctx, recover=recover, **kwargs)


def up(cls, model: str | os.PathLike[str], nodes: str = "auto", *, key: str | None = None,
       expect: int | None = None, timeout: float = 5.0, rounds: int = 1,
       ranges: Sequence[tuple[int, int]] | None = None, n_ctx: int = 4096,
       encoding: str = "f32", spec: str = "auto", draft=None, take_over: bool = False,
       **engine: Any):
    """Discover (or list) nodes, form the ring, save its state, and return its head."""
    from edgespec.auth import ensure_key
    from edgespec.models import resolve

    key_bytes = ensure_key(key)
    model_path = resolve(model)
    if draft is not None:  # refuse a draft of another family before any node loads anything
        from edgespec.spec.draft_model import check_draft_tokenizer

        check_draft_tokenizer(resolve(draft), model_path)
    head = head_identity()
    addrs = discover(expect, timeout, key_bytes) if nodes == "auto" else parse_nodes(nodes)
    chain = form_ring(addrs, model_path, key_bytes, ranges=ranges, rounds=rounds, n_ctx=n_ctx,
                      encoding=encoding, head=head, take_over=take_over)
    extra = {"encoding": encoding, "n_ctx": n_ctx, "key_file": key}
    save_state(chain, model_path, extra)
    recover = _recovering(model_path, key_bytes, list(addrs), head, extra, n_ctx=n_ctx,
                          encoding=encoding, rounds=rounds)
    return _head_for(cls, chain, model_path, spec=spec, draft=draft, n_ctx=n_ctx,
                     recover=recover, **engine)
