"""The one place edgespec loads llama.cpp models and creates contexts (through llama-cpp-python).
What a CPU offers (cores, AMX, so threads and repacking) is ``edgespec.llm.cpu``.

It imports llama_cpp first: :mod:`edgespec.llm.capi` (the per-decode C functions) and
:mod:`edgespec.llm.tokenizer` import it only after this module, and nothing outside
``edgespec.llm`` imports it. Every model and context is made by these helpers, so the
machine-specific safety settings live in one spot:

* ``OMP_WAIT_POLICY=passive`` is set *before* llama_cpp is imported (docs/design.md 3.7): with OpenMP's
  default busy-waiting, several stage contexts on one host spin against each other and one decode
  took 2.2 s instead of 66 ms. ``os.environ.setdefault`` keeps a value the user chose.
* CPU "extra buffer types" (weight repacking, AMX) are OFF on CPUs with AMX, because the AMX path
  segfaults in ``ggml_backend_amx_mul_mat`` on those Xeons (docs/design.md 3.6), and ON elsewhere:
  repacked Q4_0/Q4_K kernels decode 1.2-1.8x faster on an AMD EPYC (measured, see
  :func:`extra_bufts_default`). ``EDGESPEC_EXTRA_BUFTS=0|1`` or ``use_extra_bufts=`` decide
  explicitly.
* llama.cpp's log output is hidden unless :func:`set_verbose` is called (or ``EDGESPEC_VERBOSE=1``).

Handles (:class:`Model`, :class:`Context`) free their llama.cpp objects on :meth:`close` or when
used as context managers; a context keeps its model alive.
"""

from __future__ import annotations

import os

# Must precede the first `import llama_cpp` anywhere in the process (OpenMP reads it at start-up).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import contextlib  # noqa: E402
import ctypes  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, TypeVar  # noqa: E402

import llama_cpp  # noqa: E402

from edgespec.llm import pages  # noqa: E402
from edgespec.llm.cpu import default_threads, extra_bufts_default  # noqa: E402

__all__ = [
    "Context",
    "LlamaLoadError",
    "Model",
    "ggml_function_addresses",
    "load_model",
    "new_context",
    "quantize_model",
    "set_verbose",
]


class LlamaLoadError(RuntimeError):
    """llama.cpp refused to load a model file or to create a context."""


# --------------------------------------------------------------------------------------------
# Logging


_verbose = os.environ.get("EDGESPEC_VERBOSE", "") not in ("", "0")
_log_lock = threading.Lock()


@llama_cpp.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # Runs on llama.cpp's threads: never raise from here.
    if not _verbose:
        return
    try:
        sys.stderr.write(text.decode("utf-8", errors="replace"))
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a log write must not crash a decode
        pass


def _install_log_callback() -> None:
    # The CFUNCTYPE object is a module global, so it outlives every llama.cpp call that may log.
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


def set_verbose(verbose: bool) -> None:
    """Show (True) or hide (False) llama.cpp's own log output on stderr."""
    global _verbose
    with _log_lock:
        _verbose = bool(verbose)
        _install_log_callback()


_backend_ready = False


def _ensure_backend() -> None:
    global _backend_ready
    if not _backend_ready:
        with _log_lock:
            if not _backend_ready:
                _install_log_callback()
                llama_cpp.llama_backend_init()
                _backend_ready = True


_C = TypeVar("_C", bound="Closing")


class Closing:
    """``with`` support and a last-chance ``close()`` at garbage collection, for the objects
    that hold llama.cpp memory (models, contexts, stage windows, the draft model). An explicit
    ``close()`` is the contract; ``__del__`` only covers a caller that forgot."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter shutdown llama_cpp may be gone already
            pass


class Model(Closing):
    """A loaded llama.cpp model (``llama_model *``). Free with :meth:`close` or ``with``."""

    def __init__(self, ptr: Any, path: Path, n_gpu_layers: int, vocab_only: bool) -> None:
        self._ptr = ptr
        self.path = path
        self.n_gpu_layers = n_gpu_layers
        self.vocab_only = vocab_only
        self._contexts: list[Context] = []
        self.vocab = llama_cpp.llama_model_get_vocab(ptr)
        self.n_embd: int = llama_cpp.llama_model_n_embd(ptr)
        self.n_layer: int = llama_cpp.llama_model_n_layer(ptr)
        self.n_vocab: int = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.guidance: Any = None  # llguidance's tokenizer of the vocabulary (grammar.py)

    @property
    def ptr(self) -> Any:
        """The raw ``llama_model *``; raises if the model was closed."""
        if self._ptr is None:
            raise RuntimeError(f"model {self.path} is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string (llama.cpp's rendering), or None if absent."""
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def chat_template(self) -> str | None:
        """The model's default chat template (Jinja source) or None."""
        raw = llama_cpp.llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8") if raw else None

    def close(self) -> None:
        """Free the model and every context still open on it."""
        for ctx in list(self._contexts):
            ctx.close()
        self.guidance = None
        if self._ptr is not None:
            llama_cpp.llama_model_free(self._ptr)
            self._ptr = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"n_layer={self.n_layer} n_embd={self.n_embd}"
        return f"Model({str(self.path)!r}, {state})"


def mmap_default() -> bool:
    """Whether to map model files (then give back what the window does not read,
    :func:`load_model`): each weight is held once, the copies llama.cpp repacks for the CPU
    and from the file only what is read in place. The 1.5B split 3 ways peaked at 604 / 405 /
    663 MiB mapped against 814 / 406 / 832 read, loading 2x faster at the ends
    (docs/experiments.md 13). ``EDGESPEC_MMAP=0`` reads the file instead; ``=1`` maps it."""
    env = os.environ.get("EDGESPEC_MMAP", "")
    if env in ("0", "1"):
        return env == "1"
    return True


def load_model(
    path: str | os.PathLike[str],
    n_gpu_layers: int = 0,
    use_extra_bufts: bool | None = None,
    vocab_only: bool = False,
    use_mmap: bool | None = None,
) -> Model:
    """Load a GGUF file.

    Args:
        path: the GGUF file (full model or a shard written by :mod:`edgespec.llm.shards`).
        n_gpu_layers: layers to offload to a GPU backend (-1 = all); ignored on CPU-only builds.
        use_extra_bufts: CPU extra buffer types (repacking, AMX). None =
            :func:`extra_bufts_default` (on unless the CPU has AMX, which segfaults, docs/design.md 3.6).
        vocab_only: load only the vocabulary (enough for a head's tokenizer).
        use_mmap: map the file instead of reading it. None = :func:`mmap_default`. A mapped
            file's pages are released once loaded (:func:`edgespec.llm.pages.release_file`):
            what the window reads comes back from the file, repacked weights are held once.

    Raises:
        FileNotFoundError: no such file.
        LlamaLoadError: llama.cpp could not load it (corrupt, unsupported, wrong tensors).
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"model file not found: {p}")
    _ensure_backend()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = int(n_gpu_layers)
    params.vocab_only = bool(vocab_only)
    params.use_extra_bufts = extra_bufts_default() if use_extra_bufts is None else bool(use_extra_bufts)
    mmap = (mmap_default() if use_mmap is None
            else bool(use_mmap)) or bool(vocab_only)
    # AUTO maps the file where the device can; NONE reads it into llama.cpp's own buffers.
    params.load_mode = llama_cpp.LLAMA_LOAD_MODE_AUTO if mmap else llama_cpp.LLAMA_LOAD_MODE_NONE
    release = None
    if mmap and not vocab_only and pages.supported():
        release = _ReleaseWhileLoading(p)
        params.progress_callback = release.callback
    ptr = llama_cpp.llama_model_load_from_file(str(p).encode(), params)
    if not ptr:
        raise LlamaLoadError(
            f"llama.cpp could not load {p} (corrupt or truncated GGUF, or tensors that do not match "
            "its metadata); call edgespec.llm.llamacpp.set_verbose(True) to see llama.cpp's reason"
        )
    model = Model(ptr, p, int(n_gpu_layers), bool(vocab_only))
    if release is not None:
        with contextlib.suppress(OSError):  # an economy: the model works either way
            pages.release_file(p)
    return model


class _ReleaseWhileLoading:
    """llama.cpp's load progress callback: every tenth of the way, drop the pages of the mapped
    file read so far, so that a window is never resident as mapped file and repacked copy at
    once (pages still to be read come back from the file as llama.cpp reads them)."""

    STEP = 0.1

    def __init__(self, path: Path) -> None:
        self.path = path
        self.next = self.STEP
        self.callback = llama_cpp.llama_progress_callback(self._on_progress)

    def _on_progress(self, progress: float, _user_data: Any) -> bool:
        if progress >= self.next:
            self.next = progress + self.STEP
            try:
                pages.release_file(self.path, evict=False)
            except OSError:
                pass  # releasing is an economy: loading goes on either way
        return True


# --------------------------------------------------------------------------------------------
# Contexts


class Context(Closing):
    """A llama.cpp context (``llama_context *``) on a :class:`Model`."""

    def __init__(self, model: Model, ptr: Any, params: Any, cb_eval_keepalive: Any) -> None:
        self.model = model
        self._ptr = ptr
        self.n_ctx: int = llama_cpp.llama_n_ctx(ptr)
        # What llama.cpp settled on (it clamps n_batch to the requested n_ctx, rounds n_ctx up).
        self.n_batch: int = llama_cpp.llama_n_batch(ptr)
        self.n_ubatch: int = llama_cpp.llama_n_ubatch(ptr)
        self.n_seq_max: int = llama_cpp.llama_n_seq_max(ptr)
        self.n_threads: int = int(params.n_threads)
        self.kv_unified: bool = bool(params.kv_unified)
        # The ctypes callback object must live as long as the context that may call it.
        self._cb_eval_keepalive = cb_eval_keepalive
        model._contexts.append(self)

    @property
    def ptr(self) -> Any:
        if self._ptr is None:
            raise RuntimeError("context is closed")
        return self._ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    @property
    def memory(self) -> Any:
        """The context's ``llama_memory_t`` (KV cache) handle."""
        return llama_cpp.llama_get_memory(self.ptr)

    def release_output_reserve(self) -> int:
        """Give back the pages of the logits buffer llama.cpp reserves (and fills) at creation:
        ``n_vocab`` floats for each of ``n_seq_max`` outputs, 148 MiB for Qwen2.5's vocabulary
        at 256 sequences. A decode writes only the rows it outputs, so afterwards the buffer is
        resident as far as outputs were asked for. Call before the first decode. Returns bytes."""
        logits = llama_cpp.llama_get_logits(self.ptr)
        address = ctypes.cast(logits, ctypes.c_void_p).value if logits else None
        if not address:
            return 0
        try:
            return pages.release_range(address, 4 * self.model.n_vocab * self.n_seq_max)
        except OSError:  # an economy: the context works either way
            return 0

    def close(self) -> None:
        if self._ptr is not None:
            llama_cpp.llama_free(self._ptr)
            self._ptr = None
            try:
                self.model._contexts.remove(self)
            except ValueError:
                pass



def new_context(
    model: Model,
    n_ctx: int = 2048,
    n_batch: int = 512,
    n_ubatch: int | None = None,
    n_seq_max: int = 1,
    kv_unified: bool = True,
    n_threads: int | None = None,
    cb_eval: int | Any | None = None,
    cb_eval_user_data: int | None = None,
    n_threads_batch: int | None = None,
    offload_kqv: bool = True,
    flash_attn: bool | None = None,
) -> Context:
    """Create a context.

    Args:
        n_ctx: KV cells (shared by all sequences when ``kv_unified``).
        n_batch: largest batch one ``llama_decode`` accepts.
        n_ubatch: physical micro-batch (default ``n_batch``: one graph per decode).
        n_seq_max: sequence ids available (tree leaves + 1 for speculative trees, <= 256).
        kv_unified: one KV buffer for all sequences; required for trees whose tokens carry several
            seq ids (docs/design.md 3.4).
        n_threads: compute threads (default :func:`default_threads`).
        cb_eval: eval callback: a C function address (int) or a ctypes
            ``ggml_backend_sched_eval_callback`` object; see :mod:`edgespec._core` ``HiddenCapture``.
        cb_eval_user_data: pointer passed to the callback.
        flash_attn: None = llama.cpp's auto choice.
    """
    if n_ctx < 1 or n_batch < 1:
        raise ValueError(f"n_ctx and n_batch must be positive (got {n_ctx}, {n_batch})")
    if not 1 <= n_seq_max <= 256:
        raise ValueError(f"n_seq_max must be in 1..256, got {n_seq_max}")
    if model.vocab_only:
        raise ValueError("cannot create a context on a vocab-only model")
    _ensure_backend()
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = int(n_ctx)
    params.n_batch = int(n_batch)
    params.n_ubatch = int(n_ubatch if n_ubatch is not None else n_batch)
    params.n_seq_max = int(n_seq_max)
    # llama.cpp reserves outputs for n_seq_max rows at least and asserts that this is within
    # n_outputs_max (n_batch by default), which a batch smaller than n_seq_max would break.
    params.n_outputs_max = max(int(n_batch), int(n_seq_max))
    params.kv_unified = bool(kv_unified)
    threads = int(n_threads) if n_threads is not None else default_threads()
    params.n_threads = threads
    params.n_threads_batch = int(n_threads_batch) if n_threads_batch is not None else threads
    params.offload_kqv = bool(offload_kqv)
    params.no_perf = True
    if flash_attn is not None:
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
    keepalive = None
    if cb_eval is not None:
        if isinstance(cb_eval, int):
            keepalive = llama_cpp.ggml_backend_sched_eval_callback(cb_eval)
        else:
            keepalive = cb_eval
        params.cb_eval = keepalive
        params.cb_eval_user_data = ctypes.c_void_p(cb_eval_user_data or 0)
    ptr = llama_cpp.llama_init_from_model(model.ptr, params)
    if not ptr:
        raise LlamaLoadError(
            f"llama.cpp could not create a context (n_ctx={n_ctx}, n_batch={n_batch}, "
            f"n_seq_max={n_seq_max}) on {model.path}; out of memory?"
        )
    return Context(model, ptr, params, keepalive)


# --------------------------------------------------------------------------------------------
# ggml functions for the C++ eval callback


def ggml_function_addresses() -> dict[str, int]:
    """Addresses of ``ggml_get_name``, ``ggml_nbytes``, ``ggml_backend_tensor_get`` and
    ``ggml_backend_tensor_set``.

    They live in llama_cpp/lib/libggml-base.so, the copy llama.cpp itself uses, so the C++ capture
    callback (which links neither) can call them.
    """
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.*"))
    if not candidates:
        raise LlamaLoadError(f"libggml-base not found in {lib_dir}")
    lib = ctypes.CDLL(str(candidates[0]))
    out = {}
    for name in ("ggml_get_name", "ggml_nbytes", "ggml_backend_tensor_get", "ggml_backend_tensor_set"):
        fn = getattr(lib, name)
        out[name] = ctypes.cast(fn, ctypes.c_void_p).value or 0
        if not out[name]:
            raise LlamaLoadError(f"{name} not exported by {candidates[0]}")
    return out


# --------------------------------------------------------------------------------------------
# Quantization


QUANT_TYPES = {"q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", "GGML_TYPE_Q4_0")}


def quantize_model(src: str | os.PathLike[str], dst: str | os.PathLike[str], qtype: str = "q4_0",
                   n_threads: int | None = None) -> None:
    """Write ``src`` requantized to ``qtype`` (every weight, the output matrix included) to
    ``dst`` with llama.cpp's own quantizer. Raises :class:`LlamaLoadError` on failure."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"unsupported quantization {qtype!r}: choose from {', '.join(QUANT_TYPES)}")
    _ensure_backend()
    ftype_name, out_type_name = QUANT_TYPES[qtype]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    params.output_tensor_type = getattr(llama_cpp, out_type_name)
    params.allow_requantize = True  # the sources are quantized already (Q5_0/Q8_0 and the like)
    params.nthread = n_threads or default_threads()
    rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params))
    if rc != 0:
        raise LlamaLoadError(f"llama.cpp could not quantize {src} to {qtype} (code {rc}); "
                             "call edgespec.llm.llamacpp.set_verbose(True) to see its reason")
