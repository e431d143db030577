"""The data path's frames through the C++ core (``edgespec.wire.frames.send_batch`` /
``frame_batch`` and the codec's RESULT path, csrc/frames.cpp) against the Python codec, which defines the protocol
(docs/design.md 5.1, 8.3): the same bytes for every batch the fast path builds, the same batch
for every payload it reads, and every payload it does not take (another encoding, a fault)
left to the codec, which takes it or names the fault."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec._native import core as _core
from edgespec.batch import Batch, SamplerRef, SeqIds
from edgespec.sampling import SamplerSettings
from edgespec.tree.kvop import KvOp, KvOpCode
from edgespec.wire import FieldTag, Kind, WireError
from edgespec.wire.codec import Encoding, encode_frame
from edgespec.wire.frames import _fast_payload, batch_message, frame_batch, message_batch
from edgespec.wire.transport import Frame


def _batch(rng: np.random.Generator, n: int, k: int) -> Batch:
    ids = [sorted(rng.choice(12, size=int(rng.integers(1, k + 1)), replace=False).tolist())
           for _ in range(n)]
    ops = ([KvOp(KvOpCode.RESTORE, 4, -1, -1, 0), KvOp(KvOpCode.CP, 1, 0, 5, 3),
            KvOp(KvOpCode.RM, 2, -1, -1, 0), KvOp(KvOpCode.KEEP, 0, -1, -1, 0)]
           if rng.random() < 0.5 else [])
    return Batch(rng.integers(0, 150_000, n), np.arange(10, 10 + n), SeqIds.from_lists(ids),
                 rng.permutation(n), rng.random(n) < 0.5, lap=int(rng.integers(0, 2**31)),
                 segment=int(rng.integers(0, 9)), pre_ops=ops,
                 sampling=SamplerRef(1 + int(rng.integers(0, 2**40)), SamplerSettings(
                     (("temperature", 0.7), ("top_k", 40), ("seed", int(rng.integers(0, 2**40)))))))


def _codec_bytes(b: Batch, hidden, stage: int, timing) -> tuple:
    msg = batch_message(b, hidden, "f32", stage=stage)
    if timing is not None:
        msg.meta["timing"] = timing
    header, chunks = encode_frame(msg)
    return header, b"".join(bytes(c) for c in chunks)


def _same_batch(x: Batch, y: Batch) -> None:
    for name in ("tokens", "pos", "nodes", "want"):
        assert np.array_equal(getattr(x, name), getattr(y, name)), name
    assert x.seq_ids == y.seq_ids and x.pre_ops == y.pre_ops and x.sampling == y.sampling
    assert (x.lap, x.segment) == (y.lap, y.segment)


def test_core_numbers_are_the_wire_modules():
    # csrc/frames.cpp spells the kinds, tags, encodings and KV codes as numbers (4 is a
    # reserved tag there, absent here).
    assert (Kind.TOKENS, Kind.HIDDEN, Kind.RESULT) == (32, 33, 34)
    assert [FieldTag[t] for t in ("TOKENS", "POSITIONS", "SEQ_IDS", "HIDDEN",
                                  "KV_OPS", "TARGETS", "NODES", "META")] == [1, 2, 3, 5, 6, 7, 8, 9]
    assert 4 not in {int(t) for t in FieldTag}
    assert (Encoding.I32, Encoding.F32, Encoding.BITS, Encoding.JSON) == (1, 2, 5, 6)
    assert (KvOpCode.RM, KvOpCode.CP, KvOpCode.KEEP, KvOpCode.ADD) == (1, 2, 3, 4)
    assert (KvOpCode.PARK, KvOpCode.RESTORE) == (5, 6)


@pytest.mark.parametrize("with_hidden", [False, True])
def test_fast_path_writes_and_reads_what_the_codec_does(with_hidden):
    rng = np.random.default_rng(7 + with_hidden)
    for trial in range(150):
        n = int(rng.integers(1, 40))
        b = _batch(rng, n, int(rng.integers(1, 4)))
        hidden = rng.standard_normal((n, 24)).astype(np.float32) if with_hidden else None
        timing = [[0, 1_764_600_000_123_456 + trial, 1, 2, 3]] if trial % 2 else None
        header, ref = _codec_bytes(b, hidden, 3, timing)
        assert _fast_payload(b, hidden, "f32", 3, timing) == ref
        fast = frame_batch(Frame(header, memoryview(bytearray(ref))))
        slow_msg = Frame(header, memoryview(bytearray(ref))).decode()
        slow = message_batch(slow_msg)
        _same_batch(fast[0], slow[0])
        assert fast[2] == slow[2] == 3 and fast[3] == slow_msg.meta
        if with_hidden:
            assert fast[1].dtype == np.float32 and np.array_equal(fast[1], slow[1])
        else:
            assert fast[1] is None and slow[1] is None


def test_what_the_fast_path_does_not_take_goes_to_the_codec():
    rng = np.random.default_rng(1)
    b = _batch(rng, 3, 2)
    hidden = rng.standard_normal((3, 8)).astype(np.float32)
    assert _fast_payload(b, hidden, "f16", 1, None) is None
    assert _fast_payload(b, hidden.astype(np.float64), "f32", 1, None) is None
    bad = Batch(np.array([1, 2]), np.array([0, -1]), SeqIds.single(2), np.arange(2), np.ones(2, bool))
    assert _fast_payload(bad, None, "f32", 0, None) is None
    with pytest.raises(WireError, match="POSITIONS: negative"):
        encode_frame(batch_message(bad))
    # A restore of part of a sequence: both refuse it.
    bad = Batch(np.array([1]), np.array([0]), SeqIds.single(1), np.arange(1), np.ones(1, bool),
                pre_ops=[KvOp(KvOpCode.RESTORE, 4, 0, -1, 0)])
    assert _fast_payload(bad, None, "f32", 0, None) is None
    with pytest.raises(WireError, match="whole sequence"):
        encode_frame(batch_message(bad))
    # An f16 frame is not the fast path's: the codec reads it, to the same batch.
    msg = batch_message(b, hidden, "f16", stage=1)
    header, chunks = encode_frame(msg)
    payload = b"".join(bytes(c) for c in chunks)
    assert _core.parse_batch_payload(payload, int(Kind.HIDDEN)) is None
    got = frame_batch(Frame(header, memoryview(bytearray(payload))))
    assert got[1].dtype == np.float32 and got[1].shape == (3, 8)


def test_corrupted_payloads_are_refused_exactly_as_the_codec_refuses_them():
    """Flip bytes of real frames: frame_batch (C++ first) and the codec alone either both read
    the same batch or both refuse the frame; the C++ reader both takes and leaves some."""
    rng = np.random.default_rng(3)
    core_took = core_left = refused = 0
    errors = (WireError, ValueError, KeyError, TypeError)
    for trial in range(400):
        n = int(rng.integers(1, 6))
        b = _batch(rng, n, 3)
        hidden = rng.standard_normal((n, 4)).astype(np.float32) if trial % 2 else None
        header, ref = _codec_bytes(b, hidden, 1, None)
        raw = bytearray(ref)
        for _ in range(int(rng.integers(1, 4))):
            raw[int(rng.integers(0, len(raw)))] = int(rng.integers(0, 256))
        if _core.parse_batch_payload(bytes(raw), int(header.kind)) is None:
            core_left += 1
        else:
            core_took += 1
        try:
            slow = message_batch(Frame(header, memoryview(bytearray(raw))).decode())
        except errors:
            slow = None
        try:
            fast = frame_batch(Frame(header, memoryview(bytearray(raw))))
        except errors:
            fast = None
        assert (fast is None) == (slow is None), f"trial {trial}: one path took the frame"
        if fast is None:
            refused += 1
        else:
            _same_batch(fast[0], slow[0])
    assert core_took and core_left and refused


def _python_codec(monkeypatch) -> None:
    """The codec with its RESULT fast path switched off (the reference)."""
    import types

    from edgespec.wire import codec

    monkeypatch.setattr(codec, "_core", types.SimpleNamespace(
        build_result_payload=lambda *a: None, parse_result_payload=lambda p: None))


def _result_frames(rng: np.random.Generator, count: int) -> list:
    from edgespec.wire.frames import result_message

    out = []
    for trial in range(count):
        n = int(rng.integers(1, 12))
        b = _batch(rng, n, 2)
        k = int(np.count_nonzero(b.want))
        msg = result_message(b, rng.integers(0, 150_000, k))
        msg.fields[FieldTag.META] = {"timing": [[0, 1_764_600_000_000_000 + trial, 2, 3, 4]]}
        out.append(msg)
    return out


def test_result_frames_are_the_codecs(monkeypatch):
    from edgespec.wire.codec import decode_payload

    msgs = _result_frames(np.random.default_rng(5), 100)
    fast = [encode_frame(m) for m in msgs]
    read = [decode_payload(h, b"".join(bytes(c) for c in ch)) for h, ch in fast]
    _python_codec(monkeypatch)
    for msg, (h, ch), got in zip(msgs, fast, read, strict=True):
        h2, ch2 = encode_frame(msg)
        raw = b"".join(bytes(c) for c in ch)
        assert h2 == h and raw == b"".join(bytes(c) for c in ch2)
        ref = decode_payload(h, raw)
        assert got.fields.keys() == ref.fields.keys() and got.meta == ref.meta
        for tag in (FieldTag.TARGETS, FieldTag.NODES):
            assert np.array_equal(got.fields[tag], ref.fields[tag])


def test_corrupted_results_are_refused_exactly_as_the_codec_refuses_them(monkeypatch):
    from edgespec.wire.codec import decode_payload

    rng = np.random.default_rng(11)
    cases = []
    for msg in _result_frames(rng, 300):
        h, ch = encode_frame(msg)
        raw = bytearray(b"".join(bytes(c) for c in ch))
        for _ in range(int(rng.integers(1, 3))):
            raw[int(rng.integers(0, len(raw)))] = int(rng.integers(0, 256))
        cases.append((h, bytes(raw)))

    def read_all() -> list:
        out = []
        for h, raw in cases:
            try:
                m = decode_payload(h, raw)
                out.append((sorted(m.fields), m.meta, [np.asarray(m.fields[t]).tolist() for t in
                                                      (FieldTag.TARGETS, FieldTag.NODES)
                                                      if t in m.fields]))
            except WireError:
                out.append(None)
        return out

    core_took = sum(_core.parse_result_payload(raw) is not None for _, raw in cases)
    fast = read_all()
    _python_codec(monkeypatch)
    assert fast == read_all()
    assert 0 < core_took < len(cases) and None in fast
