"""Frame header of the ring's wire protocol (docs/design.md 5.1).

A frame on a TCP stream is::

    header (32 bytes) | payload (payload_len bytes) | tag (16 bytes, sealed frames only)

Before the handshake's key proofs (HELLO, CHALLENGE, refusals) frames are plain. From AUTH on,
the payload travels encrypted and the 16-byte AEAD tag follows it (``edgespec.wire.auth``); the
header stays readable, because the receiver needs it to frame the stream, but it is covered
by the tag, so it cannot be altered either.

Header, little-endian (``HEADER``)::

    0  2s  magic b"eS"
    2  B   protocol version (PROTOCOL_VERSION)
    3  B   kind (``Kind``)
    4  H   flags (``Flag``; unknown bits are refused)
    6  H   reserved, must be 0
    8  I   request id   (pairs a reply with its request; 0 = none)
    12 I   lap id       (one pass of the ring)
    16 I   segment id   (FlowSpec segment inside a lap)
    20 Q   sequence number (per direction of one connection; the AEAD nonce of a sealed frame)
    28 I   payload length

The payload (fields and their encodings) is ``edgespec.wire.codec``'s.
"""

from __future__ import annotations

import struct
from enum import IntEnum, IntFlag
from typing import NamedTuple

#: 2: sealed frames (AEAD instead of a MAC), node ids exchanged only after the key proofs.
#: 3: lap-timing stamps in META are integer microseconds (were float seconds).
#: 4: META.sampling names a request's sampler registered at the last stage (a ``SamplerRef``:
#: key, registration once, text added); KV_OPS' META.release frees it.
PROTOCOL_VERSION = 4
MAGIC = b"eS"
HEADER = struct.Struct("<2sBBHHIIIQI")
HEADER_SIZE = HEADER.size  # 32
TAG_SIZE = 16
#: Default cap on one frame's payload. Large enough for 256 tokens x 16384 float32 hidden
#: values; shard transfers go in chunks well below it.
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024
#: Cap on frames exchanged before authentication (handshake bodies are a few hundred bytes).
HANDSHAKE_MAX_PAYLOAD = 4096
#: Deepest nesting of arrays/objects a JSON field may have. Control bodies nest two or three
#: levels; the cap keeps json.loads far from Python's recursion limit.
MAX_JSON_DEPTH = 32
U32_MAX = 0xFFFFFFFF


class WireError(ValueError):
    """A frame or payload that does not follow the protocol (or cannot be encoded)."""


class Kind(IntEnum):
    """What a frame is. Handshake kinds travel before authentication, all others after."""

    HELLO = 1  # client -> server: protocol, client nonce, key tag, sealing on/off
    CHALLENGE = 2  # server -> client: server nonce + server proof
    AUTH = 3  # client -> server, first sealed frame: client proof + client node id
    WELCOME = 4  # server -> client, sealed: accepted + server node id
    ERROR = 8  # either way: {"code", "message"}; answers a bad frame or a failed request
    CLOSE = 9  # either way: orderly goodbye
    CONTROL = 16  # {"op": load|profile|health|shutdown|...}, optional blob (shard chunks)
    REPLY = 17  # answer to CONTROL, same request id
    TOKENS = 32  # head -> stage 0: token ids, positions, seq ids (+ tree node ids, KV ops)
    HIDDEN = 33  # stage -> stage: hidden states, positions, seq ids (+ tree node ids, KV ops)
    RESULT = 34  # last stage -> head: target token per wanted row (+ their tree node ids)
    KV_OPS = 35  # explicit KV cache operation list for a stage
    # 36: reserved (was COMMIT, never sent; commits travel as KV_OPS). Do not reuse.
    PRUNE = 37  # FlowSpec pruning: tree node indices whose rows every stage drops


HANDSHAKE_KINDS = frozenset({Kind.HELLO, Kind.CHALLENGE, Kind.AUTH, Kind.WELCOME, Kind.ERROR})


class Flag(IntFlag):
    """Frame flags."""

    NONE = 0
    # 1: reserved (was FINAL_SEGMENT, never set). Do not reuse.
    NEEDS_REPLY = 2  # the sender waits for an answer with the same request id


KNOWN_FLAGS = int(Flag.NEEDS_REPLY)


class FrameHeader(NamedTuple):
    """A decoded frame header."""

    kind: Kind
    flags: int
    request_id: int
    lap_id: int
    segment_id: int
    seq: int
    payload_len: int

    def pack(self) -> bytes:
        """The 32 header bytes."""
        return HEADER.pack(
            MAGIC,
            PROTOCOL_VERSION,
            int(self.kind),
            self.flags,
            0,
            self.request_id,
            self.lap_id,
            self.segment_id,
            self.seq,
            self.payload_len,
        )


def decode_header(buf: bytes | bytearray | memoryview, max_payload: int = DEFAULT_MAX_PAYLOAD) -> FrameHeader:
    """Parse and validate 32 header bytes; raise WireError on anything unexpected."""
    if len(buf) != HEADER_SIZE:
        raise WireError(f"header must be {HEADER_SIZE} bytes, got {len(buf)}")
    magic, version, kind, flags, reserved, rid, lap, seg, seq, plen = HEADER.unpack(buf)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r} (not an edgespec frame)")
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version} not supported (this node speaks {PROTOCOL_VERSION})")
    try:
        kind = Kind(kind)
    except ValueError:
        raise WireError(f"unknown frame kind {kind}") from None
    if flags & ~KNOWN_FLAGS:
        raise WireError(f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:04x}")
    if reserved:
        raise WireError("reserved header field is not zero")
    if plen > max_payload:
        raise WireError(f"payload of {plen} bytes exceeds the maximum frame size ({max_payload})")
    return FrameHeader(kind, flags, rid, lap, seg, seq, plen)
