"""Payload codec of the ring's wire protocol: fields, encodings, schemas (docs/design.md 5.1).

Over 450 lines: the per-kind schemas, the encoder and the decoder check one another through
one shared validation and read best side by side (the KV-op helpers at the end are the KV_OPS
field's array form of ``edgespec.tree.kvop.KvOp``).

A payload (see ``edgespec.wire.header`` for the frame around it) is a sequence of *fields*.
Each field is::

    tag (B, ``FieldTag``) | encoding (B, ``Encoding``) | ndim (B) | reserved (B, 0)
    | ndim x u32 dims | data | zero padding to a multiple of 4 bytes

The data length follows from the encoding and the dims, so a corrupted size can never make the
reader run past the payload. Each frame kind has a schema (required / allowed fields, their
encodings and ranks) and related fields must agree on the token count; anything else raises
``WireError``. The tag is computed by ``edgespec.wire.auth`` over header and payload. JSON
fields are bounded in nesting depth (``MAX_JSON_DEPTH``), so a hostile body is a
``WireError``, never a ``RecursionError``.

Hidden states travel as float32 unless the ring is formed otherwise (``--activations``; a
``Message`` and ``hidden_message`` default to ``Encoding.F32`` too, the exact one), or as
float16 or 8-bit blockwise (``Encoding.Q8``, ``edgespec.wire.quant``). They always decode to
float32, because that is what ``llama_batch.embd`` takes.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from edgespec.tree.kvop import KvOp, KvOpCode
from edgespec.wire.header import (
    KNOWN_FLAGS,
    MAX_JSON_DEPTH,
    U32_MAX,
    FrameHeader,
    Kind,
    WireError,
)
from edgespec.wire.quant import Q8_BLOCK, dequantize_q8, q8_layout, quantize_q8

_FIELD_HEAD = struct.Struct("<BBBB")
_MAX_NDIM = 4


class FieldTag(IntEnum):
    """Which quantity a payload field holds."""

    TOKENS = 1  # int32 [n] token ids
    POSITIONS = 2  # int32 [n] positions
    SEQ_IDS = 3  # bool [n, n_seq]: token i belongs to sequence j (bit-packed)
    PARENTS = 4  # int32 [n] tree parent index, -1 for a root, else < own index
    HIDDEN = 5  # float [n, n_embd] hidden states (f32 / f16 / q8)
    KV_OPS = 6  # int32 [m, 5] KV operations (see KvOpCode)
    ACCEPTED = 7  # int32 [k] accepted token ids
    NODES = 8  # int32 [k] tree node indices
    META = 9  # JSON object
    BLOB = 10  # raw bytes (e.g. a shard chunk)


class Encoding(IntEnum):
    """How a field's data is laid out."""

    I32 = 1
    F32 = 2
    F16 = 3
    Q8 = 4  # blockwise int8, see edgespec.wire.quant
    BITS = 5  # bool matrix, rows bit-packed (numpy.packbits, big bit order)
    JSON = 6  # UTF-8 JSON object, dims = (nbytes,)
    BYTES = 7  # raw bytes, dims = (nbytes,)


HIDDEN_ENCODINGS = {"f32": Encoding.F32, "f16": Encoding.F16, "q8": Encoding.Q8}




# ----------------------------------------------------------------------------- field codecs


@dataclass(frozen=True)
class _Rule:
    encodings: frozenset[Encoding]
    ndim: int | None  # None: any
    cols: int | None = None  # required size of the last axis


_I32_1D = _Rule(frozenset({Encoding.I32}), 1)
_FIELD_RULES: dict[FieldTag, _Rule] = {
    FieldTag.TOKENS: _I32_1D,
    FieldTag.POSITIONS: _I32_1D,
    FieldTag.SEQ_IDS: _Rule(frozenset({Encoding.BITS}), 2),
    FieldTag.PARENTS: _I32_1D,
    FieldTag.HIDDEN: _Rule(frozenset({Encoding.F32, Encoding.F16, Encoding.Q8}), 2),
    FieldTag.KV_OPS: _Rule(frozenset({Encoding.I32}), 2, cols=5),
    FieldTag.ACCEPTED: _I32_1D,
    FieldTag.NODES: _I32_1D,
    FieldTag.META: _Rule(frozenset({Encoding.JSON}), 1),
    FieldTag.BLOB: _Rule(frozenset({Encoding.BYTES}), 1),
}

# Per kind: (required, optional) fields.
_T = FieldTag
_SCHEMAS: dict[Kind, tuple[frozenset[FieldTag], frozenset[FieldTag]]] = {
    Kind.HELLO: (frozenset({_T.META}), frozenset()),
    Kind.CHALLENGE: (frozenset({_T.META}), frozenset()),
    Kind.AUTH: (frozenset({_T.META}), frozenset()),
    Kind.WELCOME: (frozenset({_T.META}), frozenset()),
    Kind.ERROR: (frozenset({_T.META}), frozenset()),
    Kind.CLOSE: (frozenset(), frozenset({_T.META})),
    Kind.CONTROL: (frozenset({_T.META}), frozenset({_T.BLOB})),
    Kind.REPLY: (frozenset({_T.META}), frozenset({_T.BLOB})),
    # Batches may carry their rows' tree node ids (NODES, for pruning in flight) and the KV
    # operations every stage applies before them (KV_OPS, ordered with the rows they clean).
    Kind.TOKENS: (
        frozenset({_T.TOKENS, _T.POSITIONS, _T.SEQ_IDS}),
        frozenset({_T.PARENTS, _T.NODES, _T.KV_OPS, _T.META}),
    ),
    Kind.HIDDEN: (
        frozenset({_T.HIDDEN, _T.POSITIONS, _T.SEQ_IDS}),
        frozenset({_T.TOKENS, _T.PARENTS, _T.NODES, _T.KV_OPS, _T.META}),
    ),
    Kind.RESULT: (frozenset({_T.ACCEPTED}), frozenset({_T.NODES, _T.META})),
    Kind.KV_OPS: (frozenset({_T.KV_OPS}), frozenset({_T.META})),
    Kind.COMMIT: (frozenset({_T.ACCEPTED}), frozenset({_T.NODES, _T.KV_OPS, _T.META})),
    Kind.PRUNE: (frozenset({_T.NODES}), frozenset({_T.TOKENS, _T.META})),
}
# Fields whose first axis is the batch's token count; they must agree within one frame.
_PER_TOKEN = (_T.TOKENS, _T.POSITIONS, _T.SEQ_IDS, _T.PARENTS, _T.NODES, _T.HIDDEN)
_PER_TOKEN_KINDS = frozenset({Kind.TOKENS, Kind.HIDDEN})


def _data_size(enc: Encoding, shape: tuple[int, ...]) -> int:
    count = math.prod(shape)
    if enc in (Encoding.I32, Encoding.F32):
        return 4 * count
    if enc == Encoding.F16:
        return 2 * count
    if enc == Encoding.Q8:
        rows, blocks = q8_layout(shape)
        return rows * blocks * (2 + Q8_BLOCK)
    if enc == Encoding.BITS:
        rows = math.prod(shape[:-1])
        return rows * -(-shape[-1] // 8)
    return count  # JSON, BYTES: dims = (nbytes,)


def _byte_view(arr: np.ndarray) -> memoryview | bytes:
    """The bytes of a contiguous array without copying (memoryview cannot cast empty shapes)."""
    return memoryview(arr).cast("B") if arr.size else b""


def _encode_data(tag: FieldTag, enc: Encoding, value: Any) -> tuple[tuple[int, ...], list[bytes | memoryview]]:
    """(dims, data chunks) of one field value."""
    if enc == Encoding.JSON:
        if not isinstance(value, Mapping):
            raise WireError(f"{tag.name}: JSON field must be a mapping, got {type(value).__name__}")
        try:
            raw = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise WireError(f"{tag.name}: not JSON-serialisable: {e}") from None
        return (len(raw),), [raw]
    if enc == Encoding.BYTES:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise WireError(f"{tag.name}: expected bytes, got {type(value).__name__}")
        mv = memoryview(value).cast("B")
        return (mv.nbytes,), [mv]
    arr = np.asarray(value)
    if enc == Encoding.I32:
        if arr.size and arr.dtype.kind not in "iub":
            raise WireError(f"{tag.name}: integer array expected, got dtype {arr.dtype}")
        if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
            raise WireError(f"{tag.name}: value out of int32 range")
        arr = np.ascontiguousarray(arr, dtype="<i4")
        return arr.shape, [_byte_view(arr)]
    if enc == Encoding.BITS:
        if arr.ndim != 2 or arr.dtype != np.bool_:
            raise WireError(f"{tag.name}: bool matrix expected, got {arr.dtype} with {arr.ndim} dims")
        return arr.shape, [np.packbits(arr, axis=1).tobytes()]
    if arr.dtype.kind != "f":
        raise WireError(f"{tag.name}: float array expected, got dtype {arr.dtype}")
    if enc == Encoding.F32:
        arr = np.ascontiguousarray(arr, dtype="<f4")
        return arr.shape, [_byte_view(arr)]
    if enc == Encoding.F16:
        with np.errstate(over="ignore"):
            half = np.ascontiguousarray(arr, dtype="<f2")
        if not np.all(np.isfinite(half)):
            raise WireError(f"{tag.name}: values are NaN/inf or exceed the float16 range; use f32")
        return arr.shape, [_byte_view(half)]
    if enc == Encoding.Q8:
        scales, q = quantize_q8(arr)
        return arr.shape, [scales.astype("<f2").tobytes(), q.tobytes()]
    raise WireError(f"{tag.name}: cannot encode with {enc!r}")


# A JSON string (escapes included) or one bracket: what nesting depth is made of.
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def check_json_depth(raw: bytes, limit: int, what: str = "JSON") -> None:
    """Raise WireError if ``raw`` nests arrays/objects deeper than ``limit``.

    Brackets inside strings do not count. Bodies with few brackets skip the scan.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return
    depth = 0
    for m in _JSON_TOKEN.finditer(raw):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                raise WireError(f"{what}: JSON nested deeper than {limit} levels")
        elif c in (b"]", b"}"):
            depth -= 1


def _decode_data(tag: FieldTag, enc: Encoding, shape: tuple[int, ...], data: memoryview) -> Any:
    if enc == Encoding.JSON:
        raw = bytes(data)
        check_json_depth(raw, MAX_JSON_DEPTH, tag.name)
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise WireError(f"{tag.name}: invalid JSON: {type(e).__name__}: {e}") from None
        if not isinstance(obj, dict):
            raise WireError(f"{tag.name}: JSON body must be an object")
        return obj
    if enc == Encoding.BYTES:
        return data
    if enc == Encoding.I32:
        return np.frombuffer(data, dtype="<i4").reshape(shape)
    if enc == Encoding.F32:
        return np.frombuffer(data, dtype="<f4").reshape(shape)
    if enc == Encoding.F16:
        return np.frombuffer(data, dtype="<f2").reshape(shape).astype(np.float32)
    if enc == Encoding.Q8:
        rows, blocks = q8_layout(shape)
        scales = np.frombuffer(data[: 2 * rows * blocks], dtype="<f2")
        values = np.frombuffer(data[2 * rows * blocks :], dtype=np.int8)
        if not np.all(np.isfinite(scales)):
            raise WireError(f"{tag.name}: q8 scale is NaN/inf")
        return dequantize_q8(scales, values, shape)
    if enc == Encoding.BITS:
        packed = np.frombuffer(data, dtype=np.uint8).reshape(shape[0], -(-shape[1] // 8))
        return np.unpackbits(packed, axis=1, count=shape[1]).astype(bool)
    raise WireError(f"{tag.name}: unknown encoding {enc}")


# ----------------------------------------------------------------------------- messages


@dataclass
class Message:
    """A decoded frame: kind, routing ids and typed fields.

    Field values: int32 arrays for TOKENS/POSITIONS/PARENTS/ACCEPTED/NODES, a bool matrix for
    SEQ_IDS, float arrays for HIDDEN (sent with ``hidden_encoding``), an int32 [m, 5] array or a
    list of ``KvOp`` for KV_OPS, a dict for META, bytes for BLOB.
    """

    kind: Kind
    fields: dict[FieldTag, Any] = field(default_factory=dict)
    request_id: int = 0
    lap_id: int = 0
    segment_id: int = 0
    flags: int = 0
    hidden_encoding: Encoding = Encoding.F32

    @property
    def meta(self) -> dict[str, Any]:
        """The META field, or an empty dict."""
        return self.fields.get(FieldTag.META, {})

    def __getitem__(self, tag: FieldTag) -> Any:
        try:
            return self.fields[tag]
        except KeyError:
            raise KeyError(f"{self.kind.name} message has no {tag.name} field") from None


def _encoding_for(tag: FieldTag, msg: Message) -> Encoding:
    if tag == FieldTag.HIDDEN:
        return msg.hidden_encoding
    return next(iter(_FIELD_RULES[tag].encodings))


def _check_ids(name: str, v: int, bits: int = 32) -> None:
    if not 0 <= v < 2**bits:
        raise WireError(f"{name} {v} out of range for an unsigned {bits}-bit field")


def encode_payload(msg: Message) -> list[bytes | memoryview]:
    """Payload chunks of ``msg`` (send them with scatter/gather; ``b"".join`` for one buffer).

    Validates the message against its kind's schema first, so a node never sends what its
    peer would refuse.
    """
    fields = dict(msg.fields)
    if FieldTag.KV_OPS in fields:
        fields[FieldTag.KV_OPS] = kv_ops_array(fields[FieldTag.KV_OPS])
    decoded_view = Message(msg.kind, fields, msg.request_id, msg.lap_id, msg.segment_id, msg.flags)
    chunks: list[bytes | memoryview] = []
    for tag in sorted(fields):
        if not isinstance(tag, FieldTag):
            raise WireError(f"field key must be a FieldTag, got {tag!r}")
        enc = _encoding_for(tag, msg)
        dims, data = _encode_data(tag, enc, fields[tag])
        if len(dims) > _MAX_NDIM:
            raise WireError(f"{tag.name}: {len(dims)} dims (max {_MAX_NDIM})")
        for d in dims:
            _check_ids(f"{tag.name} dimension", d)
        size = sum(memoryview(c).nbytes for c in data)
        assert size == _data_size(enc, tuple(dims)), (tag, enc, dims, size)
        chunks.append(_FIELD_HEAD.pack(tag, enc, len(dims), 0) + struct.pack(f"<{len(dims)}I", *dims))
        chunks.extend(data)
        if size % 4:
            chunks.append(b"\0" * (-size % 4))
    _validate(decoded_view, {t: _encoding_for(t, msg) for t in fields}, {t: _shape_of(v) for t, v in fields.items()})
    return chunks


def _shape_of(value: Any) -> tuple[int, ...]:
    if isinstance(value, (Mapping, bytes, bytearray, memoryview)):
        return (0,)
    return np.shape(value)


def encode_frame(msg: Message, seq: int = 0) -> tuple[FrameHeader, list[bytes | memoryview]]:
    """Header and payload chunks of ``msg`` with sequence number ``seq``."""
    for name, v in (("request id", msg.request_id), ("lap id", msg.lap_id), ("segment id", msg.segment_id)):
        _check_ids(name, v)
    _check_ids("sequence number", seq, 64)
    if msg.flags & ~KNOWN_FLAGS:
        raise WireError(f"unknown flag bits 0x{msg.flags & ~KNOWN_FLAGS:04x}")
    chunks = encode_payload(msg)
    plen = sum(memoryview(c).nbytes for c in chunks)
    if plen > U32_MAX:
        raise WireError(f"payload of {plen} bytes does not fit a frame")
    return FrameHeader(Kind(msg.kind), int(msg.flags), msg.request_id, msg.lap_id, msg.segment_id, seq, plen), chunks


def decode_payload(header: FrameHeader, payload: bytes | bytearray | memoryview) -> Message:
    """Parse and validate a payload for ``header``; numeric arrays are views where possible."""
    mv = memoryview(payload).cast("B")
    if mv.nbytes != header.payload_len:
        raise WireError(f"payload is {mv.nbytes} bytes, header says {header.payload_len}")
    fields: dict[FieldTag, Any] = {}
    encodings: dict[FieldTag, Encoding] = {}
    shapes: dict[FieldTag, tuple[int, ...]] = {}
    off = 0
    end = mv.nbytes
    while off < end:
        if end - off < _FIELD_HEAD.size:
            raise WireError(f"truncated field header at byte {off}")
        tag_i, enc_i, ndim, reserved = _FIELD_HEAD.unpack_from(mv, off)
        off += _FIELD_HEAD.size
        try:
            tag = FieldTag(tag_i)
        except ValueError:
            raise WireError(f"unknown field tag {tag_i} at byte {off - 4}") from None
        try:
            enc = Encoding(enc_i)
        except ValueError:
            raise WireError(f"{tag.name}: unknown encoding {enc_i}") from None
        if reserved:
            raise WireError(f"{tag.name}: reserved byte is not zero")
        if tag in fields:
            raise WireError(f"{tag.name}: field appears twice")
        if not 1 <= ndim <= _MAX_NDIM:
            raise WireError(f"{tag.name}: {ndim} dims (1..{_MAX_NDIM} allowed)")
        if end - off < 4 * ndim:
            raise WireError(f"{tag.name}: truncated dims")
        shape = struct.unpack_from(f"<{ndim}I", mv, off)
        off += 4 * ndim
        rule = _FIELD_RULES[tag]
        if enc not in rule.encodings:
            raise WireError(f"{tag.name}: encoding {enc.name} not allowed")
        if rule.ndim is not None and ndim != rule.ndim:
            raise WireError(f"{tag.name}: expected {rule.ndim} dims, got {ndim}")
        size = _data_size(enc, shape)
        padded = size + (-size % 4)
        if padded > end - off:
            raise WireError(f"{tag.name}: {size} data bytes for shape {shape} exceed the payload")
        if any(mv[off + size : off + padded]):
            raise WireError(f"{tag.name}: padding is not zero")
        fields[tag] = _decode_data(tag, enc, shape, mv[off : off + size])
        encodings[tag] = enc
        shapes[tag] = shape
        off += padded
    msg = Message(header.kind, fields, header.request_id, header.lap_id, header.segment_id, header.flags)
    if FieldTag.HIDDEN in encodings:
        msg.hidden_encoding = encodings[FieldTag.HIDDEN]
    _validate(msg, encodings, shapes)
    return msg


def _validate(msg: Message, encodings: Mapping[FieldTag, Encoding], shapes: Mapping[FieldTag, tuple[int, ...]]) -> None:
    """Schema and consistency checks shared by encoder and decoder."""
    required, optional = _SCHEMAS[Kind(msg.kind)]
    present = set(msg.fields)
    missing = required - present
    if missing:
        raise WireError(f"{Kind(msg.kind).name} frame lacks {sorted(t.name for t in missing)}")
    extra = present - required - optional
    if extra:
        raise WireError(f"{Kind(msg.kind).name} frame may not carry {sorted(t.name for t in extra)}")
    for tag, enc in encodings.items():
        rule = _FIELD_RULES[tag]
        if enc not in rule.encodings:
            raise WireError(f"{tag.name}: encoding {enc.name} not allowed")
        shape = shapes[tag]
        if enc not in (Encoding.JSON, Encoding.BYTES):
            if rule.ndim is not None and len(shape) != rule.ndim:
                raise WireError(f"{tag.name}: expected {rule.ndim} dims, got shape {tuple(shape)}")
            if rule.cols is not None and shape[-1] != rule.cols:
                raise WireError(f"{tag.name}: expected {rule.cols} columns, got {shape[-1]}")
    if Kind(msg.kind) in _PER_TOKEN_KINDS:
        counts = {t.name: shapes[t][0] for t in _PER_TOKEN if t in shapes}
        if len(set(counts.values())) > 1:
            raise WireError(f"token counts disagree between fields: {counts}")
        n = next(iter(counts.values()))
        if n == 0:
            raise WireError("a batch needs at least one token")
        if FieldTag.SEQ_IDS in msg.fields:
            sm = msg.fields[FieldTag.SEQ_IDS]
            if not np.all(np.asarray(sm).any(axis=1)):
                raise WireError("SEQ_IDS: every token needs at least one sequence")
        if FieldTag.HIDDEN in shapes and shapes[FieldTag.HIDDEN][1] == 0:
            raise WireError("HIDDEN: zero-width hidden states")
    for tag in (FieldTag.TOKENS, FieldTag.POSITIONS, FieldTag.ACCEPTED, FieldTag.NODES):
        if tag in msg.fields:
            a = np.asarray(msg.fields[tag])
            if a.size and a.min() < 0:
                raise WireError(f"{tag.name}: negative value {int(a.min())}")
    if FieldTag.PARENTS in msg.fields:
        p = np.asarray(msg.fields[FieldTag.PARENTS])
        if p.size and (np.any(p < -1) or np.any(p >= np.arange(p.size))):
            raise WireError("PARENTS: each parent must be -1 or an earlier node index")
    if FieldTag.KV_OPS in msg.fields:
        kv_ops_list(msg.fields[FieldTag.KV_OPS])  # validates codes and arguments


def kv_ops_array(ops: Any) -> np.ndarray:
    """int32 [m, 5] array from a list of ``KvOp`` (or an existing array, validated)."""
    if isinstance(ops, np.ndarray):
        arr = ops
    else:
        ops = list(ops)
        arr = np.array([tuple(int(x) for x in op) for op in ops], dtype=np.int64).reshape(len(ops), -1) if ops else np.zeros((0, 5), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise WireError(f"KV_OPS: expected shape (m, 5), got {arr.shape}")
    kv_ops_list(arr)
    return arr.astype("<i4")


def kv_ops_list(arr: Any) -> list[KvOp]:
    """Validated list of ``KvOp`` from an int32 [m, 5] array (or a list of KvOp)."""
    a = np.asarray(arr if isinstance(arr, np.ndarray) else [tuple(op) for op in arr], dtype=np.int64)
    if a.size == 0:
        return []
    if a.ndim != 2 or a.shape[1] != 5:
        raise WireError(f"KV_OPS: expected shape (m, 5), got {a.shape}")
    out = []
    for row in a.tolist():
        code, seq, p0, p1, arg = row
        try:
            code = KvOpCode(code)
        except ValueError:
            raise WireError(f"KV_OPS: unknown operation code {code}") from None
        if seq < 0 or p0 < -1 or p1 < -1 or (p0 >= 0 and p1 >= 0 and p1 < p0):
            raise WireError(f"KV_OPS: bad arguments {row}")
        if code == KvOpCode.CP and arg < 0:
            raise WireError(f"KV_OPS: copy needs a destination sequence, got {arg}")
        if code in (KvOpCode.RM, KvOpCode.KEEP) and arg != 0:
            raise WireError(f"KV_OPS: {code.name} takes no argument, got {arg}")
        if not all(-(2**31) <= v < 2**31 for v in row):
            raise WireError(f"KV_OPS: value out of int32 range in {row}")
        out.append(KvOp(code, seq, p0, p1, arg))
    return out
