"""Payload codec of the ring's wire protocol: fields, encodings, schemas (docs/design.md 5.1).

Over 450 lines: the per-kind schemas, the encoder and the decoder check one another through
one shared validation and read best side by side (the KV-op helpers at the end are the KV_OPS
field's array form of ``edgespec.tree.kvop.KvOp``). Both run on every link of every lap, so
they read tables built once from the schemas ("per-hop tables" below).

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
from typing import Any, NamedTuple

import numpy as np

from edgespec._native import core as _core
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
    # 4 is reserved: a tree-parents field no stage reads (trees are the head's alone).
    HIDDEN = 5  # float [n, n_embd] hidden states (f32 / f16 / q8)
    KV_OPS = 6  # int32 [m, 5] KV operations (see KvOpCode)
    TARGETS = 7  # int32 [k] the target model's token after each wanted row (RESULT)
    NODES = 8  # int32 [k] tree node indices
    META = 9  # JSON object
    BLOB = 10  # raw bytes (e.g. a shard chunk)
    LOGPROBS = 11  # f32 [k, 1 + n]: each target's log probability, then the top n's (RESULT)
    TOP_IDS = 12  # int32 [k, n]: the n most likely tokens after each wanted row (RESULT)


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
    FieldTag.HIDDEN: _Rule(frozenset({Encoding.F32, Encoding.F16, Encoding.Q8}), 2),
    FieldTag.KV_OPS: _Rule(frozenset({Encoding.I32}), 2, cols=5),
    FieldTag.TARGETS: _I32_1D,
    FieldTag.NODES: _I32_1D,
    FieldTag.META: _Rule(frozenset({Encoding.JSON}), 1),
    FieldTag.BLOB: _Rule(frozenset({Encoding.BYTES}), 1),
    FieldTag.LOGPROBS: _Rule(frozenset({Encoding.F32}), 2),
    FieldTag.TOP_IDS: _Rule(frozenset({Encoding.I32}), 2),
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
        frozenset({_T.NODES, _T.KV_OPS, _T.META}),
    ),
    Kind.HIDDEN: (
        frozenset({_T.HIDDEN, _T.POSITIONS, _T.SEQ_IDS}),
        frozenset({_T.TOKENS, _T.NODES, _T.KV_OPS, _T.META}),
    ),
    Kind.RESULT: (frozenset({_T.TARGETS}),
                  frozenset({_T.NODES, _T.META, _T.LOGPROBS, _T.TOP_IDS})),
    Kind.KV_OPS: (frozenset({_T.KV_OPS}), frozenset({_T.META})),
    Kind.PRUNE: (frozenset({_T.NODES}), frozenset({_T.TOKENS, _T.META})),
}
# Fields whose first axis is the batch's token count; they must agree within one frame.
_PER_TOKEN = (_T.TOKENS, _T.POSITIONS, _T.SEQ_IDS, _T.NODES, _T.HIDDEN)
_PER_TOKEN_KINDS = frozenset({Kind.TOKENS, Kind.HIDDEN})


_NON_NEGATIVE = (_T.TOKENS, _T.POSITIONS, _T.TARGETS, _T.NODES, _T.TOP_IDS)

# ----------------------------------------------------------------------------- per-hop tables
# Every batch pays this codec on every link of every lap, and in the ring it runs right after
# llama.cpp's compute has evicted the caches, at about 4x its hot cost. So the per-field work
# reads plain tables built once here from the rules above: no enum constructor calls, no
# ``.name`` lookups (a descriptor call each), no struct formats built per call, and values are
# checked with Python's min/max where numpy's fixed cost would dominate.


class _Spec(NamedTuple):
    tag: FieldTag
    name: str
    encodings: frozenset[int]  # allowed
    encoding: Encoding  # the one an encoder uses (HIDDEN: the message's hidden_encoding)
    ndim: int | None
    cols: int | None


_SPECS: dict[int, _Spec] = {  # keyed by FieldTag; a plain int finds its entry too
    tag: _Spec(tag, tag.name, frozenset(rule.encodings), next(iter(rule.encodings)), rule.ndim,
               rule.cols)
    for tag, rule in _FIELD_RULES.items()
}
_ENCODINGS: dict[int, Encoding] = {int(e): e for e in Encoding}


class _Schema(NamedTuple):
    name: str
    required: frozenset[FieldTag]
    allowed: frozenset[FieldTag]  # required | optional
    per_token: bool


_KIND_SCHEMAS: dict[int, _Schema] = {
    kind: _Schema(kind.name, req, req | opt, kind in _PER_TOKEN_KINDS)
    for kind, (req, opt) in _SCHEMAS.items()
}
_DIMS = {n: struct.Struct(f"<{n}I") for n in range(1, _MAX_NDIM + 1)}
_FIELD_HEADS = {n: struct.Struct(f"<BBBB{n}I") for n in range(1, _MAX_NDIM + 1)}
_PADDING = {1: b"\0", 2: b"\0\0", 3: b"\0\0\0"}
_I4, _F4, _F2 = np.dtype("<i4"), np.dtype("<f4"), np.dtype("<f2")
_I32, _F32, _F16, _Q8, _BITS, _JSON, _BYTES = (Encoding.I32, Encoding.F32, Encoding.F16,
                                                Encoding.Q8, Encoding.BITS, Encoding.JSON,
                                                Encoding.BYTES)
_HIDDEN, _SEQ_IDS, _KV_OPS = _T.HIDDEN, _T.SEQ_IDS, _T.KV_OPS
# One encoder object: json.dumps with these arguments would build a new one per call. Same
# bytes (the C encoder, float repr, compact separators).
_json_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
# SEQ_IDS one column wide (one sequence, the common case): the bit-packed byte of a row is
# 0x80 or 0; a bool byte maps onto it (and back) with bytes.translate, far below packbits'
# and unpackbits' fixed cost.
_BOOL_TO_BIT = bytes(0x80 if b else 0 for b in range(256))
_BIT_TO_BOOL = bytes(b >> 7 for b in range(256))
# Per row width 1..8 (one packed byte per row): the byte with the padding bits cleared, so a
# row with no sequence is a zero byte whatever the (unchecked) padding bits hold.
_ROW_BITS = {w: bytes(b & (0xFF << (8 - w)) & 0xFF for b in range(256)) for w in range(1, 9)}
_FEW = 64  # up to this many values, Python's min/max beat numpy's reductions


def _data_size(enc: int, shape: tuple[int, ...]) -> int:
    count = math.prod(shape)
    if enc in (_I32, _F32):
        return 4 * count
    if enc == _F16:
        return 2 * count
    if enc == _Q8:
        rows, blocks = q8_layout(shape)
        return rows * blocks * (2 + Q8_BLOCK)
    if enc == _BITS:
        rows = math.prod(shape[:-1])
        return rows * -(-shape[-1] // 8)
    return count  # JSON, BYTES: dims = (nbytes,)


def _byte_view(arr: np.ndarray) -> memoryview | bytes:
    """The bytes of a contiguous array without copying (memoryview cannot cast empty shapes)."""
    return memoryview(arr).cast("B") if arr.size else b""


def _low_high(a: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty array."""
    if a.size <= _FEW:
        vals = a.ravel().tolist()
        return min(vals), max(vals)
    return int(a.min()), int(a.max())


def _lowest(a: np.ndarray) -> int:
    """min of a non-empty array."""
    return min(a.ravel().tolist()) if a.size <= _FEW else int(a.min())


def _encode_data(spec: _Spec, enc: int, value: Any) -> tuple[tuple[int, ...], list, int, Any]:
    """(dims, data chunks, data size, checked) of one field value; ``checked`` is what
    ``_validate`` reads: the int32 array (I32), the packed rows (BITS), else None."""
    if enc == _JSON:
        if type(value) is not dict and not isinstance(value, Mapping):
            raise WireError(f"{spec.name}: JSON field must be a mapping, got {type(value).__name__}")
        try:
            raw = _json_encode(value).encode()
        except (TypeError, ValueError) as e:
            raise WireError(f"{spec.name}: not JSON-serialisable: {e}") from None
        return (len(raw),), [raw], len(raw), None
    if enc == _BYTES:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise WireError(f"{spec.name}: expected bytes, got {type(value).__name__}")
        mv = memoryview(value).cast("B")
        return (mv.nbytes,), [mv], mv.nbytes, None
    arr = value if type(value) is np.ndarray else np.asarray(value)
    if enc == _I32:
        if arr.dtype != _I4:  # an int32 array cannot be out of the int32 range
            if arr.size and arr.dtype.kind not in "iub":
                raise WireError(f"{spec.name}: integer array expected, got dtype {arr.dtype}")
            if arr.size:
                low, high = _low_high(arr)
                if low < -(2**31) or high >= 2**31:
                    raise WireError(f"{spec.name}: value out of int32 range")
        arr = np.ascontiguousarray(arr, dtype=_I4)
        return arr.shape, [_byte_view(arr)], arr.nbytes, arr
    if enc == _BITS:
        if arr.ndim != 2 or arr.dtype != np.bool_:
            raise WireError(f"{spec.name}: bool matrix expected, got {arr.dtype} with {arr.ndim} dims")
        if arr.shape[1] == 1:
            packed = arr.tobytes().translate(_BOOL_TO_BIT)
        else:
            packed = np.packbits(arr, axis=1).tobytes()
        return arr.shape, [packed], len(packed), (packed, arr)
    if arr.dtype.kind != "f":
        raise WireError(f"{spec.name}: float array expected, got dtype {arr.dtype}")
    if enc == _F32:
        arr = np.ascontiguousarray(arr, dtype=_F4)
        return arr.shape, [_byte_view(arr)], arr.nbytes, None
    if enc == _F16:
        with np.errstate(over="ignore"):
            half = np.ascontiguousarray(arr, dtype=_F2)
        if not np.all(np.isfinite(half)):
            raise WireError(f"{spec.name}: values are NaN/inf or exceed the float16 range; use f32")
        return arr.shape, [_byte_view(half)], half.nbytes, None
    if enc == _Q8:
        scales, q = quantize_q8(arr)
        return arr.shape, [scales.astype("<f2").tobytes(), q.tobytes()], 2 * scales.size + q.size, None
    raise WireError(f"{spec.name}: cannot encode with {enc!r}")


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


def json_object(raw: bytes, name: str = "META") -> dict:
    """A JSON field's object, checked as every JSON field is (depth, UTF-8, an object)."""
    check_json_depth(raw, MAX_JSON_DEPTH, name)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WireError(f"{name}: invalid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise WireError(f"{name}: JSON body must be an object")
    return obj


def json_bytes(obj: Mapping) -> bytes:
    """A JSON field's bytes, exactly as the encoder writes them."""
    return _json_encode(obj).encode()


def _decode_data(spec: _Spec, enc: Encoding, shape: tuple[int, ...], data: memoryview) -> tuple[Any, Any]:
    """(value, checked) of one field, ``checked`` as in ``_encode_data``."""
    if enc is _I32:
        arr = np.frombuffer(data, _I4)
        return (arr if len(shape) == 1 else arr.reshape(shape)), arr
    if enc is _F32:
        return np.frombuffer(data, _F4).reshape(shape), None
    if enc is _JSON:
        return json_object(bytes(data), spec.name), None
    if enc is _BITS:
        # Read-only, so that a batch forwarded unchanged can send on this very matrix
        # (``SeqIds.from_bool_matrix(remember=True)``).
        rows, width = shape
        packed = bytes(data)
        if width == 1:
            m = np.frombuffer(packed.translate(_BIT_TO_BOOL), np.bool_).reshape(rows, 1)
        else:
            bits = np.unpackbits(np.frombuffer(packed, np.uint8).reshape(rows, -(-width // 8)),
                                 axis=1, count=width)
            bits.flags.writeable = False
            m = bits.view(np.bool_)
        return m, (packed, m)
    if enc is _BYTES:
        return data, None
    if enc is _F16:
        return np.frombuffer(data, _F2).reshape(shape).astype(np.float32), None
    if enc is _Q8:
        rows, blocks = q8_layout(shape)
        scales = np.frombuffer(data[: 2 * rows * blocks], dtype="<f2")
        values = np.frombuffer(data[2 * rows * blocks :], dtype=np.int8)
        if not np.all(np.isfinite(scales)):
            raise WireError(f"{spec.name}: q8 scale is NaN/inf")
        return dequantize_q8(scales, values, shape), None
    raise WireError(f"{spec.name}: unknown encoding {enc}")


# ----------------------------------------------------------------------------- messages


@dataclass
class Message:
    """A decoded frame: kind, routing ids and typed fields.

    Field values: int32 arrays for TOKENS/POSITIONS/TARGETS/NODES, a bool matrix for
    SEQ_IDS (read-only when decoded), float arrays for HIDDEN (sent with ``hidden_encoding``), an int32 [m, 5] array or a
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


def _check_ids(name: str, v: int, bits: int = 32) -> None:
    if not 0 <= v < 2**bits:
        raise WireError(f"{name} {v} out of range for an unsigned {bits}-bit field")


def _schema(kind: int) -> _Schema:
    schema = _KIND_SCHEMAS.get(kind)
    if schema is None:
        raise WireError(f"unknown frame kind {kind!r}")
    return schema


def _encode(msg: Message) -> tuple[list[bytes | memoryview], int]:
    """(payload chunks, payload length) of ``msg``, validated (``encode_payload``)."""
    schema = _schema(msg.kind)
    fields = msg.fields
    chunks: list[bytes | memoryview] = []
    plen = 0
    shapes: dict[FieldTag, tuple[int, ...]] = {}
    checked: dict[FieldTag, Any] = {}
    for tag in sorted(fields):
        spec = _SPECS.get(tag) if type(tag) is FieldTag else None
        if spec is None:
            raise WireError(f"field key must be a FieldTag, got {tag!r}")
        value = fields[tag]
        if tag is _KV_OPS:
            value = kv_ops_array(value)  # validates codes and arguments
        enc = spec.encoding
        if tag is _HIDDEN:
            enc = msg.hidden_encoding
            if enc not in spec.encodings:
                name = getattr(_ENCODINGS.get(enc), "name", enc)
                raise WireError(f"{spec.name}: encoding {name} not allowed")
        dims, data, size, checked[tag] = _encode_data(spec, enc, value)
        ndim = len(dims)
        if ndim > _MAX_NDIM:
            raise WireError(f"{spec.name}: {ndim} dims (max {_MAX_NDIM})")
        if spec.ndim is not None and ndim != spec.ndim:
            raise WireError(f"{spec.name}: expected {spec.ndim} dims, got shape {tuple(dims)}")
        try:
            chunks.append(_FIELD_HEADS[ndim].pack(tag, enc, ndim, 0, *dims))
        except struct.error:
            for d in dims:
                _check_ids(f"{spec.name} dimension", d)
            raise
        chunks.extend(data)
        pad = -size % 4
        if pad:
            chunks.append(_PADDING[pad])
        plen += 4 + 4 * ndim + size + pad
        shapes[tag] = dims
    _validate(schema, shapes, checked)
    return chunks, plen


def encode_payload(msg: Message) -> list[bytes | memoryview]:
    """Payload chunks of ``msg`` (send them with scatter/gather; ``b"".join`` for one buffer).

    Validates the message against its kind's schema first, so a node never sends what its
    peer would refuse.
    """
    return _encode(msg)[0]


def encode_frame(msg: Message, seq: int = 0) -> tuple[FrameHeader, list[bytes | memoryview]]:
    """Header and payload chunks of ``msg`` with sequence number ``seq``."""
    rid, lap, seg = msg.request_id, msg.lap_id, msg.segment_id
    if not (0 <= rid <= U32_MAX and 0 <= lap <= U32_MAX and 0 <= seg <= U32_MAX):
        for name, v in (("request id", rid), ("lap id", lap), ("segment id", seg)):
            _check_ids(name, v)
    _check_ids("sequence number", seq, 64)
    if msg.flags & ~KNOWN_FLAGS:
        raise WireError(f"unknown flag bits 0x{msg.flags & ~KNOWN_FLAGS:04x}")
    fast = _result_payload(msg) if msg.kind == Kind.RESULT else None
    if fast is not None:
        return FrameHeader(Kind.RESULT, int(msg.flags), rid, lap, seg, seq, len(fast)), [fast]
    chunks, plen = _encode(msg)
    if plen > U32_MAX:
        raise WireError(f"payload of {plen} bytes does not fit a frame")
    kind = msg.kind if type(msg.kind) is Kind else Kind(msg.kind)
    return FrameHeader(kind, int(msg.flags), rid, lap, seg, seq, plen), chunks


def _result_payload(msg: Message) -> bytes | None:
    """A RESULT's payload from the C++ core (one call: every lap's last link, docs/design.md
    8.3), byte for byte this codec's; None when the message is not its canonical form
    (TARGETS, NODES and META, int32 and non-negative), which ``_encode`` then handles."""
    f = msg.fields
    acc, nodes, meta = f.get(FieldTag.TARGETS), f.get(FieldTag.NODES), f.get(FieldTag.META)
    if (len(f) != 3 or type(acc) is not np.ndarray or type(nodes) is not np.ndarray
            or type(meta) is not dict):
        return None
    try:
        raw = _json_encode(meta).encode()
    except (TypeError, ValueError):
        return None
    return _core.build_result_payload(acc, nodes, raw)


def decode_payload(header: FrameHeader, payload: bytes | bytearray | memoryview) -> Message:
    """Parse and validate a payload for ``header``; numeric arrays are views where possible."""
    mv = memoryview(payload).cast("B")
    end = mv.nbytes
    if end != header.payload_len:
        raise WireError(f"payload is {end} bytes, header says {header.payload_len}")
    if header.kind == Kind.RESULT:
        parsed = _core.parse_result_payload(mv)
        if parsed is not None:  # the canonical RESULT, read in one call (_result_payload)
            acc, nodes, meta_raw = parsed
            got: dict[FieldTag, Any] = {FieldTag.TARGETS: acc}
            if nodes is not None:
                got[FieldTag.NODES] = nodes
            if meta_raw is not None:
                got[FieldTag.META] = json_object(meta_raw)
            return Message(header.kind, got, header.request_id, header.lap_id,
                           header.segment_id, header.flags)
    fields: dict[FieldTag, Any] = {}
    shapes: dict[FieldTag, tuple[int, ...]] = {}
    checked: dict[FieldTag, Any] = {}
    hidden_encoding = _F32
    off = 0
    while off < end:
        if end - off < 4:
            raise WireError(f"truncated field header at byte {off}")
        tag_i, enc_i, ndim, reserved = _FIELD_HEAD.unpack_from(mv, off)
        spec = _SPECS.get(tag_i)
        if spec is None:
            raise WireError(f"unknown field tag {tag_i} at byte {off}")
        off += 4
        name = spec.name
        enc = _ENCODINGS.get(enc_i)
        if enc is None:
            raise WireError(f"{name}: unknown encoding {enc_i}")
        if reserved:
            raise WireError(f"{name}: reserved byte is not zero")
        tag = spec.tag
        if tag in fields:
            raise WireError(f"{name}: field appears twice")
        if not 1 <= ndim <= _MAX_NDIM:
            raise WireError(f"{name}: {ndim} dims (1..{_MAX_NDIM} allowed)")
        if end - off < 4 * ndim:
            raise WireError(f"{name}: truncated dims")
        shape = _DIMS[ndim].unpack_from(mv, off)
        off += 4 * ndim
        if enc_i not in spec.encodings:
            raise WireError(f"{name}: encoding {enc.name} not allowed")
        if spec.ndim is not None and ndim != spec.ndim:
            raise WireError(f"{name}: expected {spec.ndim} dims, got {ndim}")
        size = _data_size(enc, shape)
        padded = size + (-size % 4)
        if padded > end - off:
            raise WireError(f"{name}: {size} data bytes for shape {shape} exceed the payload")
        if padded != size and any(mv[off + size : off + padded]):
            raise WireError(f"{name}: padding is not zero")
        fields[tag], checked[tag] = _decode_data(spec, enc, shape, mv[off : off + size])
        shapes[tag] = shape
        if tag is _HIDDEN:
            hidden_encoding = enc
        off += padded
    _validate(_schema(header.kind), shapes, checked)
    if _KV_OPS in fields:
        kv_ops_list(fields[_KV_OPS])  # validates codes and arguments
    return Message(header.kind, fields, header.request_id, header.lap_id, header.segment_id,
                   header.flags, hidden_encoding)


def _rows_have_a_sequence(packed: bytes, matrix: np.ndarray) -> bool:
    """Whether every row of a SEQ_IDS field names a sequence (``packed``: its wire bytes)."""
    width = matrix.shape[1]
    if 1 <= width <= 8:  # one byte per row: no zero byte once the padding bits are cleared
        return b"\0" not in packed.translate(_ROW_BITS[width])
    return bool(np.all(matrix.any(axis=1)))


def _validate(schema: _Schema, shapes: Mapping[FieldTag, tuple[int, ...]],
              checked: Mapping[FieldTag, Any]) -> None:
    """Schema and consistency checks shared by encoder and decoder, after the fields' own
    (``shapes``: each field's dims; ``checked``: what ``_encode_data``/``_decode_data`` gave)."""
    present = shapes.keys()
    if not (present >= schema.required and present <= schema.allowed):
        missing = schema.required - present
        if missing:
            raise WireError(f"{schema.name} frame lacks {sorted(t.name for t in missing)}")
        extra = present - schema.allowed
        raise WireError(f"{schema.name} frame may not carry {sorted(t.name for t in extra)}")
    kv = shapes.get(_KV_OPS)
    if kv is not None and kv[-1] != 5:
        raise WireError(f"KV_OPS: expected 5 columns, got {kv[-1]}")
    if schema.per_token:
        n = -1
        for t in _PER_TOKEN:
            s = shapes.get(t)
            if s is not None:
                if n < 0:
                    n = s[0]
                elif s[0] != n:
                    counts = {t.name: shapes[t][0] for t in _PER_TOKEN if t in shapes}
                    raise WireError(f"token counts disagree between fields: {counts}")
        if n == 0:
            raise WireError("a batch needs at least one token")
        seq = checked.get(_SEQ_IDS)
        if seq is not None and not _rows_have_a_sequence(*seq):
            raise WireError("SEQ_IDS: every token needs at least one sequence")
        hidden = shapes.get(_HIDDEN)
        if hidden is not None and hidden[1] == 0:
            raise WireError("HIDDEN: zero-width hidden states")
    for tag in _NON_NEGATIVE:
        a = checked.get(tag)
        if a is not None and a.size:
            low = _lowest(a)
            if low < 0:
                raise WireError(f"{tag.name}: negative value {low}")


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
        if code in (KvOpCode.RM, KvOpCode.KEEP, KvOpCode.PARK, KvOpCode.RESTORE) and arg != 0:
            raise WireError(f"KV_OPS: {code.name} takes no argument, got {arg}")
        if code in (KvOpCode.PARK, KvOpCode.RESTORE) and (p0 != -1 or p1 != -1):
            raise WireError(f"KV_OPS: {code.name} takes a whole sequence, got {row}")
        if not all(-(2**31) <= v < 2**31 for v in row):
            raise WireError(f"KV_OPS: value out of int32 range in {row}")
        out.append(KvOp(code, seq, p0, p1, arg))
    return out
