"""Frame header and payload codecs: round trips, quantization error bounds, strict refusal."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from edgespec import wire
from edgespec.tree.kvop import KvOp, KvOpCode
from edgespec.wire import (
    HEADER_SIZE,
    Encoding,
    FieldTag,
    Flag,
    FrameHeader,
    Kind,
    Message,
    WireError,
    decode_header,
    decode_payload,
    encode_frame,
    hidden_message,
    seq_lists,
    seq_matrix,
    tokens_message,
)


def roundtrip(msg: Message) -> Message:
    header, chunks = encode_frame(msg, seq=7)
    raw = header.pack()
    assert len(raw) == HEADER_SIZE
    back_header = decode_header(raw)
    assert back_header == header
    return decode_payload(back_header, b"".join(bytes(c) for c in chunks))


def test_tokens_roundtrip_keeps_ids_positions_seq_ids_parents() -> None:
    seqs = seq_matrix([[0, 1, 2], [1], [2], [2]], n_seq=11)
    msg = tokens_message([151935, 7, 0, 42], [10, 11, 11, 12], seqs, [-1, 0, 0, 2], lap_id=9, segment_id=3, flags=int(Flag.FINAL_SEGMENT), meta={"t": 1})
    back = roundtrip(msg)
    assert back.kind == Kind.TOKENS and back.lap_id == 9 and back.segment_id == 3
    assert back.flags == Flag.FINAL_SEGMENT
    np.testing.assert_array_equal(back[FieldTag.TOKENS], [151935, 7, 0, 42])
    np.testing.assert_array_equal(back[FieldTag.POSITIONS], [10, 11, 11, 12])
    np.testing.assert_array_equal(back[FieldTag.PARENTS], [-1, 0, 0, 2])
    assert back[FieldTag.SEQ_IDS].shape == (4, 11)
    assert seq_lists(back[FieldTag.SEQ_IDS]) == [[0, 1, 2], [1], [2], [2]]
    assert back.meta == {"t": 1}


@pytest.mark.parametrize("n_embd", [896, 1536, 70])
def test_hidden_encodings_and_their_error(n_embd: int) -> None:
    rng = np.random.default_rng(0)
    h = rng.standard_normal((5, n_embd)).astype(np.float32) * 3
    h[:, 3] = 900.0  # residual streams have a few huge channels
    pos, seqs = np.arange(5), seq_matrix([[0]] * 5)
    exact = roundtrip(hidden_message(h, pos, seqs, encoding="f32"))[FieldTag.HIDDEN]
    np.testing.assert_array_equal(exact, h)
    half = roundtrip(hidden_message(h, pos, seqs, encoding="f16"))[FieldTag.HIDDEN]
    assert half.dtype == np.float32
    np.testing.assert_allclose(half, h, rtol=2**-11, atol=0)
    q8msg = roundtrip(hidden_message(h, pos, seqs, encoding="q8"))
    assert q8msg.hidden_encoding == Encoding.Q8
    q = q8msg[FieldTag.HIDDEN]
    assert q.shape == h.shape
    # Error bound: half a quantization step of the block (scale = amax/127, scale is f16).
    blocks = -(-n_embd // wire.Q8_BLOCK)
    padded = np.zeros((5, blocks * wire.Q8_BLOCK), np.float32)
    padded[:, :n_embd] = h
    step = np.abs(padded.reshape(5, blocks, -1)).max(axis=2) / 127 * (1 + 2**-10)
    bound = np.repeat(step, wire.Q8_BLOCK, axis=1)[:, :n_embd] * 0.5 + 1e-6
    assert np.all(np.abs(q - h) <= bound)
    assert np.abs(q - h).max() > 0  # it really is lossy


def test_q8_is_smaller_than_f16() -> None:
    h = np.ones((1, 896), np.float32)
    size = {e: len(wire.payload_bytes(hidden_message(h, [0], seq_matrix([[0]]), encoding=e))) for e in ("f32", "f16", "q8")}
    # 896 values: f32 3584 B, f16 1792 B, q8 28 blocks x 34 B = 952 B (+ the small fields).
    assert size["f32"] - size["f16"] == 1792
    assert size["f16"] - size["q8"] == 1792 - 952


def test_f16_overflow_is_refused_not_sent_as_inf() -> None:
    h = np.full((1, 8), 1e6, np.float32)
    with pytest.raises(WireError, match="float16"):
        encode_frame(hidden_message(h, [0], seq_matrix([[0]]), encoding="f16"))
    back = roundtrip(hidden_message(h, [0], seq_matrix([[0]]), encoding="f32"))
    assert back[FieldTag.HIDDEN][0, 0] == 1e6


def test_kv_ops_commit_prune_result_control_roundtrip() -> None:
    ops = [KvOp(KvOpCode.CP, 3, 10, 14, 0), KvOp(KvOpCode.KEEP, 0), KvOp(KvOpCode.RM, 2, 12, -1), KvOp(KvOpCode.ADD, 1, 5, 9, -2)]
    back = roundtrip(Message(Kind.KV_OPS, {FieldTag.KV_OPS: ops}))
    assert wire.kv_ops_list(back[FieldTag.KV_OPS]) == ops
    commit = roundtrip(Message(Kind.COMMIT, {FieldTag.ACCEPTED: [5, 6, 7], FieldTag.NODES: [0, 2, 5], FieldTag.KV_OPS: ops[:2]}, lap_id=4))
    np.testing.assert_array_equal(commit[FieldTag.ACCEPTED], [5, 6, 7])
    prune = roundtrip(Message(Kind.PRUNE, {FieldTag.NODES: [0, 1, 4], FieldTag.TOKENS: [99]}))
    np.testing.assert_array_equal(prune[FieldTag.NODES], [0, 1, 4])
    result = roundtrip(Message(Kind.RESULT, {FieldTag.ACCEPTED: [1, 2], FieldTag.META: {"bonus": 2}}))
    assert result.meta == {"bonus": 2}
    ctl = roundtrip(wire.control_message("load", request_id=12, blob=b"\x00\x01chunk", model="ab12", layers=[0, 12]))
    assert ctl.meta == {"op": "load", "model": "ab12", "layers": [0, 12]} and ctl.request_id == 12
    assert bytes(ctl[FieldTag.BLOB]) == b"\x00\x01chunk"
    assert ctl.flags & Flag.NEEDS_REPLY


@pytest.mark.parametrize(
    "msg, match",
    [
        (Message(Kind.TOKENS, {FieldTag.TOKENS: [1], FieldTag.POSITIONS: [0]}), "lacks"),
        (Message(Kind.RESULT, {FieldTag.ACCEPTED: [1], FieldTag.HIDDEN: np.ones((1, 2), np.float32)}), "may not carry"),
        (tokens_message([1, 2], [0], seq_matrix([[0], [0]])), "disagree"),
        (tokens_message([-1], [0], seq_matrix([[0]])), "negative"),
        (tokens_message([1, 2], [0, 1], seq_matrix([[0], [0]]), [-1, 1]), "PARENTS"),
        (tokens_message([1], [0], np.zeros((1, 3), bool)), "at least one sequence"),
        (tokens_message([2**31], [0], seq_matrix([[0]])), "int32"),
        (tokens_message(np.array([1.5]), [0], seq_matrix([[0]])), "integer"),
        (Message(Kind.KV_OPS, {FieldTag.KV_OPS: [(9, 0, 0, 0, 0)]}), "unknown operation"),
        (Message(Kind.KV_OPS, {FieldTag.KV_OPS: [(1, 0, 5, 2, 0)]}), "bad arguments"),
        (Message(Kind.CONTROL, {FieldTag.META: ["op"]}), "mapping"),
        (Message(Kind.CONTROL, {FieldTag.META: {"x": float("nan")}}), "JSON"),
        (Message(Kind.CLOSE, flags=0x80), "flag"),
    ],
)
def test_encoder_refuses_bad_messages(msg: Message, match: str) -> None:
    with pytest.raises(WireError, match=match):
        encode_frame(msg)


def _good_frame() -> tuple[bytes, bytes]:
    header, chunks = encode_frame(tokens_message([1, 2], [0, 1], seq_matrix([[0], [0]])))
    return header.pack(), b"".join(bytes(c) for c in chunks)


def test_header_validation() -> None:
    hb, payload = _good_frame()
    decode_header(hb)
    with pytest.raises(WireError, match="magic"):
        decode_header(b"XX" + hb[2:])
    with pytest.raises(WireError, match="protocol version"):
        decode_header(hb[:2] + bytes([99]) + hb[3:])
    with pytest.raises(WireError, match="kind"):
        decode_header(hb[:3] + bytes([200]) + hb[4:])
    with pytest.raises(WireError, match="flag"):
        decode_header(hb[:4] + struct.pack("<H", 0x100) + hb[6:])
    with pytest.raises(WireError, match="reserved"):
        decode_header(hb[:6] + b"\x01\x00" + hb[8:])
    with pytest.raises(WireError, match="maximum frame size"):
        decode_header(hb, max_payload=len(payload) - 1)
    with pytest.raises(WireError, match="32 bytes"):
        decode_header(hb[:-1])


def test_payload_corruptions_are_refused() -> None:
    hb, payload = _good_frame()
    header = decode_header(hb)
    decode_payload(header, payload)

    def bad(p: bytes, match: str) -> None:
        with pytest.raises(WireError, match=match):
            decode_payload(header._replace(payload_len=len(p)), p)

    bad(payload[:-4], "exceed|truncated|lacks")
    bad(payload + b"\0", "truncated")
    bad(bytes([77]) + payload[1:], "unknown field tag")
    bad(payload[:1] + bytes([99]) + payload[2:], "unknown encoding")
    bad(payload[:1] + bytes([Encoding.F32]) + payload[2:], "not allowed")
    bad(payload[:2] + bytes([3]) + payload[3:], "dims")
    bad(payload[:4] + struct.pack("<I", 1 << 30) + payload[8:], "exceed")
    # Duplicate a whole field: TOKENS appears twice.
    first_len = 4 + 4 + 8
    bad(payload[:first_len] + payload, "twice")
    with pytest.raises(WireError, match="header says"):
        decode_payload(header, payload + b"\0\0\0\0")


def test_fuzzed_payloads_raise_only_wire_error() -> None:
    """Random byte flips and truncations never crash the decoder with anything but WireError."""
    rng = np.random.default_rng(1)
    msg = hidden_message(rng.standard_normal((3, 64)).astype(np.float32), [0, 1, 2], seq_matrix([[0], [0, 1], [1]]), encoding="q8", tokens=[1, 2, 3], parents=[-1, 0, 0], meta={"a": 1})
    header, chunks = encode_frame(msg)
    payload = bytearray(b"".join(bytes(c) for c in chunks))
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(2000):
        p = bytearray(payload)
        for _ in range(int(rng.integers(1, 4))):
            p[int(rng.integers(len(p)))] = int(rng.integers(256))
        if rng.random() < 0.2:
            p = p[: int(rng.integers(len(p)))]
        try:
            decode_payload(header._replace(payload_len=len(p)), p)
            outcomes["ok"] += 1
        except WireError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 500 and outcomes["ok"] > 0


def test_header_roundtrip_keeps_every_field() -> None:
    h = FrameHeader(Kind.HIDDEN, 3, 2**32 - 1, 123, 7, 2**64 - 1, 99)
    assert decode_header(h.pack()) == h


def test_seq_matrix_rejects_ids_outside_width() -> None:
    with pytest.raises(WireError):
        seq_matrix([[0, 5]], n_seq=4)
    with pytest.raises(WireError):
        seq_matrix([[-1]])


def _meta_payload(raw: bytes) -> bytes:
    n = len(raw)
    return bytes([FieldTag.META, wire.Encoding.JSON, 1, 0]) + struct.pack("<I", n) + raw + b"\0" * (-n % 4)


def test_deeply_nested_json_is_a_wire_error_not_a_recursion_error() -> None:
    for body in (b"[" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000):
        payload = _meta_payload(body)
        with pytest.raises(WireError, match="nested deeper"):
            wire.decode_payload(FrameHeader(Kind.CONTROL, 0, 0, 0, 0, 0, len(payload)), payload)
    # Brackets inside strings do not count, and ordinary nesting decodes.
    ok = b'{"op":"load","s":"' + b"[" * 500 + b'","links":{"1":{"host":"a","ports":[[1,2],[3]]}}}'
    payload = _meta_payload(ok)
    msg = wire.decode_payload(FrameHeader(Kind.CONTROL, 0, 0, 0, 0, 0, len(payload)), payload)
    assert msg.meta["links"]["1"]["ports"] == [[1, 2], [3]] and len(msg.meta["s"]) == 500
