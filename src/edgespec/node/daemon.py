"""`edgespec node`: the daemon on each device. Hosts stage windows, advertises itself over mDNS,
and moves batches along the ring.

Frames a node handles (all over authenticated connections, see ``edgespec.wire.transport``):

- CONTROL ``{"op": ...}``: ``ping`` (heartbeat: answered at once, no probes), ``health``,
  ``profile``, ``probe_rtt`` (round trips to other members), ``load``, ``connect``, ``reset``, ``unload``, ``shard_*`` (shard upload),
  ``echo`` (bandwidth probe), ``shutdown``. Each is a typed request
  (``edgespec.wire.control``), served by the handler ``Node.CONTROL`` names for it; a
  malformed one is answered ``bad_request`` naming the field and reaches no handler.

One head at a time: the ops that change what the node holds or where it sends (``load``,
``connect``, ``reset``, ``unload``, ``shutdown``) are taken only from the head that holds the
node, named by the ``head`` identity it sends ({"id", "pid", "host", "what", "since"}). Another
head is refused with ``busy`` naming the holder, unless it asks to ``take_over`` (then the old
holder's connection is told and closed). The hold ends when the holder's connection closes.
Data frames (TOKENS / HIDDEN, KV_OPS, PRUNE) are served by ``StageLoop``
(``edgespec.node.datapath``), which ``Node`` inherits.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from edgespec import __version__
from edgespec.holder import PARENT_ENV, describe_holder
from edgespec.node import offload
from edgespec.node.datapath import HostedStage, StageLoop
from edgespec.node.info import release_free_heap, rss_bytes
from edgespec.tree.kvop import KvOp
from edgespec.wire import PROTOCOL_VERSION, FieldTag, Kind, Message, error_message, transfer
from edgespec.wire import control as ctl
from edgespec.wire.server import FrameServer
from edgespec.wire.transport import Connection, Frame

log = logging.getLogger("edgespec.node")

#: Control ops that only the head holding this node may send (see the module docstring).
HOLDER_OPS = frozenset(op for op, r in ctl.REQUESTS.items() if issubclass(r, ctl.HolderRequest))


class _Busy(Exception):
    """Another head holds this node."""


class Node(StageLoop):
    """A ring member: a FrameServer plus the stages it hosts (their data path is
    ``StageLoop``'s, ``edgespec.node.datapath``)."""

    def __init__(self, key: bytes, *, name: str | None = None, host: str = "0.0.0.0",
                 port: int = 0, cache_dir: str | os.PathLike[str] | None = None,
                 n_gpu_layers: int | None = None, n_threads: int | None = None,
                 node_id: str | None = None) -> None:
        from edgespec.llm import models
        from edgespec.node.info import load_or_create_node_id

        self.key = key
        self.cache_dir = Path(cache_dir) if cache_dir else models.home()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.name = name or socket.gethostname()
        self.n_gpu_layers = n_gpu_layers
        self.n_threads = n_threads
        self.hosted: dict[int, HostedStage] = {}
        self._out_conns: dict[tuple[str, int], Connection] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        # The head holding this node (see HOLDER_OPS) and its connection.
        self.holder: ctl.HeadIdentity | None = None
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
        self._rss_bare = 0  # resident memory when the last load began, holding no window

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
        # Connections first: a head finds the node gone, not its stages unloaded.
        self._stop.set()
        self.server.close()
        self._unload(goodbye="node shutting down")

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_disconnect(self, conn: Connection) -> None:
        with self._lock:
            for hosted in self.hosted.values():
                if hosted.head_conn is conn:
                    hosted.head_conn = None
            if conn is self._holder_conn:
                log.info("%s: released by %s", self.name,
                         describe_holder(self.holder.body() if self.holder else {}))
                self.holder, self._holder_conn = None, None

    def _check_holder(self, conn: Connection, req: ctl.HolderRequest) -> None:
        """Take the node for the head behind ``conn``, or refuse it (RingBusy semantics:
        the ERROR code is ``busy`` and names the holder)."""
        head = req.head or ctl.HeadIdentity(id=f"conn-{id(conn)}", what=f"peer {conn.peer_node}",
                                            pid="?", host=conn.peer_address[0],
                                            since=time.time())
        with self._lock:
            cur, cur_conn = self.holder, self._holder_conn
            if (cur is not None and cur_conn is not None and not cur_conn.closed
                    and cur_conn is not conn and cur.id != head.id):
                if not req.take_over:
                    raise _Busy(f"{self.name} is held by {describe_holder(cur.body())}; stop "
                                f"it, go through it (`edgespec chat --server URL` for a running "
                                f"serve), or pass --take-over to take the ring on purpose")
                log.warning("%s: %s takes over from %s", self.name, describe_holder(head.body()),
                            describe_holder(cur.body()))
                with contextlib.suppress(Exception):
                    cur_conn.send(error_message("taken_over", f"{self.name} was taken over by "
                                                              f"{describe_holder(head.body())}"))
                threading.Thread(target=cur_conn.close, args=("taken over",),
                                 daemon=True).start()
            elif cur is None or cur.id != head.id:
                log.info("%s: held by %s", self.name, describe_holder(head.body()))
            self.holder = head
            self._holder_conn = conn

    # ------------------------------------------------------------------ control

    def _on_control(self, conn: Connection, frame: Frame) -> Message:
        msg = frame.decode()
        blob = msg.fields.get(FieldTag.BLOB)
        try:
            op = ctl.op_of(msg.meta)
            if op not in self.CONTROL:
                raise ctl.ControlError(f"unknown control op {op!r}", "unknown_op")
            kind, handler = self.CONTROL[op]
            req = ctl.parse_as(kind, msg.meta, blob)
        except ctl.ControlError as e:
            # Answered, never raised: a malformed request is the sender's mistake, not a
            # failure of this node (docs/design.md 5.6).
            self.server.errors += 1
            log.warning("%s: refused a control message from %s: %s", self.name,
                        conn.peer_node, e)
            return error_message(e.code, str(e))
        if isinstance(req, ctl.Connect):
            # The caller's mistake is told first, whoever holds the node.
            for stage in req.links:
                self._hosted(stage)
        if isinstance(req, ctl.HolderRequest):
            try:
                self._check_holder(conn, req)
            except _Busy as e:
                log.warning("%s: refused %s from %s: %s", self.name, op, conn.peer_node, e)
                return error_message("busy", str(e))
        reply = handler(self, conn, req, blob)
        if isinstance(reply, tuple):
            return ctl.reply_message(reply[0], blob=reply[1])
        return ctl.reply_message(reply)

    def _op_ping(self, conn: Connection, req: ctl.Ping, blob: Any) -> ctl.Done:
        """The heartbeat: answered at once, never waiting on a probe (nvidia-smi, /proc)."""
        return ctl.Done()

    def _op_health(self, conn: Connection, req: ctl.Health, blob: Any) -> ctl.HealthReply:
        from edgespec.node.info import free_ram_bytes

        with self._lock:
            held = list(self.hosted.values())
            holder = self.holder
        stages = {}
        for s in held:
            if s.is_last:
                link = "head" if s.head_conn is not None and not s.head_conn.closed else "none"
            elif s.next_local is not None:
                link = f"local:{s.next_stage}"
            elif s.next_conn is not None and not s.next_conn.closed:
                host, port = s.next_conn.peer_address
                link = f"{host}:{port}"
            else:
                link = "none"
            stages[s.stage] = ctl.StageHealth(
                range=s.layer_range, batches=s.batches, merged=s.merged, busy_s=round(s.busy_s, 3),
                queued=s.inbox.qsize(), next=link, next_stage=s.next_stage, is_last=s.is_last,
                gpu_layers=getattr(s.runtime, "n_gpu_layers", None), samplers=len(s.worker.samplers or ()))
        return ctl.HealthReply(
            node_id=self.node_id, name=self.name, version=__version__, proto=PROTOCOL_VERSION,
            free_ram=free_ram_bytes(), **offload.device_report().as_dict(),
            gpu_layers=self.n_gpu_layers, rss=rss_bytes(), holder=holder, stages=stages,
            time=time.time())

    def _op_echo(self, conn: Connection, req: ctl.Echo, blob: Any) -> tuple[ctl.Done, Any]:
        return ctl.Done(), bytes(blob) if blob is not None else None

    def _op_probe_rtt(self, conn: Connection, req: ctl.ProbeRtt, blob: Any
                      ) -> ctl.ProbeRttReply:
        from edgespec.node.profiling import round_trips

        return ctl.ProbeRttReply(rtt_ms=round_trips(req.addresses, self.key, self.node_id,
                                                    self.name))

    def _resolve_model(self, model_path: str, want_fp: str | None) -> Path:
        from edgespec.llm.gguf_read import fingerprint

        path = Path(model_path)
        if path.is_file():
            if want_fp and fingerprint(path) != want_fp:
                raise ValueError(f"{path} on {self.name} is another model (fingerprint mismatch)")
            return path
        raise FileNotFoundError(f"model {path} is not on node {self.name}; send its shards")

    def _op_profile(self, conn: Connection, req: ctl.Profile, blob: Any) -> ctl.ProfileReply:
        from edgespec.node.profiling import profile_layers

        model = self._resolve_model(req.model_path, req.fingerprint)
        # Asked for a plan, whose load unloads the windows held now: what this process grew
        # by since it last held none is free for it (else a ring re-planned over its nodes
        # would find each short by its own window).
        held = max(0, rss_bytes() - self._rss_bare) if self.hosted else 0
        out = profile_layers(model, cache_dir=self.cache_dir / "shards", n_threads=self.n_threads,
                             n_gpu_layers=offload.profile_gpu_layers(self.n_gpu_layers),
                             batch_sizes=tuple(req.batch_sizes))
        out["free_ram"] += held
        return ctl.ProfileReply.model_validate(out)

    def _op_load(self, conn: Connection, req: ctl.Load, blob: Any) -> ctl.LoadReply:
        """Load windows [stage, first layer, stop, is_last] (``edgespec.wire.control.Load``)."""
        from edgespec.llm.shards import cut_window, shard_file_name
        from edgespec.node.runtime import StageRuntime

        sent = {stage: Path(p) for stage, p in (req.shard_paths or {}).items()}
        fp = req.fingerprint
        model = None
        if len(sent) < len(req.windows):
            try:
                model = self._resolve_model(req.model_path, fp)
            except FileNotFoundError:
                # The head will cut the windows from its copy and send them (resumable).
                return ctl.LoadReply(need_shards=True)
        self._unload()
        self._rss_bare = rss_bytes()
        loaded = []
        for stage, a, b, is_last in req.windows:
            if stage in sent:
                path = sent[stage]
                if not path.resolve().is_relative_to(self.shards.root.resolve()):
                    raise ValueError(f"shard path {path} is outside this node's shard store")
            else:
                assert model is not None
                shard_dir = self.cache_dir / "shards"
                path = cut_window(model, (a, b), shard_dir / shard_file_name(a, b, fp, model.stem))
            ngl, why = offload.choose_gpu_layers(path, req.n_ctx, self.n_gpu_layers)
            log.info("%s: stage %d (layers %d:%d): %s", self.name, stage, a, b, why)
            rt = StageRuntime(path, n_ctx=req.n_ctx, n_seq_max=req.n_seq_max,
                              n_threads=self.n_threads, n_gpu_layers=ngl,
                              expect_fingerprint=fp or None)
            hosted = HostedStage(stage, (a, b), rt, is_last, encoding=req.encoding)
            hosted.thread = threading.Thread(target=self._run_hosted, args=(hosted,),
                                           name=f"edgespec-stage-{stage}", daemon=True)
            hosted.thread.start()
            with self._lock:
                self.hosted[hosted.stage] = hosted
            loaded.append(hosted.stage)
        log.info("%s: loaded %s", self.name, ", ".join(
            f"stage {s} (layers {self.hosted[s].layer_range[0]}-{self.hosted[s].layer_range[1] - 1})"
            for s in loaded) or "nothing")
        return ctl.LoadReply(stages=loaded)

    def _op_reset(self, conn: Connection, req: ctl.Reset, blob: Any) -> ctl.Done:
        for hosted in self.hosted.values():
            hosted.post(("kv", KvOp.clear(), 0))
        return ctl.Done()

    def _op_shard(self, conn: Connection, req: ctl.ShardStatus | ctl.ShardChunk | ctl.ShardFinish,
                  blob: Any) -> ctl.Reply:
        return ctl.REPLIES[req.op].model_validate(transfer.handle(self.shards, req, blob))

    def _op_unload(self, conn: Connection, req: ctl.Unload, blob: Any) -> ctl.UnloadReply:
        had = sorted(self.hosted)
        self._unload()
        if had:
            log.info("%s: unloaded stage(s) %s", self.name, ", ".join(map(str, had)))
        return ctl.UnloadReply(unloaded=had)

    def _op_shutdown(self, conn: Connection, req: ctl.Shutdown, blob: Any) -> ctl.Done:
        threading.Timer(0.2, self._stop.set).start()
        return ctl.Done()

    #: Every control op this node serves: op -> (its request type, its handler). Nothing
    #: else is served; the request is parsed as that type before the handler sees it.
    CONTROL: ClassVar[dict[str, tuple[type[ctl.Request], Callable[..., Any]]]] = {
        "ping": (ctl.Ping, _op_ping),
        "health": (ctl.Health, _op_health),
        "echo": (ctl.Echo, _op_echo),
        "profile": (ctl.Profile, _op_profile),
        "probe_rtt": (ctl.ProbeRtt, _op_probe_rtt),
        "load": (ctl.Load, _op_load),
        "connect": (ctl.Connect, StageLoop._op_connect),
        "reset": (ctl.Reset, _op_reset),
        "unload": (ctl.Unload, _op_unload),
        "shutdown": (ctl.Shutdown, _op_shutdown),
        "shard_status": (ctl.ShardStatus, _op_shard),
        "shard_chunk": (ctl.ShardChunk, _op_shard),
        "shard_finish": (ctl.ShardFinish, _op_shard),
    }

    def _unload(self, goodbye: str | None = None) -> None:
        # The links to next nodes go first: they belong to the plan being dropped (linking
        # dials afresh), and a stage blocked sending to a node that stopped reading (its link
        # down, the reason for this re-plan) must fail now, not when that node comes back.
        # A re-plan says no goodbye: ``close`` would wait for such a stage's send lock.
        with self._lock:
            held, self.hosted = list(self.hosted.values()), {}
            links, self._out_conns = list(self._out_conns.values()), {}
        for conn in links:
            conn.close(goodbye)
        for hosted in held:
            hosted.stop()
            if hosted.thread is not None:
                hosted.thread.join(30)
            with contextlib.suppress(Exception):
                hosted.runtime.close()
        if held:
            release_free_heap()


# ---------------------------------------------------------------------- command line

def add_node_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=7654, help="TCP port to listen on (0 = any)")
    p.add_argument("--bind", default="0.0.0.0", help="address to listen on")
    p.add_argument("--name", default=None, help="name advertised on the LAN (default: hostname)")
    p.add_argument("--key-file", default=None,
                   help="ring key (default: $EDGESPEC_KEY_FILE, else ~/.config/edgespec/ring.key; "
                        "copy it from the head, where `edgespec keygen` made it)")
    p.add_argument("--cache", default=None, help="cache directory for models and shards")
    p.add_argument("--n-gpu-layers", type=int, default=None, metavar="L",
                   help="layers of each window to put on the GPU (0: none, -1: all); default: "
                        "as many as fit in the device's free memory with their KV cache")
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
    from edgespec.wire.discovery import local_addresses

    if bind not in ("0.0.0.0", "::", ""):
        return [bind]
    addrs = local_addresses()
    if not addrs:
        log.warning("no non-loopback interface: advertising 127.0.0.1 only (reachable from "
                    "this host alone)")
        return ["127.0.0.1"]
    return addrs


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
    from edgespec.node.info import describe_this_node
    from edgespec.wire.auth import load_key
    from edgespec.wire.discovery import advertise

    die_with_parent()
    key = load_key(args.key_file)
    node = Node(key, name=args.name, host=args.bind, port=args.port, cache_dir=args.cache,
                n_gpu_layers=args.n_gpu_layers, n_threads=args.threads)
    node.start()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: shutting down", signum)
        node._stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    host, port = node.address
    print(f"edgespec node {node.name} ({node.node_id}) on {host}:{port}", flush=True)
    print(f"edgespec node {node.name}: {offload.offload_summary(args.n_gpu_layers)}", flush=True)
    with contextlib.ExitStack() as stack:
        if not args.no_mdns:
            info = describe_this_node(node.name, port, node_id=node.node_id,
                                      cache_dirs=[node.cache_dir])
            stack.enter_context(advertise(info, addresses=advertised_addresses(host)))
        node.wait()
        node.close()  # before the slow mDNS goodbye: no head may connect to it meanwhile
    print(f"edgespec node {node.name} stopped", flush=True)
    return 0
