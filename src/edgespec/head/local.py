"""A ring on this one machine: N node processes on loopback (the same code path as a LAN
ring), or all windows in this process. Used by ``Ring.local``, ``edgespec demo`` and tests."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from edgespec import models
from edgespec.node import PARENT_ENV

_LISTEN = re.compile(r"edgespec node \S+ \((\S+)\) on ([\d.]+):(\d+)")


class LocalNodes:
    """``n`` `edgespec node` processes on 127.0.0.1, one llama.cpp thread each."""

    def __init__(self, n: int, key_file: Path, *, threads: int = 1, verbose: bool = False,
                 cache_dir: Path | None = None, startup_timeout: float = 60.0) -> None:
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[tuple[str, int]] = []
        env = dict(os.environ)
        # Several contexts share the cores: passive OpenMP waiting (busy-waiting threads of
        # several processes starve each other).
        env.setdefault("OMP_WAIT_POLICY", "passive")
        # The node asks the kernel for SIGTERM when this process dies (see
        # edgespec.node.die_with_parent), so a killed head leaves no node behind.
        env[PARENT_ENV] = str(os.getpid())
        try:
            for i in range(n):
                cmd = [sys.executable, "-m", "edgespec"] + (["-v"] if verbose else []) + [
                    "node", "--port", "0", "--bind", "127.0.0.1", "--no-mdns",
                    "--name", f"local{i}", "--key-file", str(key_file),
                    "--threads", str(threads)]
                if cache_dir is not None:
                    cmd += ["--cache", str(cache_dir)]
                # A session of their own: Ctrl-C in the head's terminal (the chat CLI stops the
                # current answer with it) must not reach the nodes, which would stop them.
                p = _spawn(cmd, stdout=subprocess.PIPE, stderr=None if verbose else
                           subprocess.DEVNULL, text=True, env=env, start_new_session=True)
                self.procs.append(p)
            deadline = time.monotonic() + startup_timeout
            for p in self.procs:
                line = ""
                while time.monotonic() < deadline:
                    line = p.stdout.readline() if p.stdout else ""
                    if not line and p.poll() is not None:
                        raise RuntimeError(f"local node exited with code {p.returncode}")
                    m = _LISTEN.search(line)
                    if m:
                        self.addresses.append((m.group(2), int(m.group(3))))
                        break
                else:
                    raise RuntimeError("local node did not start in time")
                # Keep draining stdout so the node never blocks on a full pipe.
                threading.Thread(target=_drain, args=(p,), daemon=True).start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []


_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _spawn(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """Popen from one long-lived thread of this process. Linux ties a child's death signal
    (PR_SET_PDEATHSIG, asked for by the node) to the *thread* that forked it: a ring opened
    in a short-lived thread (a worker of some script or server) would otherwise see its nodes
    stopped when that thread ends."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="edgespec-spawner")
    return _spawner.submit(subprocess.Popen, cmd, **kwargs).result()


def _drain(p: subprocess.Popen) -> None:
    with contextlib.suppress(Exception):
        for _ in p.stdout:  # type: ignore[union-attr]
            pass


def make_drafter(model_path: Path, draft: str | os.PathLike[str] | None, kind: str = "auto",
                 draft_quant: str = "q4_0"):
    """The head's drafter: retrieval alone, the draft model, or hybrid retrieval + model.

    ``kind="auto"``: the draft model when one is given (in flow mode it beat hybrid 2.08x to
    1.01x over ``none``: 1.5B target, 4 stages, 10 ms hops, 4 HumanEval prompts; retrieval's
    guesses take the hybrid's small per-segment budget first and are accepted less often),
    else retrieval. ``draft_quant``: draft with a cached Q4_0 copy of the draft model
    (``"none"``: as given); see :mod:`edgespec.spec.draft_quant` for why that never changes the
    output."""
    from edgespec.spec import RetrievalDrafter

    if draft is None or kind == "retrieval":
        return RetrievalDrafter()
    from edgespec.spec import DraftModelDrafter, HybridDrafter
    from edgespec.spec.draft_quant import fast_draft

    draft_path = fast_draft(models.resolve(draft), draft_quant)
    model_drafter = DraftModelDrafter(draft_path, target=model_path)
    if kind in ("model", "auto"):
        return model_drafter
    return HybridDrafter(RetrievalDrafter(), model_drafter)


def open_local_ring(cls, model: str | os.PathLike[str], stages: int, *, draft=None,
                    spec: str = "auto", n_ctx: int = 4096, processes: bool = True,
                    verbose: bool = False, drafter: str = "auto",
                    encoding: str = "f32", threads: int = 1, proxy=None,
                    ranges=None, rounds: int = 1, draft_quant: str = "q4_0", **engine: Any):
    """Build a ``Ring`` (class ``cls``) over ``stages`` windows of ``model`` on this host."""
    from edgespec.llamacpp import Tokenizer, load_model, set_verbose
    from edgespec.shard import even_ranges, read_info

    set_verbose(verbose)
    model_path = models.resolve(model)
    if draft is not None and drafter != "retrieval":
        # A draft of another family is refused before any node process starts.
        from edgespec.spec.draft_model import check_draft_tokenizer

        check_draft_tokenizer(models.resolve(draft), model_path)
    info = read_info(model_path)
    tok_model = load_model(model_path, vocab_only=True)
    tokenizer = Tokenizer(tok_model)
    cleanup: list[Any] = [tok_model.close]
    recover = None
    nodes = None
    try:
        if processes:
            from edgespec.auth import write_key
            from edgespec.head.remote import form_ring, head_identity, reform_ring

            tmp = tempfile.TemporaryDirectory(prefix="edgespec-local-")
            cleanup.append(tmp.cleanup)
            key_file = write_key(Path(tmp.name) / "ring.key")
            from edgespec.auth import load_key

            key = load_key(key_file)
            nodes = LocalNodes(stages // rounds if rounds > 1 else stages, key_file,
                               threads=threads, verbose=verbose)
            cleanup.insert(0, nodes.close)
            # Every node has read the key by the time it listens: remove it from disk now, so
            # a head that is killed leaves no key folder behind.
            tmp.cleanup()
            rngs = ranges or even_ranges(info.n_layer, stages)
            quiet = print if verbose else (lambda s: None)
            head = head_identity()
            chain = form_ring(nodes.addresses, model_path, key, ranges=rngs,
                              rounds=rounds, n_ctx=n_ctx, encoding=encoding, profile=False,
                              proxy=proxy, log_fn=quiet, head=head)
            cleanup.insert(0, chain.close)

            def recover(_exc: Exception):
                # Node processes that died are gone for good; the survivors take their layers.
                live = [a for p, a in zip(nodes.procs, nodes.addresses, strict=True)
                        if p.poll() is None]
                return reform_ring(live, model_path, key, n_ctx=n_ctx, encoding=encoding,
                                   profile=False, proxy=proxy, log_fn=quiet, head=head)
        else:
            from edgespec.chain import LocalChain
            from edgespec.shard import cut_window, fingerprint
            from edgespec.stage import StageRuntime

            fp = fingerprint(model_path)
            shard_dir = models.home() / "shards"
            runtimes = []
            for a, b in (ranges or even_ranges(info.n_layer, stages)):
                path = cut_window(model_path, (a, b), shard_dir / f"{model_path.stem}."
                                  f"{fp[:12]}.L{a:03d}-{b:03d}.gguf")
                rt = StageRuntime(path, n_ctx=n_ctx, n_seq_max=256, n_threads=threads)
                runtimes.append(rt)
                cleanup.insert(0, rt.close)
            chain = LocalChain(runtimes, info.n_vocab)
        drafter_obj = make_drafter(model_path, draft, drafter, draft_quant)
    except BaseException:
        for fn in cleanup:
            with contextlib.suppress(Exception):
                fn()
        raise

    def on_close() -> None:
        for fn in cleanup:
            with contextlib.suppress(Exception):
                fn()

    ring = cls(chain, tokenizer, model_name=Path(model_path).stem, spec=spec,
               drafter_factory=lambda: drafter_obj, n_ctx=n_ctx, on_close=on_close,
               engine_options=engine, recover=recover)
    ring.local_nodes = nodes  # the node processes (None when all windows run in-process)
    return ring
