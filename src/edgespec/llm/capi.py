"""llama.cpp's C functions that run per decode, per KV operation or per vocabulary entry.

The stage runtime and the draft model call these instead of importing llama_cpp (docs/design.md
3.3-3.5). They are llama-cpp-python's ctypes functions themselves, under llama.cpp's own names:
a call costs what calling llama_cpp costs, no Python layer per decode. Loading models and
creating contexts (with their safety settings) is :mod:`edgespec.llm.llamacpp`'s job.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# isort: off
# llm.llamacpp sets OMP_WAIT_POLICY before llama_cpp is first imported (docs/design.md 3.7).
from edgespec.llm import llamacpp as _llamacpp  # noqa: F401
import ctypes
import llama_cpp
import numpy as np

# isort: on

llama_batch = llama_cpp.llama_batch
llama_batch_init = llama_cpp.llama_batch_init
llama_batch_free = llama_cpp.llama_batch_free
llama_decode = llama_cpp.llama_decode
llama_get_logits = llama_cpp.llama_get_logits
llama_memory_seq_rm = llama_cpp.llama_memory_seq_rm
llama_memory_seq_cp = llama_cpp.llama_memory_seq_cp
llama_memory_seq_keep = llama_cpp.llama_memory_seq_keep
llama_memory_seq_pos_min = llama_cpp.llama_memory_seq_pos_min
llama_memory_seq_pos_max = llama_cpp.llama_memory_seq_pos_max
llama_memory_clear = llama_cpp.llama_memory_clear
llama_state_seq_get_size = llama_cpp.llama_state_seq_get_size
llama_state_seq_get_data = llama_cpp.llama_state_seq_get_data
llama_state_seq_set_data = llama_cpp.llama_state_seq_set_data
llama_vocab_get_text = llama_cpp.llama_vocab_get_text
llama_vocab_get_attr = llama_cpp.llama_vocab_get_attr
LLAMA_TOKEN_ATTR_UNUSED = llama_cpp.LLAMA_TOKEN_ATTR_UNUSED


def batch_over(tokens: np.ndarray | None, embd: np.ndarray | None, pos: np.ndarray,
               n_seq: np.ndarray, seq: np.ndarray, out: np.ndarray) -> tuple[Any, Any]:
    """A ``llama_batch`` whose arrays are these numpy buffers, so filling them and setting
    ``n_tokens`` prepares a decode without a copy (a batch is all ids or all embeddings,
    docs/design.md 3.3). ``seq`` is int32 [capacity, n_seq_max]: row i holds token i's seq ids.

    Returns the batch and the table of per-row seq pointers it borrows: keep both, and the
    buffers, alive while the batch is used."""
    i32p = ctypes.POINTER(ctypes.c_int32)
    cap, k = seq.shape
    base = seq.ctypes.data
    seq_ptrs = (i32p * cap)(*[ctypes.cast(base + i * k * 4, i32p) for i in range(cap)])
    b = llama_cpp.llama_batch()
    b.n_tokens = 0
    b.token = tokens.ctypes.data_as(i32p) if tokens is not None else i32p()
    b.embd = (embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if embd is not None
              else ctypes.POINTER(ctypes.c_float)())
    b.pos = pos.ctypes.data_as(i32p)
    b.n_seq_id = n_seq.ctypes.data_as(i32p)
    b.seq_id = ctypes.cast(seq_ptrs, ctypes.POINTER(i32p))
    b.logits = out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
    return b, seq_ptrs


def gpu_backend() -> str:
    """'cpu', 'cuda', 'metal', 'vulkan', 'rocm' or 'gpu', from the linked llama.cpp's build.

    ``llama_supports_gpu_offload`` says whether it can offload at all; the backend libraries
    shipped next to it say which kind."""
    if not llama_cpp.llama_supports_gpu_offload():
        return "cpu"
    if sys.platform == "darwin":
        return "metal"
    libdir = Path(llama_cpp.__file__).parent / "lib"
    names = " ".join(p.name for p in libdir.glob("*")) if libdir.is_dir() else ""
    for marker, backend in (("cuda", "cuda"), ("hip", "rocm"), ("vulkan", "vulkan"), ("metal", "metal")):
        if f"ggml-{marker}" in names:
            return backend
    return "gpu"
