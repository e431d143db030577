"""The ring's wire: frame format, handshake and sealing, connections, control messages,
shard transfer and mDNS discovery (docs/design.md 5.1, 5.5, 5.6).

One concept per module:

- ``header``: the 32-byte frame header, frame kinds and flags, ``WireError``.
- ``codec``: payload fields, their encodings and per-kind schemas; ``Message``; encode/decode.
- ``quant``: 8-bit blockwise quantization of hidden states (``Encoding.Q8``).
- ``messages``: builders of the data messages (TOKENS, HIDDEN, ERROR), the seq-id matrix.
- ``frames``: chain batches and results <-> TOKENS/HIDDEN/RESULT messages.
- ``control``: typed CONTROL requests and REPLY answers, one model per op.
- ``auth``: ring key files, key proofs, session keys, frame sealing.
- ``transport``: the key-proof handshake (``connect``, ``accept_handshake``) and an
  authenticated connection (send, receive, request).
- ``server``: ``FrameServer``, the listener that dispatches frames by kind.
- ``transfer``: resumable, verified shard upload over control messages.
- ``discovery``: mDNS advertise / browse of nodes.

The frame format's names (header, codec, quant, messages and ``control_message``) are
importable from ``edgespec.wire`` itself, where the whole package reads them.
"""

from edgespec.wire.codec import (
    HIDDEN_ENCODINGS,
    Encoding,
    FieldTag,
    KvOp,
    KvOpCode,
    Message,
    check_json_depth,
    decode_payload,
    encode_frame,
    encode_payload,
    kv_ops_array,
    kv_ops_list,
)
from edgespec.wire.control import control_message
from edgespec.wire.header import (
    DEFAULT_MAX_PAYLOAD,
    HANDSHAKE_KINDS,
    HANDSHAKE_MAX_PAYLOAD,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_JSON_DEPTH,
    PROTOCOL_VERSION,
    TAG_SIZE,
    Flag,
    FrameHeader,
    Kind,
    WireError,
    decode_header,
)
from edgespec.wire.messages import (
    error_message,
    hidden_message,
    payload_bytes,
    seq_lists,
    seq_matrix,
    tokens_message,
)
from edgespec.wire.quant import Q8_BLOCK, dequantize_q8, quantize_q8

__all__ = [
    "DEFAULT_MAX_PAYLOAD", "HANDSHAKE_KINDS", "HANDSHAKE_MAX_PAYLOAD", "HEADER", "HEADER_SIZE",
    "HIDDEN_ENCODINGS", "MAGIC", "MAX_JSON_DEPTH", "PROTOCOL_VERSION", "Q8_BLOCK", "TAG_SIZE",
    "Encoding", "FieldTag", "Flag", "FrameHeader", "Kind", "KvOp", "KvOpCode", "Message",
    "WireError", "check_json_depth", "control_message", "decode_header", "decode_payload",
    "dequantize_q8", "encode_frame", "encode_payload", "error_message", "hidden_message",
    "kv_ops_array", "kv_ops_list", "payload_bytes", "quantize_q8", "seq_lists", "seq_matrix",
    "tokens_message",
]
