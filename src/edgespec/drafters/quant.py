"""Fast draft copies: a draft model requantized to Q4_0 once, cached, and drafted with.

A draft model only proposes; the target verifies every proposed token, so the draft's precision
changes how many proposals are accepted, never what is generated. Drafting sits on the critical
path of every step, and on CPUs llama.cpp's repacked Q4_0 kernels are much faster than the
types small models often ship in: Qwen2.5-Coder-0.5B comes as Q5_0/Q8_0 (its 896-wide rows do
not fit Q4_K's 256-blocks, so "Q4_K_M" fell back to Q5_0) and decodes a token in 33 ms on one
core of the AMD EPYC we test on; its Q4_0 copy takes 19 ms and is accepted about as often
(``bench/drafter_bench.py``, results in ``bench/results/drafter_bench.json``). Files stored
mostly as Q4 already (Q4_0/Q4_K/IQ4) are used as they are.

The copy lives in ``<cache>/models/derived/``, named after the source's fingerprint, and appears
there only once complete (written to ``.partial``, then renamed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from edgespec.llm import models
from edgespec.llm.gguf_read import fingerprint, read_tensor_types
from edgespec.llm.llamacpp import LlamaLoadError, quantize_model

log = logging.getLogger(__name__)

DRAFT_QUANTS = ("q4_0", "none")
# ggml types with fast (repacked) CPU kernels: a draft stored mostly in these is kept as it is.
_FAST_TYPES = {"Q4_0", "Q4_K", "IQ4_NL", "IQ4_XS"}


def mostly_fast(path: str | os.PathLike[str]) -> bool:
    """Whether most weight bytes of a GGUF are in a type with fast CPU kernels already."""
    total = fast = 0
    for ggml_type, nbytes in read_tensor_types(path):
        total += nbytes
        if ggml_type in _FAST_TYPES:
            fast += nbytes
    return total > 0 and fast * 2 > total


def fast_draft(path: str | os.PathLike[str], qtype: str = "q4_0",
               say: Callable[[str], None] | None = None) -> Path:
    """The GGUF to draft with: ``path`` itself, or its cached ``qtype`` copy (made on first use,
    a few seconds for a 0.5B model). ``qtype="none"`` always returns ``path``."""
    src = Path(path)
    if qtype not in DRAFT_QUANTS:
        raise ValueError(f"draft quantization must be one of {', '.join(DRAFT_QUANTS)}, "
                         f"got {qtype!r}")
    if qtype == "none" or mostly_fast(src):
        return src
    out = models.models_dir() / "derived" / f"{src.stem}.{fingerprint(src)[:12]}.{qtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + f".{os.getpid()}.partial")
    (say or log.info)(f"making a {qtype.upper()} copy of the draft model {src.name} for faster "
                      f"drafting (once; cached as {out})")
    try:
        quantize_model(src, partial, qtype)
        os.replace(partial, out)  # atomic: a concurrent head sees no file or the whole one
    except LlamaLoadError as e:
        # Only speed is lost: draft with the file as given.
        log.warning("%s; drafting with %s as it is", e, src.name)
        return src
    finally:
        partial.unlink(missing_ok=True)
    return out
