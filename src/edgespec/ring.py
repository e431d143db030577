"""Forming a ring of nodes, and the head's side of it (``RemoteChain``).

``form_ring`` connects to every node, profiles them (optional), plans the windows, has each
node load its windows (cutting them from the model file it has, checked by fingerprint),
wires every stage to its successor (node to node), runs a health lap, and returns the chain.
The ring state (nodes, plan, model) is saved so that ``edgespec chat``/``serve`` and Python
can attach to it later (``attach``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .chain import Batch, Result
from .frames import batch_message, message_result
from .planner import NodeProfile, Plan, plan_ring
from .transport import Connection, TransportError, connect
from .wire import FieldTag, Kind, KvOp, Message, control_message

log = logging.getLogger("edgespec.ring")

Address = tuple[str, int]


class RingError(RuntimeError):
    """The ring could not be formed or lost a member."""


#: Health checks to every node this often (seconds); a node that does not answer within
#: DEAD_AFTER_S is declared lost. Override with EDGESPEC_HEARTBEAT_S / EDGESPEC_DEAD_AFTER_S.
HEARTBEAT_S = float(os.environ.get("EDGESPEC_HEARTBEAT_S", "0.5"))
DEAD_AFTER_S = float(os.environ.get("EDGESPEC_DEAD_AFTER_S", "2.0"))


def state_path() -> Path:
    from .models import home

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
                err = RingError(f"lost node {self.name} ({self.address[0]}:{self.address[1]}): "
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
                err = RingError(f"{self.name}: {meta.get('code')}: {meta.get('message')}")
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
                raise RingError(f"{self.name} did not answer {op!r} within {timeout} s") from None
            self.last_rtt_ms = (time.perf_counter() - t) * 1e3
        finally:
            with self.lock:
                self.replies.pop(msg.request_id, None)
        if isinstance(reply, Exception):
            raise reply
        if reply.kind == Kind.ERROR:
            raise RingError(f"{self.name}: {op} failed: {reply.meta.get('code')}: "
                            f"{reply.meta.get('message')}")
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
                    m.request("health", timeout=self.dead_after_s)
                except Exception as e:
                    if self._closed.is_set():
                        return
                    m.alive = False
                    self._results.put(RingError(f"node {m.name} ({m.address[0]}:"
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
                raise RingError(f"no result from the ring within {timeout} s") from None
            if isinstance(item, Exception):
                lap = getattr(item, "lap", None)
                if lap is not None and lap not in self._laps and lap != self._kv_lap:
                    log.warning("ignoring an error about a batch this head did not send: %s",
                                item)
                    continue
                raise item
            return item

    def close(self) -> None:
        self._closed.set()
        for m in self.members:
            m.close()


# ----------------------------------------------------------------------- forming a ring

def _connect_members(addresses: Sequence[Address], key: bytes, head_id: str,
                     proxy: Callable[[Address], Address] | None) -> list[_Member]:
    members = []
    # One queue for every member: the last stage answers batches, but a middle stage answers
    # for a batch it dropped whole (every row pruned), and any stage may report an error.
    results: queue.Queue = queue.Queue()
    for host, port in addresses:
        target = proxy((host, port)) if proxy else (host, port)
        conn = connect(target[0], target[1], key, node_id=head_id)
        m = _Member(conn.peer_node or f"{host}:{port}", (host, port), conn, results)
        m.start()
        members.append(m)
    return members


def form_ring(addresses: Sequence[Address], model: str | os.PathLike[str], key: bytes, *,
              ranges: Sequence[tuple[int, int]] | None = None, stages: int | None = None,
              rounds: int = 1, n_ctx: int = 4096, n_seq_max: int = 256, encoding: str = "f32",
              profile: bool = True, proxy: Callable[[Address], Address] | None = None,
              head_id: str = "head", log_fn: Callable[[str], None] = log.info,
              send_shards: bool = False) -> RemoteChain:
    """Connect, (profile,) plan, load, wire and check a ring over ``addresses``."""
    from .shard import fingerprint, read_info

    model_path = Path(model).resolve()
    info = read_info(model_path)
    fp = fingerprint(model_path)
    members = _connect_members(addresses, key, head_id, proxy)
    try:
        profiles = []
        for m in members:
            h = m.request("health").meta
            # The node's own name (what mDNS and `ring status` show), not its id.
            m.name = str(h.get("name") or m.name)
            prof = NodeProfile(h["node_id"], h.get("name", m.name), m.address[0], m.address[1],
                               free_mem=int(h.get("free_ram") or 0), rtt_ms=m.last_rtt_ms)
            if profile and ranges is None and not send_shards:
                try:
                    p = m.request("profile", model_path=str(model_path), fingerprint=fp).meta
                    prof.ms_per_layer = {int(b): float(v) for b, v in p["ms_per_layer"].items()}
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
        plan = plan_ring(info.n_layer, layer_bytes, profiles, rounds=rounds, ranges=ranges)
        log_fn("ring plan:\n" + plan.table())
        # Load: every node its windows (cut from its own copy of the model).
        for i, m in enumerate(members):
            wins = [[w.stage, w.start, w.stop, w.stage == len(plan.windows) - 1]
                    for w in plan.windows if w.node == i]
            # A node without the model file (or with send_shards) gets its windows sent.
            load = {"model_path": "" if send_shards else str(model_path), "fingerprint": fp,
                    "windows": wins,
                    "n_ctx": n_ctx, "n_seq_max": n_seq_max, "encoding": encoding}
            if m.request("load", **load).meta.get("need_shards"):
                load["shard_paths"] = _send_windows(m, model_path, fp, wins)
                m.request("load", **load)
        # Wire: each stage to its successor, node to node; the last stage answers the head.
        for i, m in enumerate(members):
            links: dict[str, Any] = {}
            for w in plan.windows:
                if w.node != i:
                    continue
                if w.stage == len(plan.windows) - 1:
                    links[str(w.stage)] = "head"
                    continue
                nxt = plan.windows[w.stage + 1]
                if nxt.node == i:
                    links[str(w.stage)] = {"local": nxt.stage, "stage": nxt.stage}
                else:
                    host, port = members[nxt.node].address
                    if proxy:
                        host, port = proxy((host, port))
                    links[str(w.stage)] = {"host": host, "port": port, "stage": nxt.stage}
            m.request("connect", links=links)
        chain = RemoteChain(members, plan, info.n_vocab, encoding)
        health_lap(chain)
        return chain
    except BaseException:
        for m in members:
            m.close()
        raise


def _send_windows(m: _Member, model_path: Path, fp: str, wins: list) -> dict[str, str]:
    """Cut this node's windows here and send them (resumable, sha256-checked, cached by
    fingerprint on the node: a shard it already holds is not sent again)."""
    from .models import home
    from .shard import cut_window
    from .transfer import send_shard

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
    """The addresses whose node accepts our key and answers a health check in time."""
    alive = []
    for host, port in addresses:
        try:
            conn = connect(host, port, key, node_id="head-probe", timeout=timeout)
        except Exception:
            continue
        try:
            conn.request(control_message("health"), timeout=timeout)
            alive.append((host, port))
        except Exception:
            pass
        finally:
            conn.close()
    return alive


def reform_ring(addresses: Sequence[Address], model: str | os.PathLike[str], key: bytes,
                **form_kwargs: Any) -> RemoteChain:
    """A new ring over the nodes of ``addresses`` that are still alive (after a node loss).

    Windows are re-planned over the survivors (memory permitting; otherwise the planner's
    error says how many layers do not fit) and loaded afresh.
    """
    alive = alive_nodes(addresses, key)
    if not alive:
        raise RingError("no node of the ring is reachable any more")
    log.warning("re-forming the ring over %d surviving node(s): %s", len(alive),
                ", ".join(f"{h}:{p}" for h, p in alive))
    form_kwargs.pop("ranges", None)
    return form_ring(alive, model, key, **form_kwargs)


def health_lap(chain: RemoteChain) -> float:
    """One token through every stage and back (then cleared); returns the lap time in ms."""
    t = time.perf_counter()
    chain.submit(Batch(np.array([0], np.int32), np.array([0], np.int32), [[0]],
                       np.zeros(1, np.int32), np.ones(1, bool), lap=0x7FFFFFFF))
    res = chain.next_result(timeout=120)
    if len(res.targets) != 1:
        raise RingError("health lap returned no token")
    chain.kv([KvOp(1, 0, -1, -1)])
    return (time.perf_counter() - t) * 1e3


def save_state(chain: RemoteChain, model: Path, extra: dict | None = None) -> Path:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"model": str(model), "created": time.time(),
             "nodes": [{"name": m.name, "host": m.address[0], "port": m.address[1]}
                       for m in chain.members],
             "plan": chain.plan.as_dict(), **(extra or {})}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)
    return path


def load_state(path: str | os.PathLike[str] | None = None) -> dict:
    p = Path(path) if path else state_path()
    if not p.exists():
        raise RingError(f"no ring is up (no state at {p}): run `edgespec ring up` first")
    return json.loads(p.read_text())


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


def discover(expect: int | None, timeout: float) -> list[Address]:
    """Node addresses found over mDNS (compatible protocol only)."""
    from .discovery import browse

    found = browse(timeout=timeout, expect=expect)
    addrs = []
    for n in found:
        if not n.compatible:
            log.warning("ignoring %s: protocol %s (we speak another)", n.name, n.proto)
            continue
        host = pick_address(n.addresses)
        if host is None:
            log.warning("ignoring %s: its mDNS record has no usable address (%s)", n.name,
                        ", ".join(n.addresses) or "none")
            continue
        addrs.append((host, n.port))
    if expect is not None and len(addrs) < expect:
        raise RingError(f"found {len(addrs)} node(s) over mDNS within {timeout} s, expected "
                        f"{expect}: is `edgespec node` running on each device, on this LAN?")
    return addrs


def parse_nodes(spec: str) -> list[Address]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise RingError(f"bad node address {part!r}: expected host:port")
        out.append((host, int(port)))
    if not out:
        raise RingError("no node addresses given")
    return out


def attach_chain(state: dict, key: bytes) -> RemoteChain:
    """Reconnect to the nodes of a saved ring and take over as its head."""
    from .planner import Window

    addresses = [(n["host"], int(n["port"])) for n in state["nodes"]]
    members = _connect_members(addresses, key, "head", None)
    for m, n in zip(members, state["nodes"], strict=True):
        m.name = str(n.get("name") or m.name)
    profiles = [NodeProfile(m.name, m.name, m.address[0], m.address[1]) for m in members]
    windows = [Window(s, node, a, b) for s, node, a, b in state["plan"]["windows"]]
    plan = Plan(profiles, windows, int(state["plan"]["n_layer"]))
    for i, m in enumerate(members):
        links: dict[str, Any] = {}
        for w in windows:
            if w.node != i:
                continue
            if w.stage == len(windows) - 1:
                links[str(w.stage)] = "head"
            else:
                nxt = windows[w.stage + 1]
                host, port = members[nxt.node].address
                links[str(w.stage)] = ({"local": nxt.stage, "stage": nxt.stage}
                                       if nxt.node == i else
                                       {"host": host, "port": port, "stage": nxt.stage})
        m.request("connect", links=links)
    from .shard import read_info

    chain = RemoteChain(members, plan, read_info(state["model"]).n_vocab)
    chain.kv([KvOp(1, 0, -1, -1), KvOp(3, 0)])
    return chain


# ------------------------------------------------------------------------ Ring constructors

def _head_for(cls, chain: RemoteChain, model: Path, *, spec: str = "auto", draft=None,
              drafter: str = "auto", n_ctx: int = 4096, on_close=None, recover=None,
              draft_quant: str = "q4_0", **engine: Any):
    from .llamacpp import Tokenizer, load_model
    from .local import make_drafter

    tok_model = load_model(model, vocab_only=True)

    def close() -> None:
        tok_model.close()
        if on_close is not None:
            on_close()

    drafter_obj = make_drafter(model, draft, drafter, draft_quant)
    return cls(chain, Tokenizer(tok_model), model_name=model.stem, spec=spec,
               drafter_factory=lambda: drafter_obj, n_ctx=n_ctx, on_close=close,
               engine_options=engine, recover=recover)


def attach(cls, state: str | os.PathLike[str] | None = None, *, key: str | None = None,
           **kwargs: Any):
    """A head for the ring saved by ``edgespec ring up``."""
    from .auth import load_key

    st = load_state(state)
    key_bytes = load_key(key or st.get("key_file"))
    chain = attach_chain(st, key_bytes)
    n_ctx = int(st.get("n_ctx", 4096))
    addrs = [(n["host"], int(n["port"])) for n in st["nodes"]]

    def recover(_exc: Exception) -> RemoteChain:
        return reform_ring(addrs, st["model"], key_bytes, n_ctx=n_ctx, profile=False,
                           encoding=st.get("encoding", "f32"))

    return _head_for(cls, chain, Path(st["model"]), n_ctx=n_ctx, recover=recover, **kwargs)


def up(cls, model: str | os.PathLike[str], nodes: str = "auto", *, key: str | None = None,
       expect: int | None = None, timeout: float = 5.0, rounds: int = 1,
       ranges: Sequence[tuple[int, int]] | None = None, n_ctx: int = 4096,
       encoding: str = "f32", spec: str = "auto", draft=None, **engine: Any):
    """Discover (or list) nodes, form the ring, save its state, and return its head."""
    from .auth import ensure_key
    from .models import resolve

    key_bytes = ensure_key(key)
    model_path = resolve(model)
    addrs = discover(expect, timeout) if nodes == "auto" else parse_nodes(nodes)
    chain = form_ring(addrs, model_path, key_bytes, ranges=ranges, rounds=rounds, n_ctx=n_ctx,
                      encoding=encoding)
    save_state(chain, model_path, {"encoding": encoding, "n_ctx": n_ctx, "key_file": key})

    def recover(_exc: Exception) -> RemoteChain:
        return reform_ring(addrs, model_path, key_bytes, n_ctx=n_ctx, encoding=encoding,
                           rounds=rounds, profile=False)

    return _head_for(cls, chain, model_path, spec=spec, draft=draft, n_ctx=n_ctx,
                     recover=recover, **engine)
