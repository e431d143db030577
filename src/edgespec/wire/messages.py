"""Builders of the ring's data messages (TOKENS, HIDDEN, ERROR) and the sequence-id matrix.

RESULT and batch <-> message mapping are ``edgespec.wire.frames``'; CONTROL is
``edgespec.wire.control``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edgespec.batch import SeqIds
from edgespec.wire.codec import HIDDEN_ENCODINGS, Encoding, FieldTag, Message, encode_payload
from edgespec.wire.header import Kind, WireError


def seq_matrix(seq_ids: SeqIds | Sequence[Sequence[int]], n_seq: int | None = None) -> np.ndarray:
    """Bool [n_tokens, n_seq] SEQ_IDS matrix from a :class:`SeqIds` or per-token lists of ids
    (n_seq: largest id + 1 unless given); docs/design.md 5.1."""
    ids = seq_ids if isinstance(seq_ids, SeqIds) else SeqIds.from_lists(seq_ids)
    try:
        return ids.to_bool_matrix(n_seq)
    except ValueError as e:
        raise WireError(str(e)) from None


def seq_lists(matrix: np.ndarray) -> list[list[int]]:
    """Per-token lists of sequence ids from a SEQ_IDS matrix."""
    return SeqIds.from_bool_matrix(matrix).tolist()


def tokens_message(
    tokens: Any,
    positions: Any,
    seq_ids: np.ndarray,
    *,
    lap_id: int = 0,
    segment_id: int = 0,
    request_id: int = 0,
    flags: int = 0,
    meta: Mapping[str, Any] | None = None,
) -> Message:
    """A TOKENS message (head -> first stage)."""
    f: dict[FieldTag, Any] = {FieldTag.TOKENS: tokens, FieldTag.POSITIONS: positions, FieldTag.SEQ_IDS: seq_ids}
    if meta is not None:
        f[FieldTag.META] = dict(meta)
    return Message(Kind.TOKENS, f, request_id, lap_id, segment_id, flags)


def hidden_message(
    hidden: np.ndarray,
    positions: Any,
    seq_ids: np.ndarray,
    *,
    encoding: str | Encoding = "f32",
    tokens: Any | None = None,
    lap_id: int = 0,
    segment_id: int = 0,
    request_id: int = 0,
    flags: int = 0,
    meta: Mapping[str, Any] | None = None,
) -> Message:
    """A HIDDEN message (stage -> next stage); ``encoding`` is "f32" (default, exact), "f16" or "q8"."""
    enc = HIDDEN_ENCODINGS.get(encoding) if isinstance(encoding, str) else Encoding(encoding)
    if enc is None:
        raise WireError(f"hidden encoding must be one of {sorted(HIDDEN_ENCODINGS)}, got {encoding!r}")
    f: dict[FieldTag, Any] = {FieldTag.HIDDEN: hidden, FieldTag.POSITIONS: positions, FieldTag.SEQ_IDS: seq_ids}
    if tokens is not None:
        f[FieldTag.TOKENS] = tokens
    if meta is not None:
        f[FieldTag.META] = dict(meta)
    return Message(Kind.HIDDEN, f, request_id, lap_id, segment_id, flags, hidden_encoding=enc)


def error_message(code: str, message: str, *, request_id: int = 0) -> Message:
    """An ERROR message."""
    return Message(Kind.ERROR, {FieldTag.META: {"code": code, "message": message}}, request_id=request_id)


def payload_bytes(msg: Message) -> bytes:
    """The payload of ``msg`` as one bytes object (tests, size accounting)."""
    return b"".join(bytes(c) for c in encode_payload(msg))
