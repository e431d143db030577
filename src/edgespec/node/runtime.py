"""One layer window of a model on llama.cpp: the unit every node runs (docs/design.md 2, 3.2-3.5).

Over 450 lines: StageRuntime is one class around one llama.cpp context; loading and verifying
the shard, validating inputs, decoding with rollback, and the KV operations share that context,
its buffers and its lock, and "a failed call leaves the KV cache as it was" holds across all of
them, so they stay in one file.

A :class:`StageRuntime` loads one window ``[a, b)`` (a shard from :mod:`edgespec.llm.shards`, or a
window it cuts from a full GGUF) into its own llama.cpp context and runs batches through it:

* the first window takes token ids, later windows take hidden states (float32 or float16,
  ``[n, n_embd]``), exactly the rows the previous window produced;
* a non-last window returns the hidden states after its last layer (``l_out-{k-1}``), captured by
  the C++ eval callback :class:`edgespec._core.HiddenCapture`; every row is marked as an output,
  otherwise llama.cpp prunes the last layer to the output rows;
* the last window returns logits rows for the rows asked for (``want_rows``).

Batches may carry several sequence ids per token (a token tree: each node carries the seq ids of
all leaves below it; docs/design.md 3.4), so contexts use a unified KV cache. The KV cache is rolled back
by masks, never recomputed: :meth:`~StageRuntime.commit_path`, :meth:`~StageRuntime.keep_seqs`,
:meth:`~StageRuntime.truncate`, :meth:`~StageRuntime.apply_plan` (docs/design.md 3.5).

Inputs are validated before llama.cpp sees them (hidden width, token range, seq ids, per-sequence
position continuity); a failed call leaves the KV cache as it was, so the runtime stays usable.

Returned arrays are views of buffers the runtime reuses: valid until the next :meth:`forward` on
the same runtime. Copy them to keep them. A runtime is safe to share between threads (calls are
serialised), but one call at a time is what it is built for.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from edgespec.batch import SeqIds
from edgespec.llm import capi, llamacpp
from edgespec.llm.architectures import ARCHITECTURES
from edgespec.llm.devices import software_device
from edgespec.llm.gguf_read import CorruptShardError, ShardError, ShardInfo, file_sha256, read_info
from edgespec.llm.kv_park import KvParking
from edgespec.llm.shards import MANIFEST_NAME, Manifest, cut_window, shard_file_name
from edgespec.tree.kvop import KvOp, KvOpCode

__all__ = [
    "DecodeError",
    "FingerprintMismatchError",
    "InputError",
    "KVCacheFullError",
    "PositionError",
    "SeqIdsLike",
    "StageError",
    "StageRuntime",
    "normalize_seq_ids",
]


class StageError(RuntimeError):
    """A stage could not run a request."""


class InputError(StageError, ValueError):
    """The request is malformed (shape, dtype, token ids, seq ids); nothing was changed."""


class PositionError(InputError):
    """Positions do not continue a sequence's KV history; nothing was changed."""


class KVCacheFullError(StageError):
    """No room left in the KV cache for the batch; the batch was rolled back."""


class DecodeError(StageError):
    """llama.cpp failed to decode the batch; the batch was rolled back."""


class FingerprintMismatchError(ShardError):
    """A shard or a neighbour belongs to another model (different fingerprint)."""


# Accepted forms of per-token sequence ids:
#   None                      every token in seq 0
#   int                       every token in that seq
#   Sequence[int]             one seq per token
#   Sequence[Sequence[int]]   several seqs per token (trees)
#   (matrix, counts)          int matrix [n, k] and the number of used columns per row
#   SeqIds                    the form a Batch carries (edgespec.batch; docs/design.md 5.1)
SeqIdsLike = Union[None, int, Sequence[int], Sequence[Sequence[int]],
                   "tuple[np.ndarray, np.ndarray]", SeqIds]


def normalize_seq_ids(seq_ids: Any, n: int, n_seq_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Any :data:`SeqIdsLike` form -> (int32 matrix [n, k], int32 counts [n]); validated.
    A :class:`SeqIds` is already that matrix: only checked, never rebuilt (docs/design.md 5.1)."""
    if isinstance(seq_ids, SeqIds):
        mat, counts = seq_ids.ids, seq_ids.counts
        if mat.shape[0] != n:
            raise InputError(f"seq ids for {mat.shape[0]} tokens, batch has {n}")
        if counts.size and counts.min() < 1:
            raise InputError("every token needs at least one seq id")
    elif seq_ids is None:
        mat, counts = np.zeros((n, 1), np.int32), np.ones(n, np.int32)
    elif isinstance(seq_ids, (int, np.integer)):
        mat, counts = np.full((n, 1), int(seq_ids), np.int32), np.ones(n, np.int32)
    elif isinstance(seq_ids, tuple) and len(seq_ids) == 2 and isinstance(seq_ids[0], np.ndarray):
        mat = np.asarray(seq_ids[0], dtype=np.int32)
        counts = np.asarray(seq_ids[1], dtype=np.int32)
        if mat.ndim != 2 or counts.shape != (mat.shape[0],):
            raise InputError(f"seq id matrix must be [n, k] with counts [n], got {mat.shape} / {counts.shape}")
        if mat.shape[0] != n:
            raise InputError(f"seq ids for {mat.shape[0]} tokens, batch has {n}")
        if np.any(counts < 1) or np.any(counts > mat.shape[1]):
            raise InputError("seq id counts must be in 1..k")
    else:
        rows = list(seq_ids)
        if len(rows) != n:
            raise InputError(f"seq ids for {len(rows)} tokens, batch has {n}")
        if all(isinstance(r, (int, np.integer)) for r in rows):
            mat, counts = np.asarray(rows, dtype=np.int32).reshape(n, 1), np.ones(n, np.int32)
        else:
            lists = [[int(r)] if isinstance(r, (int, np.integer)) else [int(x) for x in r] for r in rows]
            k = max((len(r) for r in lists), default=1)
            if any(len(r) == 0 for r in lists):
                raise InputError("every token needs at least one seq id")
            mat = np.zeros((n, max(k, 1)), np.int32)
            counts = np.zeros(n, np.int32)
            for i, r in enumerate(lists):
                mat[i, :len(r)] = r
                counts[i] = len(r)
    if mat.shape[1] > n_seq_max:
        raise InputError(f"a token carries {mat.shape[1]} seq ids, n_seq_max is {n_seq_max}")
    if mat.shape[1] == 1:  # counts are all 1 here: every row's one id
        used, vals = None, mat[:, 0]
    else:
        used = np.arange(mat.shape[1])[None, :] < counts[:, None]
        vals = mat[used]
    # Python's min/max on a few ids: numpy's fixed cost is the hop's cost (design.md 5.1).
    listed = vals.tolist() if vals.size <= 64 else None
    lo, hi = ((min(listed, default=0), max(listed, default=-1)) if listed is not None
              else (int(vals.min()), int(vals.max())))
    if lo < 0 or hi >= n_seq_max:
        bad = lo if lo < 0 else hi
        raise InputError(f"seq id {bad} outside 0..{n_seq_max - 1} (n_seq_max={n_seq_max})")
    if mat.shape[1] > 1:  # no id twice in a row: sort each row, unused slots made unique
        k = mat.shape[1]
        srt = np.sort(np.where(used, mat, -1 - np.arange(k)[None, :]), axis=1)
        dup = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
        if dup.size:
            i = int(dup[0])
            raise InputError(f"token {i} lists a seq id twice: {mat[i, :counts[i]].tolist()}")
    return np.ascontiguousarray(mat), np.ascontiguousarray(counts)


_ROW0 = np.zeros(1, np.intp)
_ROW0.flags.writeable = False


@dataclass(frozen=True)
class _Batch:
    tokens: np.ndarray | None  # int32 [n]
    hidden: np.ndarray | None  # float32/float16 [n, n_embd]
    pos: np.ndarray  # int32 [n]
    seq_mat: np.ndarray  # int32 [n, k]
    seq_counts: np.ndarray  # int32 [n]
    want: np.ndarray  # int64 [r]: rows whose logits are returned (last stage)

    @property
    def n(self) -> int:
        return int(self.pos.shape[0])


#: Rows per decode on a first window that is not also the last (its logits buffer, see
#: ``StageRuntime.__init__``). The 1.5B's first 10 layers prefilled 300 rows in 0.76 s at 64
#: and 0.75-0.93 s at 512 on 2 EPYC cores.
FIRST_WINDOW_BATCH = 64


class StageRuntime(llamacpp.Closing):
    """One layer window on a llama.cpp context.

    Args:
        source: a shard/full GGUF path, or ``(model_path, (a, b))`` to cut that window from a full
            model into ``cache_dir`` (reused when already there).
        n_ctx: KV cells, shared by all sequences.
        n_batch: rows per llama_decode; longer inputs are processed in chunks of this size.
        n_ubatch: physical micro-batch (default ``n_batch``).
        n_seq_max: sequence ids (tree leaves + 1), 1..256.
        n_threads: compute threads (default :func:`edgespec.llm.cpu.default_threads`).
        n_gpu_layers: layers of this window to offload to a GPU (-1 = all).
        expect_fingerprint: refuse a shard of another model.
        verify_sha256: check the file against the ``manifest.json`` next to it (None = when one
            lists it), or against this hex digest when a string is given.
        cache_dir: where ``(model_path, range)`` windows are cut (default: next to the model).
        use_extra_bufts: CPU extra buffer types (see :func:`edgespec.llm.llamacpp.load_model`).
        flash_attn: None = off on CPU-only runtimes (``n_gpu_layers == 0``): llama.cpp's CPU flash
            attention makes a 1-row batch differ from the same row in a bigger batch (4e-3 on
            the tiny test models), which breaks "tree logits == sequential logits", and it is not
            faster on CPU (Qwen 0.5B, 1 thread: 32.5 ms either way at batch 1). With offload, None
            leaves llama.cpp's automatic choice, except on Mesa's lavapipe (a Vulkan device on
            the CPU), where llama.cpp's Vulkan flash-attention shader crashes the driver (Mesa
            22.3: a segfault in its queue thread on a tree-verification workload): off there.

    Raises:
        FileNotFoundError, CorruptShardError, FingerprintMismatchError, ShardError,
        llamacpp.LlamaLoadError.
    """

    def __init__(
        self,
        source: str | Path | tuple[str | Path, tuple[int, int]],
        *,
        n_ctx: int = 2048,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_seq_max: int = 1,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        expect_fingerprint: str | None = None,
        verify_sha256: bool | str | None = None,
        cache_dir: str | Path | None = None,
        use_extra_bufts: bool | None = None,
        flash_attn: bool | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self._model: llamacpp.Model | None = None
        self._ctx: llamacpp.Context | None = None
        if not 1 <= n_seq_max <= 256 or not n_seq_max <= n_ctx <= 1 << 22:
            # llama.cpp aborts the whole process (GGML_ASSERT on n_outputs_max) when a
            # context has fewer KV cells than sequences: refuse it here with a message.
            raise InputError(f"n_ctx must be in {n_seq_max}..{1 << 22} (at least n_seq_max) "
                             f"and n_seq_max in 1..256; got n_ctx={n_ctx}, "
                             f"n_seq_max={n_seq_max}")
        path = self._resolve_source(source, cache_dir)
        info = read_info(path)
        if expect_fingerprint is not None and info.fingerprint != expect_fingerprint:
            raise FingerprintMismatchError(
                f"{path} belongs to model {info.fingerprint}, expected {expect_fingerprint}")
        self._verify_file(path, verify_sha256)
        self.info: ShardInfo = info
        self.path = path
        self.layer_range: tuple[int, int] = info.layer_range
        self.fingerprint: str = info.fingerprint
        self.is_first: bool = info.has_embeddings
        self.is_last: bool = info.has_head
        self.n_embd: int = info.n_embd
        self.n_vocab: int = info.n_vocab
        if self.is_first and not self.is_last:
            # Every row of a first window is an output (see _fill), and llama.cpp writes
            # n_vocab floats per output row into its logits buffer, 600 KiB a row for Qwen2.5:
            # smaller decodes keep that buffer small (prefill is as fast in 64-row chunks).
            n_batch = min(n_batch, FIRST_WINDOW_BATCH)
            n_ubatch = None if n_ubatch is None else min(n_ubatch, n_batch)

        self._model = llamacpp.load_model(path, n_gpu_layers=n_gpu_layers, use_extra_bufts=use_extra_bufts)
        try:
            if self._model.n_embd != self.n_embd or self._model.n_layer != info.n_layer:
                raise CorruptShardError(
                    f"{path}: llama.cpp sees n_embd={self._model.n_embd} n_layer={self._model.n_layer}, "
                    f"metadata says {self.n_embd} / {info.n_layer}")
            self._capture = None
            cb, ud = None, None
            # Architectures whose graph rescales hidden-state input get it restored (see shard).
            handling = ARCHITECTURES.get(info.architecture)
            restore = handling.restore_input if handling is not None and not self.is_first else None
            if not self.is_last or restore:
                from edgespec._native import core as _core

                fns = llamacpp.ggml_function_addresses()
                self._capture = _core.HiddenCapture(
                    "" if self.is_last else f"l_out-{info.n_layer - 1}", self.n_embd, n_batch,
                    fns["ggml_get_name"], fns["ggml_nbytes"], fns["ggml_backend_tensor_get"])
                if restore:
                    self._capture.restore_input(restore, fns["ggml_backend_tensor_set"])
                cb, ud = _core.HiddenCapture.callback_address, self._capture.user_data
            self._ctx = llamacpp.new_context(
                self._model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                kv_unified=True, n_threads=n_threads, cb_eval=cb, cb_eval_user_data=ud,
                flash_attn=flash_attn if flash_attn is not None
                else None if n_gpu_layers != 0 and not software_device() else False)
            if self.is_first or self.is_last:  # the windows with the model's vocabulary
                self._ctx.release_output_reserve()
        except BaseException:
            self.close()
            raise
        self.n_ctx: int = self._ctx.n_ctx
        self.n_batch: int = self._ctx.n_batch  # may be below the request (clamped to n_ctx)
        self.n_seq_max: int = n_seq_max
        self.n_threads: int = self._ctx.n_threads
        self.n_gpu_layers: int = n_gpu_layers
        self._mem = self._ctx.memory
        self._parking = KvParking()  # idle slots' sequences, parked (docs/design.md 5.8)
        self._alloc_batch()

    # ---------------------------------------------------------------------------------------
    # construction helpers

    @staticmethod
    def _resolve_source(source: Any, cache_dir: str | Path | None) -> Path:
        if isinstance(source, tuple):
            if len(source) != 2:
                raise ValueError("source must be a path or (model_path, (a, b))")
            model_path, rng = Path(source[0]), source[1]
            a, b = int(rng[0]), int(rng[1])
            info = read_info(model_path)
            if info.is_shard:
                if info.layer_range == (a, b):
                    return model_path
                raise ShardError(f"{model_path} is the window {info.layer_range}, cannot cut {a}:{b}")
            if (a, b) == (0, info.n_layer_total):
                return model_path
            out = None
            if cache_dir is not None:
                out = Path(cache_dir) / shard_file_name(a, b, info.fingerprint, model_path.stem)
            return cut_window(model_path, (a, b), out)
        return Path(source)

    @staticmethod
    def _verify_file(path: Path, verify: bool | str | None) -> None:
        if verify is False:
            return
        if isinstance(verify, str):
            digest = file_sha256(path)
            if digest != verify.lower():
                raise CorruptShardError(f"{path}: sha256 {digest} does not match expected {verify}")
            return
        manifest_path = path.parent / MANIFEST_NAME
        if not manifest_path.is_file():
            if verify is True:
                raise ShardError(f"verify_sha256=True but no {MANIFEST_NAME} next to {path}")
            return
        entry = Manifest.load(manifest_path).entry_for(path.name)
        if entry is None:
            if verify is True:
                raise ShardError(f"{manifest_path} does not list {path.name}")
            return
        if path.stat().st_size != entry.bytes:
            raise CorruptShardError(
                f"{path}: {path.stat().st_size} bytes, manifest says {entry.bytes} (truncated or corrupt)")
        digest = file_sha256(path)
        if digest != entry.sha256:
            raise CorruptShardError(f"{path}: sha256 {digest} does not match the manifest ({entry.sha256})")

    def _alloc_batch(self) -> None:
        cap, k = self.n_batch, self.n_seq_max
        self._b_tok = np.zeros(cap, np.int32)
        self._b_embd = np.zeros((cap, self.n_embd), np.float32) if not self.is_first else None
        self._b_pos = np.zeros(cap, np.int32)
        self._b_nseq = np.zeros(cap, np.int32)
        self._b_seq = np.zeros((cap, k), np.int32)
        self._b_out = np.zeros(cap, np.int8)
        self._batch, self._b_seq_ptrs = capi.batch_over(
            self._b_tok if self.is_first else None, self._b_embd, self._b_pos, self._b_nseq,
            self._b_seq, self._b_out)

    # ---------------------------------------------------------------------------------------
    # state

    @property
    def closed(self) -> bool:
        return self._ctx is None

    @property
    def model(self) -> llamacpp.Model:
        """The window's llama.cpp model (the last window's vocabulary compiles grammars)."""
        self._require_open()
        assert self._model is not None
        return self._model

    def _require_open(self) -> None:
        if self._ctx is None:
            raise StageError(f"stage {self.layer_range} is closed")

    def n_past(self, seq: int = 0) -> int:
        """Next position of ``seq`` (its highest stored position + 1; 0 when empty)."""
        with self._lock:
            self._require_open()
            self._check_seq(seq)
            return int(capi.llama_memory_seq_pos_max(self._mem, seq)) + 1

    def seq_pos_min(self, seq: int) -> int:
        """Lowest stored position of ``seq`` (-1 when empty)."""
        with self._lock:
            self._require_open()
            self._check_seq(seq)
            return int(capi.llama_memory_seq_pos_min(self._mem, seq))

    def _check_seq(self, seq: int, allow_all: bool = False) -> None:
        if allow_all and seq == -1:
            return
        if not 0 <= int(seq) < self.n_seq_max:
            raise InputError(f"seq id {seq} outside 0..{self.n_seq_max - 1}")

    # ---------------------------------------------------------------------------------------
    # forward

    def forward(
        self,
        inputs: Any,
        pos: int | Sequence[int] | np.ndarray,
        seq_ids: SeqIdsLike = None,
        want_rows: Sequence[int] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Run a batch through the window.

        Args:
            inputs: first window: token ids ``[n]``; other windows: hidden states ``[n, n_embd]``
                (float32 or float16), the rows the previous window returned.
            pos: the position of every row, or one int: rows at ``pos, pos+1, ...``.
            seq_ids: per-row sequence ids (:data:`SeqIdsLike`); per sequence, its rows must continue
                its KV history: positions ``n_past(s), n_past(s)+1, ...`` in batch order.
            want_rows: last window only: row indices whose logits to return (negative counts from
                the end); None = every row.

        Returns:
            non-last window: float32 ``[n, n_embd]`` hidden states; last window: float32
            ``[len(want_rows), n_vocab]`` logits. A view, valid until the next forward().
        """
        with self._lock:
            self._require_open()
            batch = self._validate(inputs, pos, seq_ids, want_rows)
            return self._run(batch)

    def _validate(self, inputs: Any, pos: Any, seq_ids: Any, want_rows: Any) -> _Batch:
        tokens = hidden = None
        if self.is_first:
            arr = np.asarray(inputs)
            if arr.ndim == 2:
                raise InputError(
                    f"stage {self.layer_range} is a first window: it takes token ids, not hidden states")
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise InputError(f"token ids must be a 1-D integer array, got {arr.dtype} {arr.shape}")
            tokens = arr.astype(np.int32, copy=False)
            n = tokens.shape[0]
            if n and (tokens.min() < 0 or tokens.max() >= self.n_vocab):
                bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
                raise InputError(f"token id {bad} outside the vocabulary 0..{self.n_vocab - 1}")
        else:
            arr = np.asarray(inputs)
            if arr.ndim == 1 and np.issubdtype(arr.dtype, np.integer):
                raise InputError(
                    f"stage {self.layer_range} starts at layer {self.layer_range[0]}: it takes hidden "
                    "states [n, n_embd], not token ids")
            if arr.ndim != 2:
                raise InputError(f"hidden states must be [n, n_embd], got shape {arr.shape}")
            if arr.shape[1] != self.n_embd:
                raise InputError(
                    f"hidden width {arr.shape[1]} does not match this model's n_embd {self.n_embd}")
            if arr.dtype not in (np.float32, np.float16):
                raise InputError(f"hidden states must be float32 or float16, got {arr.dtype}")
            hidden = arr
            n = arr.shape[0]
        if n == 0:
            raise InputError("empty batch")

        if isinstance(pos, (int, np.integer)):
            p = np.arange(int(pos), int(pos) + n, dtype=np.int32)
        else:
            p = np.asarray(pos)
            if p.shape != (n,) or (p.size and not np.issubdtype(p.dtype, np.integer)):
                raise InputError(f"positions must be an int or {n} integers, got {p.dtype} {p.shape}")
            p = p.astype(np.int32, copy=False)
        if p.min() < 0:
            raise PositionError(f"negative position {int(p.min())}")

        mat, counts = normalize_seq_ids(seq_ids, n, self.n_seq_max)
        self._check_continuity(p, mat, counts)

        if want_rows is None:
            want = np.arange(n, dtype=np.int64)
        else:
            want = np.asarray(want_rows, dtype=np.int64).reshape(-1)
            if want.size == 0:
                raise InputError("want_rows is empty")
            want = np.where(want < 0, want + n, want)
            if want.min() < 0 or want.max() >= n:
                raise InputError(f"want_rows outside 0..{n - 1}")
        return _Batch(tokens, hidden, p, mat, counts, want)

    def _seq_rows(self, mat: np.ndarray, counts: np.ndarray) -> dict[int, np.ndarray]:
        """Per sequence id in the batch, its rows in batch order."""
        if mat.shape == (1, 1):  # a decode lap: one row of one sequence, without numpy's
            return {int(mat[0, 0]): _ROW0}  # fixed costs (paid cold, every hop: design.md 8.3)
        used = np.arange(mat.shape[1])[None, :] < counts[:, None]
        return {s: np.nonzero(((mat == s) & used).any(axis=1))[0]
                for s in np.unique(mat[used]).tolist()}

    def _check_continuity(self, p: np.ndarray, mat: np.ndarray, counts: np.ndarray) -> None:
        for s, rows in self._seq_rows(mat, counts).items():
            start = int(capi.llama_memory_seq_pos_max(self._mem, s)) + 1
            if rows.size == 1 and int(p[rows[0]]) == start:
                continue
            expect = np.arange(start, start + rows.size, dtype=np.int32)
            got = p[rows]
            if not np.array_equal(got, expect):
                first_bad = int(np.nonzero(got != expect)[0][0])
                hint = ""
                if start == 0 and int(got[0]) > 0:
                    hint = (f"; seq {s} is empty: copy the committed prefix into it first "
                            f"(kv_seq_cp(0, {s}))")
                raise PositionError(
                    f"seq {s}: row {int(rows[first_bad])} has position {int(got[first_bad])}, expected "
                    f"{int(expect[first_bad])} (seq {s} holds positions up to {start - 1}; a sequence's "
                    f"rows must continue it without gaps, in batch order){hint}")
        if mat.shape[1] == 1:
            return
        # Tokens shared by several sequences need those sequences to hold the same history.
        multi = np.nonzero(counts > 1)[0]
        if multi.size:
            checked: set[tuple[int, ...]] = set()
            for i in multi.tolist():
                group = tuple(sorted(mat[i, :counts[i]].tolist()))
                if group in checked:
                    continue
                checked.add(group)
                mins = {s: int(capi.llama_memory_seq_pos_min(self._mem, s)) for s in group}
                if len(set(mins.values())) > 1:
                    raise PositionError(
                        f"row {i} is shared by seqs {list(group)} whose KV histories differ "
                        f"(first positions {mins}); copy the same prefix into each")

    def _run(self, batch: _Batch) -> np.ndarray:
        n = batch.n
        starts = self._seq_starts(batch)
        one = n == 1 and batch.want.size == 1  # a decode lap: skip numpy's fixed costs
        want_sorted = batch.want if one else np.unique(batch.want)
        single = n <= self.n_batch
        simple_want = single and (one or np.array_equal(want_sorted, batch.want))
        out: np.ndarray | None = None
        if not single:
            width = self.n_vocab if self.is_last else self.n_embd
            rows_out = want_sorted.size if self.is_last else n
            out = np.empty((rows_out, width), np.float32)
        done_rows = 0
        try:
            for i0 in range(0, n, self.n_batch):
                i1 = min(n, i0 + self.n_batch)
                m = i1 - i0
                self._fill(batch, i0, i1, want_sorted)
                result = self._decode(m)
                if single:
                    out = result
                else:
                    assert out is not None
                    out[done_rows:done_rows + result.shape[0]] = result
                    done_rows += result.shape[0]
        except BaseException:
            self._rollback(starts)
            raise
        assert out is not None
        if self.is_last and not simple_want:
            # Rows come back in ascending batch order: map the caller's order onto them.
            idx = np.searchsorted(want_sorted, batch.want)
            return out[idx]
        return out

    def _seq_starts(self, batch: _Batch) -> dict[int, int]:
        return {s: int(capi.llama_memory_seq_pos_max(self._mem, s)) + 1
                for s in self._seq_rows(batch.seq_mat, batch.seq_counts)}

    def _rollback(self, starts: dict[int, int]) -> None:
        # Drop whatever this call added, so the KV cache is as before the failed call.
        for s, p0 in starts.items():
            capi.llama_memory_seq_rm(self._mem, s, p0, -1)

    def _fill(self, batch: _Batch, i0: int, i1: int, want_sorted: np.ndarray) -> None:
        m = i1 - i0
        if self.is_first:
            assert batch.tokens is not None
            self._b_tok[:m] = batch.tokens[i0:i1]
        else:
            assert batch.hidden is not None and self._b_embd is not None
            np.copyto(self._b_embd[:m], batch.hidden[i0:i1], casting="same_kind")
        self._b_pos[:m] = batch.pos[i0:i1]
        k = batch.seq_mat.shape[1]
        self._b_seq[:m, :k] = batch.seq_mat[i0:i1]
        self._b_nseq[:m] = batch.seq_counts[i0:i1]
        if self.is_last:
            self._b_out[:m] = 0
            sel = want_sorted[(want_sorted >= i0) & (want_sorted < i1)] - i0
            self._b_out[sel] = 1
        else:
            self._b_out[:m] = 1  # every row is an output, or llama.cpp prunes the last layer
        self._batch.n_tokens = m

    def _decode(self, m: int) -> np.ndarray:
        if self._capture is not None:
            self._capture.reset()
            if self._capture.restore_name:
                assert self._b_embd is not None
                self._capture.set_input(self._b_embd.ctypes.data, m)
        rc = capi.llama_decode(self._ctx.ptr, self._batch)  # type: ignore[union-attr]
        if rc == 1:
            raise KVCacheFullError(
                f"stage {self.layer_range}: no room in the KV cache (n_ctx={self.n_ctx}) for {m} rows; "
                "drop sequences or truncate")
        if rc != 0:
            raise DecodeError(f"stage {self.layer_range}: llama_decode returned {rc} "
                              "(enable edgespec.llm.llamacpp.set_verbose(True) for llama.cpp's reason)")
        if self._capture is not None and self._capture.error:
            raise DecodeError(f"stage {self.layer_range}: hidden-state capture failed: {self._capture.error}")
        if self._capture is not None and self._capture.restore_name and self._capture.restored_rows != m:
            raise DecodeError(f"stage {self.layer_range}: restored {self._capture.restored_rows} input rows "
                              f"of {self._capture.restore_name}, expected {m}")
        if self._capture is not None and not self.is_last:
            if self._capture.rows != m:
                raise DecodeError(
                    f"stage {self.layer_range}: captured {self._capture.rows} rows of "
                    f"{self._capture.tensor_name}, expected {m}")
            return self._capture.view()
        n_out = int(self._b_out[:m].sum())
        ptr = capi.llama_get_logits(self._ctx.ptr)  # type: ignore[union-attr]
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))

    # ---------------------------------------------------------------------------------------
    # KV cache (masked rollback: sequences are masks over cells, nothing is recomputed)

    def kv_seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Forget positions ``[p0, p1)`` of ``seq`` (-1 = all seqs; p0/p1 < 0 = open end)."""
        with self._lock:
            self._require_open()
            self._check_seq(seq, allow_all=True)
            if not capi.llama_memory_seq_rm(self._mem, int(seq), int(p0), int(p1)):
                raise StageError(f"llama.cpp refused to remove seq {seq} positions [{p0}, {p1})")
            self._parking.forget(int(seq), int(p0), int(p1))

    def kv_seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` also see the cells of ``src`` in ``[p0, p1)`` (no data is copied)."""
        with self._lock:
            self._require_open()
            self._check_seq(src)
            self._check_seq(dst)
            capi.llama_memory_seq_cp(self._mem, int(src), int(dst), int(p0), int(p1))

    def kv_seq_keep(self, seq: int) -> None:
        """Drop every sequence except ``seq``."""
        with self._lock:
            self._require_open()
            self._check_seq(seq)
            capi.llama_memory_seq_keep(self._mem, int(seq))
            self._parking.keep_only(int(seq))

    def kv_seq_park(self, seq: int) -> int:
        """Copy ``seq``'s cells into host memory and free them (``edgespec.llm.kv_park``);
        returns the bytes parked (0: it was empty, or it stays live)."""
        with self._lock:
            self._require_open()
            self._check_seq(seq)
            return self._parking.park(self._ctx.ptr, self._mem, int(seq))  # type: ignore[union-attr]

    def kv_seq_restore(self, seq: int) -> bool:
        """Put ``seq``'s parked cells back; False when none are parked. ``KVCacheFullError``
        when the cache has no room for them (``seq`` is then empty)."""
        with self._lock:
            self._require_open()
            self._check_seq(seq)
            try:
                return self._parking.restore(self._ctx.ptr, self._mem, int(seq))  # type: ignore[union-attr]
            except MemoryError as e:
                raise KVCacheFullError(f"stage {self.layer_range}: {e}") from None

    @property
    def parked_bytes(self) -> int:
        """Host memory that parked sequences hold."""
        with self._lock:
            return self._parking.nbytes()

    def keep_seqs(self, seqs: Iterable[int]) -> None:
        """Drop every sequence not in ``seqs`` (keep a subtree's leaves plus the main seq)."""
        keep = {int(s) for s in seqs}
        with self._lock:
            self._require_open()
            for s in keep:
                self._check_seq(s)
            for s in range(self.n_seq_max):
                if s not in keep:
                    capi.llama_memory_seq_rm(self._mem, s, -1, -1)
                    self._parking.forget(s, -1, -1)

    def commit_path(self, seq: int, p0: int = -1, p1: int = -1, main: int = 0) -> None:
        """Accept the path stored in ``seq`` over positions ``[p0, p1)`` into ``main`` and drop
        every other sequence (docs/design.md 3.5: ``seq_cp(seq -> main)`` then ``seq_keep(main)``)."""
        with self._lock:
            self._require_open()
            self._check_seq(seq)
            self._check_seq(main)
            if seq != main:
                capi.llama_memory_seq_cp(self._mem, int(seq), int(main), int(p0), int(p1))
            capi.llama_memory_seq_keep(self._mem, int(main))
            self._parking.keep_only(int(main))
            if p1 >= 0:
                capi.llama_memory_seq_rm(self._mem, int(main), int(p1), -1)

    def truncate(self, pos: int, seq: int = -1) -> None:
        """Forget every position >= ``pos`` (of ``seq``, or of all sequences)."""
        if pos < 0:
            raise InputError(f"truncate position must be >= 0, got {pos}")
        self.kv_seq_rm(seq, pos, -1)

    def apply_plan(self, ops: Iterable[KvOp]) -> None:
        """Apply KV operations (:class:`~edgespec.tree.kvop.KvOp` rows ``(code, seq, p0, p1,
        arg)``), validated first, then in order:

        * ``CP(seq -> arg, p0, p1)``: :meth:`kv_seq_cp`
        * ``RM(seq, p0, p1)``: :meth:`kv_seq_rm` (seq -1 = all)
        * ``KEEP(seq)``: :meth:`kv_seq_keep`
        * ``PARK(seq)``, ``RESTORE(seq)``: :meth:`kv_seq_park`, :meth:`kv_seq_restore`
        """
        plan = []
        for op in ops:
            if len(op) != 5:
                raise InputError(f"KV op must be (code, seq, p0, p1, arg), got {op!r}")
            try:
                code = KvOpCode(int(op[0]))
            except ValueError:
                raise InputError(f"unknown KV op {op[0]!r} (expected RM, CP or KEEP)") from None
            seq, p0, p1, arg = int(op[1]), int(op[2]), int(op[3]), int(op[4])
            if code == KvOpCode.CP:
                self._check_seq(seq)
                self._check_seq(arg)
            elif code == KvOpCode.RM:
                self._check_seq(seq, allow_all=True)
            elif code in (KvOpCode.KEEP, KvOpCode.PARK, KvOpCode.RESTORE):
                self._check_seq(seq)
            else:
                raise InputError(f"unknown KV op {code.name} for a stage (expected RM, CP, "
                                 f"KEEP, PARK or RESTORE)")
            plan.append((code, seq, p0, p1, arg))
        with self._lock:
            self._require_open()
            for code, seq, p0, p1, arg in plan:
                if code == KvOpCode.CP:
                    capi.llama_memory_seq_cp(self._mem, seq, arg, p0, p1)
                elif code == KvOpCode.RM:
                    if not capi.llama_memory_seq_rm(self._mem, seq, p0, p1):
                        raise StageError(f"llama.cpp refused to remove seq {seq} positions [{p0}, {p1})")
                    self._parking.forget(seq, p0, p1)
                elif code == KvOpCode.PARK:
                    self.kv_seq_park(seq)  # the lock is re-entrant
                elif code == KvOpCode.RESTORE:
                    self.kv_seq_restore(seq)
                else:
                    capi.llama_memory_seq_keep(self._mem, seq)
                    self._parking.keep_only(seq)

    def reset(self) -> None:
        """Empty the KV cache (all sequences)."""
        with self._lock:
            self._require_open()
            capi.llama_memory_clear(self._mem, True)
            self._parking.clear()

    # ---------------------------------------------------------------------------------------
    # neighbours and lifetime

    def check_upstream(self, fingerprint: str, layer_end: int) -> None:
        """Refuse hidden states from a neighbour of another model or whose window does not end
        where this one starts."""
        if fingerprint != self.fingerprint:
            raise FingerprintMismatchError(
                f"upstream stage runs model {fingerprint}, this stage runs {self.fingerprint}")
        if int(layer_end) != self.layer_range[0]:
            raise ShardError(
                f"upstream window ends at layer {layer_end}, this window starts at {self.layer_range[0]}")

    def close(self) -> None:
        """Free the context and the model."""
        with self._lock:
            if self._ctx is not None:
                self._ctx.close()
                self._ctx = None
            if self._model is not None:
                self._model.close()
                self._model = None


    def __repr__(self) -> str:
        a, b = self.layer_range
        kind = "first+last" if self.is_first and self.is_last else (
            "first" if self.is_first else "last" if self.is_last else "middle")
        return f"StageRuntime({str(self.path)!r}, layers {a}:{b} of {self.info.n_layer_total}, {kind})"
