"""`edgespec node`: the daemon on each device. Hosts stage windows, advertises itself over mDNS,
and moves batches along the ring.

Frames a node handles (all over authenticated connections, see ``edgespec.transport``):

- CONTROL ``{"op": ...}``: ``ping`` (heartbeat: answered at once, no probes), ``health``,
  ``profile``, ``load``, ``connect``, ``reset``, ``unload``, ``shard_*`` (shard upload),
  ``echo`` (bandwidth probe), ``shutdown``.

One head at a time: the ops that change what the node holds or where it sends (``load``,
``connect``, ``reset``, ``unload``, ``shutdown``) are taken only from the head that holds the
node, named by the ``head`` identity it sends ({"id", "pid", "host", "what", "since"}). Another
head is refused with ``busy`` naming the holder, unless it asks to ``take_over`` (then the old
holder's connection is told and closed). The hold ends when the holder's connection closes.
- TOKENS / HIDDEN: a batch for one of this node's stages (``META.stage``). It joins that
  stage's queue; the stage's worker thread applies the batch's KV operations, drops rows of
  pruned tree nodes, runs the window, and sends the hidden states to the next stage (directly,
  node to node, not through the head) or, on the last stage, the target tokens to the head.
- KV_OPS: KV operations ordered with the batches (they travel the ring like a batch).
- PRUNE: tree nodes rejected by the head's verifier. Applied at once, so rows of those nodes
  still queued or in flight are dropped before they cost compute.

A failure inside a stage is reported to the head as an ERROR frame; the node keeps serving.
A link to the next node that breaks is dropped (reported to the head as ``next_lost``, which it
treats as a lost node) and dialled afresh whenever the ring is linked again.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgespec import __version__, transfer
from edgespec.chain import StageWorker
from edgespec.frames import batch_message, message_batch, result_message
from edgespec.laps import now, stamps_from_meta
from edgespec.nodeinfo import describe_holder
from edgespec.transport import Connection, Frame, FrameServer, TransportError, connect
from edgespec.wire import (
    PROTOCOL_VERSION,
    FieldTag,
    Kind,
    Message,
    WireError,
    error_message,
    kv_ops_list,
)

log = logging.getLogger("edgespec.node")

#: Largest batch the profile op times (a tree lap's batch is at most the tree budget).
PROFILE_MAX_BATCH = 256

#: Control ops that only the head holding this node may send (see the module docstring).
HOLDER_OPS = frozenset({"load", "connect", "reset", "unload", "shutdown"})

#: Seconds to dial the next node when linking (a node that does not answer fails the link).
LINK_TIMEOUT_S = 10.0



@dataclass
class StageSlot:
    """One hosted window: its runtime, its place in the ring, and its worker thread."""

    stage: int
    layer_range: tuple[int, int]
    runtime: Any
    is_last: bool
    worker: StageWorker = field(init=False)
    inbox: queue.Queue = field(default_factory=queue.Queue)
    next_local: StageSlot | None = None
    next_conn: Connection | None = None
    next_stage: int = -1
    head_conn: Connection | None = None
    encoding: str = "f32"
    thread: threading.Thread | None = None
    busy_s: float = 0.0
    batches: int = 0

    def __post_init__(self) -> None:
        self.worker = StageWorker([self.runtime], is_last=self.is_last)


class _Busy(Exception):
    """Another head holds this node."""


class _LinkLost(Exception):
    """The link to the next node is gone (the head re-plans the ring)."""


def _rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Node:
    """A ring member: a FrameServer plus the stages it hosts."""

    def __init__(self, key: bytes, *, name: str | None = None, host: str = "0.0.0.0",
                 port: int = 0, cache_dir: str | os.PathLike[str] | None = None,
                 n_gpu_layers: int = 0, n_threads: int | None = None,
                 node_id: str | None = None) -> None:
        from edgespec import models
        from edgespec.nodeinfo import load_or_create_node_id

        self.key = key
        self.cache_dir = Path(cache_dir) if cache_dir else models.home()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.name = name or socket.gethostname()
        self.n_gpu_layers = n_gpu_layers
        self.n_threads = n_threads
        self.slots: dict[int, StageSlot] = {}
        self._out_conns: dict[tuple[str, int], Connection] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        # The head holding this node (see HOLDER_OPS) and its connection.
        self.holder: dict | None = None
        self._holder_conn: Connection | None = None
        if node_id is None:
            # One id per node process, stable across restarts on the same port: several
            # nodes on one host (one cache folder) must not share an id, or logs and the ring
            # table could not tell them apart. A port of 0 is resolved by binding first.
            base = load_or_create_node_id(self.cache_dir)
            probe = FrameServer(key, node_id=base, host=host, port=port,
                                on_disconnect=self._on_disconnect)
            node_id = hashlib.sha256(f"{base}:{probe.address[1]}".encode()).hexdigest()[:16]
            probe.node_id = node_id
            self.server = probe
        else:
            self.server = FrameServer(key, node_id=node_id, host=host, port=port,
                                      on_disconnect=self._on_disconnect)
        self.node_id = node_id
        self.shards = transfer.ShardStore(self.cache_dir / "received")
        self.server.register(Kind.CONTROL, self._on_control)
        self.server.register(Kind.TOKENS, self._on_batch)
        self.server.register(Kind.HIDDEN, self._on_batch)
        self.server.register(Kind.KV_OPS, self._on_kv)
        self.server.register(Kind.PRUNE, self._on_prune)
        self._uploads: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifetime

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def start(self) -> Node:
        self.server.start()
        return self

    def wait(self) -> None:
        while not self._stop.wait(0.5):
            pass

    def close(self) -> None:
        self._stop.set()
        self._unload()
        self.server.close()
        for c in list(self._out_conns.values()):
            c.close("node shutting down")
        self._out_conns.clear()

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_disconnect(self, conn: Connection) -> None:
        with self._lock:
            for slot in self.slots.values():
                if slot.head_conn is conn:
                    slot.head_conn = None
            if conn is self._holder_conn:
                log.info("%s: released by %s", self.name, describe_holder(self.holder or {}))
                self.holder, self._holder_conn = None, None

    def _check_holder(self, conn: Connection, meta: dict) -> None:
        """Take the node for the head behind ``conn``, or refuse it (RingBusy semantics:
        the ERROR code is ``busy`` and names the holder)."""
        head = meta.get("head")
        if not isinstance(head, dict) or not isinstance(head.get("id"), str):
            head = {"id": f"conn-{id(conn)}", "what": f"peer {conn.peer_node}", "pid": "?",
                    "host": conn.peer_address[0], "since": time.time()}
        with self._lock:
            cur, cur_conn = self.holder, self._holder_conn
            if (cur is not None and cur_conn is not None and not cur_conn.closed
                    and cur_conn is not conn and cur.get("id") != head["id"]):
                if not meta.get("take_over"):
                    raise _Busy(f"{self.name} is held by {describe_holder(cur)}; stop it, go "
                                f"through it (`edgespec chat --server URL` for a running serve), "
                                f"or pass --take-over to take the ring on purpose")
                log.warning("%s: %s takes over from %s", self.name, describe_holder(head),
                            describe_holder(cur))
                with contextlib.suppress(Exception):
                    cur_conn.send(error_message("taken_over", f"{self.name} was taken over by "
                                                              f"{describe_holder(head)}"))
                threading.Thread(target=cur_conn.close, args=("taken over",),
                                 daemon=True).start()
            elif cur is None or cur.get("id") != head["id"]:
                log.info("%s: held by %s", self.name, describe_holder(head))
            self.holder = {k: head.get(k) for k in ("id", "pid", "host", "what", "since")}
            self._holder_conn = conn

    # ------------------------------------------------------------------ data path

    def _slot(self, msg_stage: int) -> StageSlot:
        slot = self.slots.get(msg_stage)
        if slot is None:
            raise WireError(f"stage {msg_stage} is not hosted by node {self.name}")
        return slot

    def _on_batch(self, conn: Connection, frame: Frame) -> Message | None:
        try:
            try:
                msg = frame.decode()
                batch, hidden, stage = message_batch(msg)
            except (ValueError, KeyError) as e:  # schema-valid frame, inconsistent contents
                raise WireError(f"bad batch: {e}") from None
            # Lap timing (docs/design.md 8.1): earlier stages' stamps, then this stage's arrival.
            batch.timing = stamps_from_meta(msg.meta.get("timing"))
            batch.timing.append([stage, now(), 0.0, 0.0, 0.0])
            slot = self._slot(stage)
            if hidden is None and slot.stage != 0:
                raise WireError(f"stage {stage} takes hidden states, not token ids")
            if hidden is not None and slot.stage == 0:
                raise WireError("stage 0 takes token ids, not hidden states")
            self._check_batch(slot, batch, hidden)
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
        slot.inbox.put(("batch", batch, hidden))
        return None

    def _check_batch(self, slot: StageSlot, batch: Any, hidden: np.ndarray | None) -> None:
        """Refuse, before it is queued, a batch this stage could never run: the sender gets
        an ERROR reply at once, and a bad frame never reaches llama.cpp. Only checks that do
        not depend on the KV cache belong here; position continuity is the runtime's (it is
        known only when the batch's turn comes)."""
        rt = slot.runtime
        n = len(batch)
        n_seq_max = int(getattr(rt, "n_seq_max", 0) or 0)
        if n_seq_max:
            top = max((max(s) for s in batch.seq_ids if s), default=0)
            if top >= n_seq_max:
                raise WireError(f"seq id {top} outside 0..{n_seq_max - 1} of stage {slot.stage}")
        if hidden is None:
            n_vocab = int(getattr(rt, "n_vocab", 0) or 0)
            if n_vocab and n and int(batch.tokens.max()) >= n_vocab:
                raise WireError(f"token id {int(batch.tokens.max())} outside the vocabulary "
                                f"0..{n_vocab - 1}")
        else:
            n_embd = int(getattr(rt, "n_embd", 0) or 0)
            if hidden.ndim != 2 or hidden.shape[0] != n or (n_embd and hidden.shape[1] != n_embd):
                raise WireError(f"stage {slot.stage} takes hidden states [{n}, {n_embd}], got "
                                f"{list(hidden.shape)}")

    def _on_kv(self, conn: Connection, frame: Frame) -> None:
        msg = frame.decode()
        ops = kv_ops_list(msg[FieldTag.KV_OPS])
        slot = self._slot(int(msg.meta.get("stage", 0)))
        slot.inbox.put(("kv", ops, msg.lap_id))
        return None

    def _on_prune(self, conn: Connection, frame: Frame) -> None:
        msg = frame.decode()
        nodes = np.asarray(msg[FieldTag.NODES]).tolist()
        for slot in list(self.slots.values()):
            slot.worker.prune(msg.lap_id, nodes, ())
        return None

    def _run_slot(self, slot: StageSlot) -> None:
        while True:
            item = slot.inbox.get()
            if item is None:
                return
            kind, a, b = item
            try:
                if kind == "kv":
                    slot.worker.apply_ops(a)
                    self._send_on(slot, "kv", (a, b))
                    continue
                stamp = a.timing[-1] if a.timing else [slot.stage, 0.0, 0.0, 0.0, 0.0]
                stamp[2], cpu = now(), time.thread_time()
                t = time.perf_counter()
                batch, out = slot.worker.run(a, b)
                slot.busy_s += time.perf_counter() - t
                stamp[3], stamp[4] = now(), time.thread_time() - cpu
                slot.batches += 1
                if slot.is_last:
                    targets = out if out is not None else np.zeros(0, np.int32)
                    msg = result_message(batch, targets)
                    msg.fields[FieldTag.META] = {"timing": batch.timing}
                    self._to_head(slot, msg)
                elif out is None:
                    # Every row was pruned on the way: the head still expects an answer.
                    self._send_on(slot, "empty", batch)
                else:
                    self._send_on(slot, "batch", (batch, out))
            except _LinkLost as e:  # the head treats it as a lost node (re-plans)
                log.warning("%s", e)
                msg = error_message("next_lost", str(e))
                msg.lap_id = a.lap if kind == "batch" else int(b or 0)
                self._to_head(slot, msg)
            except Exception as e:  # reported to the head; the stage keeps serving
                log.exception("stage %d failed", slot.stage)
                lap = a.lap if kind == "batch" else int(b or 0)
                msg = error_message("stage_failed", f"stage {slot.stage} on {self.name}: "
                                    f"{type(e).__name__}: {e}")
                msg.lap_id = lap
                self._to_head(slot, msg)

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
                heads = {id(s.head_conn): s for s in self.slots.values()
                         if s.next_conn is out and s.head_conn is not None}
            for slot in heads.values():
                err = error_message("next_refused", f"stage {slot.stage} on {self.name}: {text}")
                err.lap_id = msg.lap_id
                self._to_head(slot, err)

    def _to_head(self, slot: StageSlot, msg: Message) -> None:
        conn = slot.head_conn
        if conn is None:
            log.warning("stage %d: no head connected; dropping %s", slot.stage, msg.kind.name)
            return
        try:
            conn.send(msg)
        except TransportError as e:
            log.warning("stage %d: head unreachable: %s", slot.stage, e)

    def _send_on(self, slot: StageSlot, kind: str, payload: Any) -> None:
        """Pass work to the next stage: in-process when this node hosts it, else over TCP."""
        if slot.is_last:
            return
        if kind == "empty":
            batch = payload
            # Every row was pruned: rather than send a placeholder on through the ring (which
            # would cost compute), tell the head directly that nothing of it survived. The
            # batch's KV operations (a new leaf's prefix copy, a decided round's commit) still
            # go on, in ring order: the later stages must apply them exactly as this one did.
            if batch.pre_ops:
                self._send_on(slot, "kv", (list(batch.pre_ops), batch.lap))
            self._to_head(slot, result_message(batch.select(np.zeros(len(batch), bool)),
                                               np.zeros(0, np.int32)))
            return
        if slot.next_local is not None:
            if kind == "kv":
                slot.next_local.inbox.put(("kv", *payload))
            else:
                batch, hidden = payload
                # A copy, not a view: the hidden states live in this window's capture buffer,
                # which its next decode overwrites while the next window may still be queued.
                batch.timing.append([slot.next_local.stage, now(), 0.0, 0.0, 0.0])
                slot.next_local.inbox.put(("batch", batch, np.array(hidden, copy=True)))
            return
        conn = slot.next_conn
        if conn is None or conn.closed:
            raise _LinkLost(f"stage {slot.stage} on {self.name} has no live link to the next "
                            f"stage ({slot.next_stage}); the ring must be linked again")
        try:
            if kind == "kv":
                ops, lap = payload
                conn.send(Message(Kind.KV_OPS, {FieldTag.KV_OPS: list(ops),
                                                 FieldTag.META: {"stage": slot.next_stage}},
                                  lap_id=int(lap or 0)))
            else:
                batch, hidden = payload
                msg = batch_message(batch, hidden, slot.encoding, stage=slot.next_stage)
                msg.meta["timing"] = batch.timing
                conn.send(msg)
        except TransportError as e:
            self._drop_link(conn)
            raise _LinkLost(f"stage {slot.stage} on {self.name}: link to the next node "
                            f"{conn.peer_node} broke: {e}") from e

    def _drop_link(self, conn: Connection) -> None:
        """Forget a broken link to a next node; the next ``connect`` dials it afresh."""
        with self._lock:
            for addr, c in list(self._out_conns.items()):
                if c is conn:
                    del self._out_conns[addr]
            for slot in self.slots.values():
                if slot.next_conn is conn:
                    slot.next_conn = None
        with contextlib.suppress(Exception):
            conn.close()

    # ------------------------------------------------------------------ control

    def _on_control(self, conn: Connection, frame: Frame) -> Message:
        msg = frame.decode()
        op = str(msg.meta.get("op", ""))
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            return error_message("unknown_op", f"unknown control op {op!r}")
        if op == "connect":
            # The caller's mistake is told first, whoever holds the node.
            links = msg.meta.get("links")
            if not isinstance(links, dict):
                raise WireError("connect: 'links' must be an object {stage: link}")
            for stage_s in links:
                self._slot(int(stage_s))
        if op in HOLDER_OPS:
            try:
                self._check_holder(conn, msg.meta)
            except _Busy as e:
                log.warning("%s: refused %s from %s: %s", self.name, op, conn.peer_node, e)
                return error_message("busy", str(e))
        body = handler(conn, msg.meta, msg.fields.get(FieldTag.BLOB)) or {}
        blob = body.pop("_blob", None)
        fields: dict[FieldTag, Any] = {FieldTag.META: {"ok": True, **body}}
        if blob is not None:
            fields[FieldTag.BLOB] = blob
        return Message(Kind.REPLY, fields)

    def _op_ping(self, conn: Connection, meta: dict, blob: Any) -> dict:
        """The heartbeat: answered at once, never waiting on a probe (nvidia-smi, /proc)."""
        return {}

    def _op_health(self, conn: Connection, meta: dict, blob: Any) -> dict:
        from edgespec.nodeinfo import detect_backend, free_ram_bytes, free_vram_bytes

        with self._lock:
            slots = list(self.slots.values())
            holder = dict(self.holder) if self.holder else None
        stages = {}
        for s in slots:
            if s.is_last:
                link = "head" if s.head_conn is not None and not s.head_conn.closed else "none"
            elif s.next_local is not None:
                link = f"local:{s.next_stage}"
            elif s.next_conn is not None and not s.next_conn.closed:
                host, port = s.next_conn.peer_address
                link = f"{host}:{port}"
            else:
                link = "none"
            stages[str(s.stage)] = {"range": list(s.layer_range), "batches": s.batches,
                                    "busy_s": round(s.busy_s, 3), "queued": s.inbox.qsize(),
                                    "next": link, "next_stage": s.next_stage,
                                    "is_last": s.is_last}
        return {
            "node_id": self.node_id, "name": self.name, "version": __version__,
            "proto": PROTOCOL_VERSION, "backend": detect_backend(),
            "free_ram": free_ram_bytes(), "free_vram": free_vram_bytes(),
            "rss": _rss_bytes(), "holder": holder, "stages": stages, "time": time.time(),
        }

    def _op_echo(self, conn: Connection, meta: dict, blob: Any) -> dict:
        return {"_blob": bytes(blob) if blob is not None else None}

    def _resolve_model(self, meta: dict) -> Path:
        from edgespec.shard import fingerprint

        path = Path(str(meta.get("model_path", "")))
        want_fp = meta.get("fingerprint")
        if path.is_file():
            if want_fp and fingerprint(path) != want_fp:
                raise ValueError(f"{path} on {self.name} is another model (fingerprint mismatch)")
            return path
        raise FileNotFoundError(f"model {path} is not on node {self.name}; send its shards")

    def _op_profile(self, conn: Connection, meta: dict, blob: Any) -> dict:
        from edgespec.profile import profile_layers

        sizes = meta.get("batch_sizes", (1, 4, 16))
        # Bounded: a profile context holds 2 x the largest batch; a typo must not ask for GBs.
        if (not isinstance(sizes, (list, tuple)) or not sizes
                or not all(isinstance(b, int) and 1 <= b <= PROFILE_MAX_BATCH for b in sizes)):
            raise WireError(f"profile: batch_sizes must be a non-empty list of integers in "
                            f"1..{PROFILE_MAX_BATCH}, got {sizes!r}")
        model = self._resolve_model(meta)
        return profile_layers(model, cache_dir=self.cache_dir / "shards",
                              n_threads=self.n_threads, n_gpu_layers=self.n_gpu_layers,
                              batch_sizes=tuple(int(b) for b in sizes))

    def _op_load(self, conn: Connection, meta: dict, blob: Any) -> dict:
        """Load windows: {"model_path", "fingerprint", "windows": [[stage, a, b, is_last]],
        "n_ctx", "n_seq_max", "encoding"}."""
        from edgespec.shard import cut_window
        from edgespec.stage import StageRuntime

        sent = {int(k): Path(v) for k, v in (meta.get("shard_paths") or {}).items()}
        fp = str(meta.get("fingerprint", ""))
        model = None
        if len(sent) < len(meta["windows"]):
            try:
                model = self._resolve_model(meta)
            except FileNotFoundError:
                # The head will cut the windows from its copy and send them (resumable).
                return {"need_shards": True}
        self._unload()
        loaded = []
        for stage, a, b, is_last in meta["windows"]:
            if int(stage) in sent:
                path = sent[int(stage)]
                if not path.resolve().is_relative_to(self.shards.root.resolve()):
                    raise ValueError(f"shard path {path} is outside this node's shard store")
            else:
                assert model is not None
                shard_dir = self.cache_dir / "shards"
                path = cut_window(model, (int(a), int(b)),
                                  shard_dir / f"{model.stem}.{fp[:12] or 'x'}"
                                              f".L{int(a):03d}-{int(b):03d}.gguf")
            rt = StageRuntime(path, n_ctx=int(meta.get("n_ctx", 4096)),
                              n_seq_max=int(meta.get("n_seq_max", 256)),
                              n_threads=self.n_threads, n_gpu_layers=self.n_gpu_layers,
                              expect_fingerprint=fp or None)
            slot = StageSlot(int(stage), (int(a), int(b)), rt, bool(is_last),
                             encoding=str(meta.get("encoding", "f32")))
            slot.thread = threading.Thread(target=self._run_slot, args=(slot,),
                                           name=f"edgespec-stage-{stage}", daemon=True)
            slot.thread.start()
            with self._lock:
                self.slots[slot.stage] = slot
            loaded.append(slot.stage)
        log.info("%s: loaded %s", self.name, ", ".join(
            f"stage {s} (layers {self.slots[s].layer_range[0]}-{self.slots[s].layer_range[1] - 1})"
            for s in loaded) or "nothing")
        return {"stages": loaded}

    def _op_connect(self, conn: Connection, meta: dict, blob: Any) -> dict:
        """Wire each hosted stage to its successor: {"links": {stage: {"host", "port",
        "stage"} | {"local": stage} | "head"}}. Results and errors go to this connection."""
        fresh: dict[tuple[str, int], Connection] = {}
        for stage_s, link in meta["links"].items():
            slot = self._slot(int(stage_s))
            slot.head_conn = conn
            slot.next_local, slot.next_conn = None, None
            if link == "head":
                continue
            slot.next_stage = int(link["stage"])
            if "local" in link:
                slot.next_local = self._slot(int(link["local"]))
                continue
            addr = (str(link["host"]), int(link["port"]))
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
                log.info("%s: linked stage %d to %s at %s:%d", self.name, slot.stage,
                         out.peer_node, *addr)
            slot.next_conn = out
        for slot in self.slots.values():
            slot.head_conn = conn
        return {"connected": sorted(self.slots)}

    def _op_reset(self, conn: Connection, meta: dict, blob: Any) -> dict:
        for slot in self.slots.values():
            slot.inbox.put(("kv", kv_ops_list([(1, 0, -1, -1, 0), (3, 0, -1, -1, 0)]), 0))
        return {}

    def _op_shard_status(self, conn: Connection, meta: dict, blob: Any) -> dict:
        return transfer.handle(self.shards, meta, blob)

    _op_shard_chunk = _op_shard_status
    _op_shard_finish = _op_shard_status

    def _op_unload(self, conn: Connection, meta: dict, blob: Any) -> dict:
        had = sorted(self.slots)
        self._unload()
        if had:
            log.info("%s: unloaded stage(s) %s", self.name, ", ".join(map(str, had)))
        return {"unloaded": had}

    def _op_shutdown(self, conn: Connection, meta: dict, blob: Any) -> dict:
        threading.Timer(0.2, self._stop.set).start()
        return {}

    def _unload(self) -> None:
        with self._lock:
            slots, self.slots = list(self.slots.values()), {}
        for slot in slots:
            slot.inbox.put(None)
            if slot.thread is not None:
                slot.thread.join(30)
            with contextlib.suppress(Exception):
                slot.runtime.close()


# ---------------------------------------------------------------------- command line

def add_node_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=7654, help="TCP port to listen on (0 = any)")
    p.add_argument("--bind", default="0.0.0.0", help="address to listen on")
    p.add_argument("--name", default=None, help="name advertised on the LAN (default: hostname)")
    p.add_argument("--key-file", default=None,
                   help="ring key (default: $EDGESPEC_KEY_FILE, else ~/.config/edgespec/ring.key; "
                        "copy it from the head, where `edgespec keygen` made it)")
    p.add_argument("--cache", default=None, help="cache directory for models and shards")
    p.add_argument("--n-gpu-layers", type=int, default=0, help="layers to offload to a GPU")
    p.add_argument("--threads", type=int, default=None,
                   help="llama.cpp threads (default: physical cores / hosted windows)")
    p.add_argument("--no-mdns", action="store_true", help="do not advertise over mDNS")


def advertised_addresses(bind: str) -> list[str]:
    """The addresses to put in the mDNS record of a node listening on ``bind``.

    A node bound to one address is reachable there only. A node bound to the wildcard is
    reachable on every interface: advertise each non-loopback IPv4 address of this host (in a
    network namespace that is the namespace's own, e.g. its bridge address), never 0.0.0.0,
    which would send the head to itself. With no LAN interface at all (a host with only
    loopback) the node is advertised on 127.0.0.1, so a head on the same host still finds it.
    """
    from edgespec.discovery import local_addresses

    if bind not in ("0.0.0.0", "::", ""):
        return [bind]
    addrs = local_addresses()
    if not addrs:
        log.warning("no non-loopback interface: advertising 127.0.0.1 only (reachable from "
                    "this host alone)")
        return ["127.0.0.1"]
    return addrs


#: Set by a head that starts node processes itself (``Ring.local``) to its own pid.
PARENT_ENV = "EDGESPEC_PARENT_PID"


def die_with_parent() -> None:
    """In a node a head started: ask Linux for SIGTERM when that head dies (prctl
    PR_SET_PDEATHSIG), and stop at once if it is already gone. Elsewhere a no-op."""
    want = os.environ.get(PARENT_ENV)
    if not want:
        return
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    if str(os.getppid()) != want:  # the head died before the request took effect
        raise SystemExit(f"edgespec node: the head that started this node (pid {want}) is gone")


def run_node_command(args: argparse.Namespace) -> int:
    from edgespec.auth import load_key
    from edgespec.discovery import advertise
    from edgespec.nodeinfo import describe_this_node

    die_with_parent()
    key = load_key(args.key_file)
    node = Node(key, name=args.name, host=args.bind, port=args.port, cache_dir=args.cache,
                n_gpu_layers=args.n_gpu_layers, n_threads=args.threads)
    node.start()
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()
        node._stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    host, port = node.address
    print(f"edgespec node {node.name} ({node.node_id}) on {host}:{port}", flush=True)
    with contextlib.ExitStack() as stack:
        if not args.no_mdns:
            info = describe_this_node(node.name, port, node_id=node.node_id,
                                      cache_dirs=[node.cache_dir])
            stack.enter_context(advertise(info, addresses=advertised_addresses(host)))
        node.wait()
    node.close()
    print(f"edgespec node {node.name} stopped", flush=True)
    return 0
