"""A chain of layer windows run one after the other on this machine: the one-machine path.

Over 450 lines: LocalPipeline, StageProcess and its RemoteWindow proxy are one reference
implementation (and its child-process protocol) that the ring tests compare against.

:class:`LocalPipeline` passes a batch through its windows in layer order (token ids into the
first, hidden states between windows, logits out of the last) and broadcasts KV operations to
every window. Its windows are anything with the :class:`Window` interface: in-process
:class:`~edgespec.node.runtime.StageRuntime` objects, or :class:`RemoteWindow` proxies for windows hosted
by a :class:`StageProcess` (a child process holding several windows of the model, prima.cpp's
"k rounds per lap": with 2 processes x 2 windows each, a lap visits each process twice).

The networked ring (edgespec.head) does the same over sockets; this module is also the reference
it is tested against. Test scaffolding, not part of the package: nodes run windows through
``edgespec.node``.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import threading
import traceback
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from stage_host import StageHost

from edgespec.llm.gguf_read import ShardError
from edgespec.llm.shards import MANIFEST_NAME, Manifest, shard_model
from edgespec.node.runtime import (
    FingerprintMismatchError,
    InputError,
    SeqIdsLike,
    StageError,
    StageRuntime,
    normalize_seq_ids,
)
from edgespec.tree.kvop import KvOp

__all__ = ["LocalPipeline", "RemoteWindow", "StageProcess", "Window"]


@runtime_checkable
class Window(Protocol):
    """What a pipeline needs from one layer window (StageRuntime and RemoteWindow have it)."""

    layer_range: tuple[int, int]
    fingerprint: str
    is_first: bool
    is_last: bool
    n_embd: int
    n_vocab: int
    n_batch: int
    n_seq_max: int

    def forward(self, inputs: Any, pos: Any, seq_ids: SeqIdsLike = None,
                want_rows: Any = None) -> np.ndarray: ...
    def n_past(self, seq: int = 0) -> int: ...
    def kv_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None: ...
    def kv_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None: ...
    def kv_seq_keep(self, seq: int) -> None: ...
    def keep_seqs(self, seqs: Iterable[int]) -> None: ...
    def commit_path(self, seq: int, p0: int = -1, p1: int = -1, main: int = 0) -> None: ...
    def truncate(self, pos: int, seq: int = -1) -> None: ...
    def apply_plan(self, ops: Iterable[KvOp]) -> None: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...


class LocalPipeline:
    """Windows of one model chained in layer order.

    Build with :meth:`from_shards`, :meth:`from_manifest`, :meth:`from_model`, or from windows you
    created (``LocalPipeline([rt0, rt1])``). A single full-model runtime is a valid one-window
    pipeline (the unsplit reference).
    """

    def __init__(self, windows: Sequence[Window], owned: Sequence[Any] = ()) -> None:
        if not windows:
            raise ValueError("a pipeline needs at least one window")
        self.windows = list(windows)
        self._owned = list(owned)  # closed with the pipeline (runtimes, processes, temp dirs)
        fp = self.windows[0].fingerprint
        for w in self.windows[1:]:
            if w.fingerprint != fp:
                raise FingerprintMismatchError(
                    f"window {w.layer_range} belongs to model {w.fingerprint}, window "
                    f"{self.windows[0].layer_range} to {fp}")
        if not self.windows[0].is_first:
            raise ShardError(f"first window {self.windows[0].layer_range} does not start at layer 0")
        if not self.windows[-1].is_last:
            raise ShardError(f"last window {self.windows[-1].layer_range} does not end the model")
        for prev, nxt in zip(self.windows, self.windows[1:], strict=False):
            if prev.layer_range[1] != nxt.layer_range[0]:
                raise ShardError(f"windows {prev.layer_range} and {nxt.layer_range} do not join")
        self.fingerprint = fp
        self.n_vocab = self.windows[-1].n_vocab
        self.n_embd = self.windows[0].n_embd
        self.n_batch = min(w.n_batch for w in self.windows)
        self.n_seq_max = min(w.n_seq_max for w in self.windows)

    # ---------------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_shards(cls, paths: Sequence[str | Path], **runtime_kwargs: Any) -> LocalPipeline:
        """One in-process :class:`StageRuntime` per shard (in layer order)."""
        runtimes: list[StageRuntime] = []
        try:
            for p in paths:
                runtimes.append(StageRuntime(p, **runtime_kwargs))
            runtimes.sort(key=lambda r: r.layer_range[0])
            return cls(runtimes, owned=runtimes)
        except BaseException:
            for r in runtimes:
                r.close()
            raise

    @classmethod
    def from_manifest(cls, directory: str | Path, **runtime_kwargs: Any) -> LocalPipeline:
        """The shards listed in ``directory/manifest.json`` (sha256-checked on load)."""
        manifest = Manifest.load(Path(directory) / MANIFEST_NAME)
        runtime_kwargs.setdefault("expect_fingerprint", manifest.fingerprint)
        return cls.from_shards(manifest.shard_paths(directory), **runtime_kwargs)

    @classmethod
    def from_model(
        cls,
        model_path: str | Path,
        ranges: Sequence[tuple[int, int]] | None = None,
        n_stages: int | None = None,
        out_dir: str | Path | None = None,
        **runtime_kwargs: Any,
    ) -> LocalPipeline:
        """Shard ``model_path`` (into ``out_dir``, or a temporary directory removed on close)
        and chain the windows."""
        tmp = None
        if out_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="edgespec-shards-")
            out_dir = tmp.name
        try:
            shard_model(model_path, out_dir, ranges=ranges, n_stages=n_stages, progress=False)
            pipe = cls.from_manifest(out_dir, **runtime_kwargs)
        except BaseException:
            if tmp is not None:
                tmp.cleanup()
            raise
        if tmp is not None:
            pipe._owned.append(tmp)
        return pipe

    # ---------------------------------------------------------------------------------------
    # compute

    def forward(
        self,
        tokens: Sequence[int] | np.ndarray,
        pos: int | Sequence[int] | np.ndarray,
        seq_ids: SeqIdsLike = None,
        want_rows: Sequence[int] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Token ids in, logits rows out (``want_rows``; None = every row), through every window.

        Longer batches go through in chunks of ``n_batch`` rows (each chunk through all windows
        before the next). Returns float32 ``[len(want_rows), n_vocab]``; with one chunk it is the
        last window's buffer (valid until the next call), otherwise a fresh array.
        """
        toks = np.asarray(tokens)
        if toks.ndim != 1 or toks.size == 0:
            raise InputError(f"tokens must be a non-empty 1-D array, got shape {toks.shape}")
        n = toks.shape[0]
        p = (np.arange(int(pos), int(pos) + n, dtype=np.int32) if isinstance(pos, (int, np.integer))
             else np.asarray(pos, dtype=np.int32))
        if p.shape != (n,):
            raise InputError(f"positions must be an int or {n} integers, got shape {p.shape}")
        mat, counts = normalize_seq_ids(seq_ids, n, self.n_seq_max)
        if want_rows is None:
            want = np.arange(n, dtype=np.int64)
        else:
            want = np.asarray(want_rows, dtype=np.int64).reshape(-1)
            want = np.where(want < 0, want + n, want)
            if want.size == 0 or want.min() < 0 or want.max() >= n:
                raise InputError(f"want_rows must be non-empty indices in 0..{n - 1}")
        step = self.n_batch
        if n <= step:
            return self._lap(toks, p, (mat, counts), want)
        order = np.argsort(want, kind="stable")
        out = np.empty((want.size, self.n_vocab), np.float32)
        done = 0
        for i0 in range(0, n, step):
            i1 = min(n, i0 + step)
            sel = order[(want[order] >= i0) & (want[order] < i1)]
            chunk_want = want[sel] - i0
            if sel.size:
                res = self._lap(toks[i0:i1], p[i0:i1], (mat[i0:i1], counts[i0:i1]), chunk_want)
                out[sel] = res
            else:
                # Nothing wanted from this chunk: the last window still has to store its KV.
                self._lap(toks[i0:i1], p[i0:i1], (mat[i0:i1], counts[i0:i1]), np.array([i1 - i0 - 1]))
            done += sel.size
        return out

    def _lap(self, toks: np.ndarray, p: np.ndarray, seqs: tuple[np.ndarray, np.ndarray],
             want: np.ndarray) -> np.ndarray:
        h: Any = toks
        done: list[Window] = []
        try:
            for w in self.windows:
                h = w.forward(h, p, seqs, want if w.is_last else None)
                done.append(w)
        except BaseException:
            # Windows before the failing one already stored this batch: undo it there too. A
            # sequence's rows were validated to start at its first position in this batch.
            mat, counts = seqs
            used = np.arange(mat.shape[1])[None, :] < counts[:, None]
            for s in np.unique(mat[used]).tolist():
                p0 = int(p[(mat == s).any(axis=1) & used.any(axis=1)].min())
                for w in done:
                    w.kv_seq_rm(int(s), p0, -1)
            raise
        return h

    def prefill(self, tokens: Sequence[int] | np.ndarray, seq: int = 0) -> np.ndarray:
        """Append ``tokens`` to ``seq`` (continuing its positions); returns a copy of the last
        row's logits ``[n_vocab]``."""
        start = self.n_past(seq)
        return self.forward(tokens, start, seq, want_rows=[-1])[0].copy()

    def generate_greedy(
        self,
        prompts: Sequence[int] | Sequence[Sequence[int]],
        n_tokens: int,
        seqs: Sequence[int] | None = None,
    ) -> list[int] | list[list[int]]:
        """Greedy decoding. One prompt (a list of ids) -> its continuation; several prompts ->
        one continuation each, decoded side by side as sequences ``seqs`` (default 0..k-1) in
        one batch per step. Appends to the sequences' existing KV history."""
        single = len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))
        plist = [list(prompts)] if single else [list(p) for p in prompts]  # type: ignore[arg-type]
        sids = list(seqs) if seqs is not None else list(range(len(plist)))
        if len(sids) != len(plist) or len(set(sids)) != len(sids):
            raise InputError("give one distinct seq id per prompt")
        # All prompts in one (chunked) batch, each in its own sequence.
        toks = np.concatenate([np.asarray(p, dtype=np.int32) for p in plist])
        pos = np.concatenate([np.arange(self.n_past(s), self.n_past(s) + len(p), dtype=np.int32)
                              for s, p in zip(sids, plist, strict=True)])
        seq_col = np.concatenate([np.full(len(p), s, np.int32) for s, p in zip(sids, plist, strict=True)])
        last_rows = np.cumsum([len(p) for p in plist]) - 1
        logits = self.forward(toks, pos, seq_col.tolist(), want_rows=last_rows)
        outs: list[list[int]] = [[] for _ in plist]
        nxt = np.argmax(logits, axis=1).astype(np.int32)
        for step in range(n_tokens):
            for i, t in enumerate(nxt.tolist()):
                outs[i].append(int(t))
            if step == n_tokens - 1:
                break
            pos = np.array([self.n_past(s) for s in sids], np.int32)
            logits = self.forward(nxt, pos, sids)
            nxt = np.argmax(logits, axis=1).astype(np.int32)
        return outs[0] if single else outs

    # ---------------------------------------------------------------------------------------
    # KV operations, applied to every window

    def n_past(self, seq: int = 0) -> int:
        return self.windows[0].n_past(seq)

    def kv_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        for w in self.windows:
            w.kv_seq_rm(seq, p0, p1)

    def kv_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        for w in self.windows:
            w.kv_seq_cp(src, dst, p0, p1)

    def kv_seq_keep(self, seq: int) -> None:
        for w in self.windows:
            w.kv_seq_keep(seq)

    def keep_seqs(self, seqs: Iterable[int]) -> None:
        keep = list(seqs)
        for w in self.windows:
            w.keep_seqs(keep)

    def commit_path(self, seq: int, p0: int = -1, p1: int = -1, main: int = 0) -> None:
        for w in self.windows:
            w.commit_path(seq, p0, p1, main)

    def truncate(self, pos: int, seq: int = -1) -> None:
        for w in self.windows:
            w.truncate(pos, seq)

    def apply_plan(self, ops: Iterable[KvOp]) -> None:
        plan = list(ops)
        for w in self.windows:
            w.apply_plan(plan)

    def reset(self) -> None:
        for w in self.windows:
            w.reset()

    def close(self) -> None:
        for obj in reversed(self._owned):
            if hasattr(obj, "close"):
                obj.close()
            elif hasattr(obj, "cleanup"):
                obj.cleanup()
        self._owned.clear()

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalPipeline({[w.layer_range for w in self.windows]}, model {self.fingerprint})"


# ------------------------------------------------------------------------------------------
# Windows hosted by a child process


def _serve(conn: Connection, sources: list[Any], runtime_kwargs: dict[str, Any]) -> None:
    """Child process main loop: host windows, answer (method, layer_start, args, kwargs)."""
    try:
        host = StageHost(sources, **runtime_kwargs)
    except BaseException as e:  # noqa: BLE001 - report and exit
        conn.send(("err", _portable(e)))
        return
    conn.send(("ok", [_describe(rt) for rt in host.windows]))
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg is None:
                break
            method, start, args, kwargs = msg
            try:
                if method == "add_window":
                    result: Any = _describe(host.add_window(*args, **kwargs))
                elif method == "remove_window":
                    host.remove_window(start)
                    result = None
                else:
                    result = getattr(host.window(start), method)(*args, **kwargs)
                    if isinstance(result, np.ndarray):
                        result = np.array(result)  # the runtime's buffer is reused: send a copy
                conn.send(("ok", result))
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
                conn.send(("err", _portable(e)))
    finally:
        host.close()
        conn.close()


def _portable(e: BaseException) -> BaseException:
    # Exceptions cross the pipe pickled; keep our own types, flatten anything exotic.
    try:
        import pickle

        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001
        return StageError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


_DESCRIBED = ("layer_range", "fingerprint", "is_first", "is_last", "n_embd", "n_vocab", "n_batch",
              "n_seq_max", "n_ctx")


def _describe(rt: StageRuntime) -> dict[str, Any]:
    return {k: getattr(rt, k) for k in _DESCRIBED}


class StageProcess:
    """A child process hosting several windows of one model (a :class:`StageHost`).

    ``StageProcess([shard_a, shard_c], n_ctx=..., n_threads=1)``; ``.window(layer_start)`` gives a
    :class:`RemoteWindow` to put in a :class:`LocalPipeline`. Requests travel over a
    multiprocessing pipe; one request at a time per process.
    """

    def __init__(self, sources: Sequence[Any], start_timeout: float = 120.0, **runtime_kwargs: Any) -> None:
        ctx = mp.get_context("spawn")  # a clean interpreter: no inherited llama.cpp state
        self._conn, child = ctx.Pipe()
        srcs = [tuple(s) if isinstance(s, tuple) else str(s) for s in sources]
        self._proc = ctx.Process(target=_serve, args=(child, srcs, runtime_kwargs), daemon=True)
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        if not self._conn.poll(start_timeout):
            self.close()
            raise StageError(f"stage process did not start within {start_timeout} s")
        status, payload = self._conn.recv()
        if status != "ok":
            self.close()
            raise payload
        self._windows = {d["layer_range"][0]: RemoteWindow(self, d) for d in payload}

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def windows(self) -> list[RemoteWindow]:
        return [self._windows[a] for a in sorted(self._windows)]

    def window(self, layer_start: int) -> RemoteWindow:
        try:
            return self._windows[int(layer_start)]
        except KeyError:
            raise KeyError(f"process {self.pid} hosts no window starting at {layer_start}") from None

    def add_window(self, source: Any, **overrides: Any) -> RemoteWindow:
        src = tuple(source) if isinstance(source, tuple) else str(source)
        d = self.call("add_window", None, (src,), overrides)
        w = RemoteWindow(self, d)
        self._windows[d["layer_range"][0]] = w
        return w

    def call(self, method: str, layer_start: int | None, args: tuple[Any, ...] = (),
             kwargs: dict[str, Any] | None = None) -> Any:
        with self._lock:
            if self._conn.closed or not self._proc.is_alive():
                raise StageError(f"stage process {self.pid} is not running")
            self._conn.send((method, layer_start, args, kwargs or {}))
            try:
                status, payload = self._conn.recv()
            except EOFError as e:
                raise StageError(f"stage process {self.pid} died") from e
        if status != "ok":
            raise payload
        return payload

    def close(self, timeout: float = 10.0) -> None:
        if not self._conn.closed:
            try:
                with self._lock:
                    self._conn.send(None)
            except (OSError, ValueError):
                pass
            self._conn.close()
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout)

    def __enter__(self) -> StageProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteWindow:
    """Proxy for one window inside a :class:`StageProcess` (same interface as StageRuntime)."""

    def __init__(self, process: StageProcess, desc: dict[str, Any]) -> None:
        self.process = process
        self.layer_range: tuple[int, int] = tuple(desc["layer_range"])  # type: ignore[assignment]
        self.fingerprint: str = desc["fingerprint"]
        self.is_first: bool = desc["is_first"]
        self.is_last: bool = desc["is_last"]
        self.n_embd: int = desc["n_embd"]
        self.n_vocab: int = desc["n_vocab"]
        self.n_batch: int = desc["n_batch"]
        self.n_seq_max: int = desc["n_seq_max"]
        self.n_ctx: int = desc["n_ctx"]

    def _call(self, method: str, *args: Any) -> Any:
        return self.process.call(method, self.layer_range[0], args)

    def forward(self, inputs: Any, pos: Any, seq_ids: SeqIdsLike = None, want_rows: Any = None) -> np.ndarray:
        return self._call("forward", np.asarray(inputs), pos, seq_ids, want_rows)

    def n_past(self, seq: int = 0) -> int:
        return self._call("n_past", seq)

    def kv_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self._call("kv_seq_rm", seq, p0, p1)

    def kv_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._call("kv_seq_cp", src, dst, p0, p1)

    def kv_seq_keep(self, seq: int) -> None:
        self._call("kv_seq_keep", seq)

    def keep_seqs(self, seqs: Iterable[int]) -> None:
        self._call("keep_seqs", list(seqs))

    def commit_path(self, seq: int, p0: int = -1, p1: int = -1, main: int = 0) -> None:
        self._call("commit_path", seq, p0, p1, main)

    def truncate(self, pos: int, seq: int = -1) -> None:
        self._call("truncate", pos, seq)

    def apply_plan(self, ops: Iterable[KvOp]) -> None:
        self._call("apply_plan", list(ops))

    def reset(self) -> None:
        self._call("reset")

    def close(self) -> None:
        """Unload this window in its process (the process keeps running)."""
        if self.process._windows.pop(self.layer_range[0], None) is not None:
            try:
                self._call("remove_window")
            except StageError:
                pass  # the process is gone: nothing left to free

    def __repr__(self) -> str:
        return f"RemoteWindow({self.layer_range}, pid {self.process.pid})"
