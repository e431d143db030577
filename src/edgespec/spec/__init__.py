"""Speculative decoding on the head: drafters (and, later, the engine that drives the ring).

Importing this package does not load llama.cpp: the draft-model names are resolved on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgespec.spec.drafters import Drafter, DraftTree
from edgespec.spec.hybrid import HybridDrafter
from edgespec.spec.retrieval import RetrievalDrafter

if TYPE_CHECKING:
    from edgespec.spec.draft_model import (
        DraftModelDrafter,
        TokenizerFingerprint,
        TokenizerMismatchError,
        tokenizer_fingerprint,
    )

__all__ = [
    "DraftModelDrafter",
    "DraftTree",
    "Drafter",
    "HybridDrafter",
    "RetrievalDrafter",
    "TokenizerFingerprint",
    "TokenizerMismatchError",
    "tokenizer_fingerprint",
]

_LAZY = {
    "DraftModelDrafter": "edgespec.spec.draft_model",
    "TokenizerFingerprint": "edgespec.spec.draft_model",
    "TokenizerMismatchError": "edgespec.spec.draft_model",
    "tokenizer_fingerprint": "edgespec.spec.draft_model",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that retrieval-only users (and the wire/ring code) never load llama.cpp.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'edgespec.spec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
