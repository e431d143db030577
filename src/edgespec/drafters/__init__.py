"""Drafters: what proposes token trees for the ring to verify (docs/design.md 6).

One file per proposer: ``base`` (the interface every drafter implements: begin / propose /
propose_under / accept), ``ngram`` (retrieval from the text so far), ``model`` (a small draft
model), ``hybrid`` (both), ``quant`` (the draft model's cached Q4_0 copy), ``tokenizer`` (refuses
a draft model of another vocabulary) and ``factory`` (the drafter a user's options name).

Importing this package does not load llama.cpp: the draft-model names are resolved on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgespec.drafters.base import Drafter, DraftTree
from edgespec.drafters.hybrid import HybridDrafter
from edgespec.drafters.ngram import RetrievalDrafter

if TYPE_CHECKING:
    from edgespec.drafters.model import DraftModelDrafter
    from edgespec.drafters.tokenizer import (
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
    "DraftModelDrafter": "edgespec.drafters.model",
    "TokenizerFingerprint": "edgespec.drafters.tokenizer",
    "TokenizerMismatchError": "edgespec.drafters.tokenizer",
    "tokenizer_fingerprint": "edgespec.drafters.tokenizer",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that retrieval-only users (and the wire/ring code) never load llama.cpp.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'edgespec.drafters' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
