"""Refuse a draft model whose token ids mean other text than the target's.

A draft model proposes token *ids*; they are only worth verifying when both models map ids to
the same text. Comparing the two vocabularies (loaded without weights) is fast, so the head and
the ring check it before loading anything else.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path as FsPath

from edgespec.llm import capi
from edgespec.llm.llamacpp import Model, load_model
from edgespec.llm.models import ModelError

__all__ = [
    "TokenizerFingerprint",
    "TokenizerMismatchError",
    "check_draft_tokenizer",
    "tokenizer_fingerprint",
]


class TokenizerMismatchError(ModelError, ValueError):
    """The draft model's vocabulary differs from the target's: its tokens would mean other text.

    A :class:`~edgespec.llm.models.ModelError` (the command line prints it as one line)."""


@dataclass(frozen=True)
class TokenizerFingerprint:
    """A SHA-256 over every token's text up to the trailing padding (enough to tell tokenizers
    apart), the number of those tokens, and the full vocabulary size.

    Checkpoints of one family often pad the vocabulary to a multiple of 64 or 128 with unused
    tokens (Qwen2.5-7B has 152064 entries, Qwen2.5-0.5B 151936, same tokenizer): the padding is
    left out of the digest, so such pairs match."""

    n_vocab: int
    digest: str
    n_used: int = -1  # tokens before the trailing unused padding (-1: not recorded)


def fingerprint_of(model: Model) -> TokenizerFingerprint:
    """The fingerprint of a loaded model's vocabulary."""
    vocab, n = model.vocab, model.n_vocab
    get_text, get_attr = capi.llama_vocab_get_text, capi.llama_vocab_get_attr
    used = n
    while used > 0 and get_attr(vocab, used - 1) & capi.LLAMA_TOKEN_ATTR_UNUSED:
        used -= 1
    h = hashlib.sha256()
    for tok in range(used):
        h.update(get_text(vocab, tok))
        h.update(b"\0")  # separator: ("ab","c") must differ from ("a","bc")
    return TokenizerFingerprint(n_vocab=int(n), digest=h.hexdigest(), n_used=int(used))


def _first_difference(draft: str | os.PathLike[str], target: str | os.PathLike[str]) -> str:
    """Where two vocabularies part (for the refusal message)."""
    with load_model(draft, vocab_only=True) as d, load_model(target, vocab_only=True) as t:
        get_text = capi.llama_vocab_get_text
        for tok in range(min(d.n_vocab, t.n_vocab)):
            a, b = get_text(d.vocab, tok), get_text(t.vocab, tok)
            if a != b:
                return f"token {tok} is {a.decode(errors='replace')!r} in the draft, " \
                       f"{b.decode(errors='replace')!r} in the target"
        return f"the vocabularies have {d.n_vocab} and {t.n_vocab} tokens"


def check_draft_tokenizer(draft: str | os.PathLike[str] | TokenizerFingerprint,
                          target: str | os.PathLike[str] | TokenizerFingerprint) -> TokenizerFingerprint:
    """Refuse a draft model whose token ids mean other text than the target's.

    Loads only the two vocabularies (fast: call it before loading anything else). Returns the
    target's fingerprint. Raises :class:`TokenizerMismatchError` with one line naming both."""
    got, wanted = tokenizer_fingerprint(draft), tokenizer_fingerprint(target)
    if got.digest == wanted.digest and got.n_used == wanted.n_used:
        return wanted
    if isinstance(draft, TokenizerFingerprint) or isinstance(target, TokenizerFingerprint):
        where = (f"draft vocabulary {got.n_used} tokens (sha256 {got.digest[:12]}), target "
                 f"{wanted.n_used} (sha256 {wanted.digest[:12]})")
    else:
        where = _first_difference(draft, target)
    d_name = FsPath(draft).name if not isinstance(draft, TokenizerFingerprint) else "the draft model"
    t_name = FsPath(target).name if not isinstance(target, TokenizerFingerprint) else "the target"
    raise TokenizerMismatchError(
        f"draft model {d_name} has a different tokenizer than {t_name} ({where}): pick a draft "
        "model of the target's family (e.g. Qwen3-0.6B for Qwen3-8B, Llama-3.2-1B for "
        "Llama-3.1-8B), or use the retrieval drafter")


def tokenizer_fingerprint(model: str | os.PathLike[str] | TokenizerFingerprint) -> TokenizerFingerprint:
    """Fingerprint of a GGUF's tokenizer (loads only its vocabulary: fast, no weights)."""
    if isinstance(model, TokenizerFingerprint):
        return model
    with load_model(model, vocab_only=True) as handle:
        return fingerprint_of(handle)
