"""Seq ids travel from the engine to a stage as one ``SeqIds`` (docs/design.md 5.1): the frames
it makes are byte for byte those the per-row lists made, it round-trips exactly, rows select as
lists did, and the stage runtime refuses the same bad ids it refused in list form."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.batch import Batch, SeqIds
from edgespec.node.runtime import InputError, normalize_seq_ids
from edgespec.tree import core
from edgespec.wire import (
    WireError,
    decode_header,
    decode_payload,
    encode_frame,
    seq_matrix,
    tokens_message,
)
from edgespec.wire.codec import FieldTag, Message
from edgespec.wire.frames import batch_message, message_batch


def old_seq_matrix(seq_ids: list[list[int]]) -> np.ndarray:
    """The lists -> wire conversion as it was before SeqIds (the reference)."""
    top = max((max(s) for s in seq_ids if len(s)), default=-1)
    m = np.zeros((len(seq_ids), max(top + 1, 1)), dtype=bool)
    for i, s in enumerate(seq_ids):
        m[i, list(s)] = True
    return m


def old_seq_lists(matrix: np.ndarray) -> list[list[int]]:
    """The wire -> lists conversion as it was before SeqIds (the reference)."""
    return [np.flatnonzero(row).tolist() for row in np.asarray(matrix, dtype=bool)]


def frame_bytes(msg: Message) -> bytes:
    header, chunks = encode_frame(msg, seq=3)
    return header.pack() + b"".join(bytes(c) for c in chunks)


def engine_layout(seed: int, n: int = 63) -> core.Layout:
    """A real layout from the C++ core, as the engine gets it (rows in several sequences)."""
    rng = np.random.default_rng(seed)
    t = core.TokenTree(1, 10, 255)
    for _ in range(n):
        t.add(int(rng.integers(0, t.size)), int(rng.integers(0, 1000)), float(-rng.random() * 3))
    t.order()
    return t.layout()


def cases() -> list[list[list[int]]]:
    out = [[[0]], [[0]] * 5, [[0, 1, 2], [1], [2], [2]], [[3, 1], [7], [0, 7, 2]]]
    for seed in range(4):
        lay = engine_layout(seed)
        out.append([lay.seq_ids[i, : lay.n_seq[i]].tolist() for i in range(len(lay.tokens))])
    return out


@pytest.mark.parametrize("rows", cases())
@pytest.mark.parametrize("hidden", [False, True])
def test_frames_are_the_bytes_the_lists_made_and_round_trip(rows, hidden) -> None:
    n = len(rows)
    seq = SeqIds.from_lists(rows)
    batch = Batch(np.arange(n) + 5, np.arange(n) + 9, seq, np.arange(n), np.arange(n) % 2 == 0,
                  lap=4, segment=2)
    h = np.ones((n, 8), np.float32) if hidden else None
    new = batch_message(batch, h)
    ref_fields = {**new.fields, FieldTag.SEQ_IDS: old_seq_matrix(rows)}
    ref = Message(new.kind, ref_fields, lap_id=new.lap_id, segment_id=new.segment_id,
                  hidden_encoding=new.hidden_encoding)
    raw = frame_bytes(new)
    assert raw == frame_bytes(ref)
    # The lists form of the same batch makes the same frame too.
    assert raw == frame_bytes(batch_message(Batch(batch.tokens, batch.pos, rows, batch.nodes,
                                                  batch.want, lap=4, segment=2), h))
    header = decode_header(raw[:32])
    back, _, _ = message_batch(decode_payload(header, raw[32:]))
    assert back.seq_ids.tolist() == old_seq_lists(old_seq_matrix(rows))
    assert back.seq_ids.tolist() == [sorted(r) for r in rows]
    assert frame_bytes(batch_message(back, h)) == raw


def test_engine_layout_travels_without_lists() -> None:
    lay = engine_layout(7)
    seq = SeqIds(lay.seq_ids, lay.n_seq)
    assert seq.tolist() == [lay.seq_ids[i, : lay.n_seq[i]].tolist() for i in range(len(lay.n_seq))]
    assert np.array_equal(seq.to_bool_matrix(), old_seq_matrix(seq.tolist()))
    assert SeqIds.from_bool_matrix(seq.to_bool_matrix()).tolist() == [sorted(r) for r in seq.tolist()]


def test_select_keeps_the_rows_lists_would() -> None:
    rows = [[0, 1, 2], [1], [2], [0, 2], [5]]
    batch = Batch(np.arange(5), np.arange(5), rows, np.arange(5), np.ones(5, bool))
    keep = np.array([True, False, True, True, False])
    got = batch.select(keep).seq_ids
    assert got.tolist() == [[0, 1, 2], [2], [0, 2]]
    assert got.ids.shape == (3, 3)  # the widest surviving row sets k
    assert batch.select(np.array([False, True, False, False, True])).seq_ids.ids.shape == (2, 1)


def test_wire_refuses_ids_it_cannot_carry() -> None:
    with pytest.raises(WireError, match="does not fit"):
        seq_matrix(SeqIds.from_lists([[0, 5]]), n_seq=4)
    with pytest.raises(WireError, match=">= 0"):
        seq_matrix(SeqIds.from_lists([[-1]]))
    assert seq_matrix(SeqIds.from_lists([[1], []]), n_seq=3).tolist() == [[False, True, False],
                                                                           [False, False, False]]


def test_runtime_takes_seq_ids_as_they_are_and_keeps_its_checks() -> None:
    seq = SeqIds.from_lists([[0, 3], [1], [3, 2, 0]])
    mat, counts = normalize_seq_ids(seq, 3, 4)
    assert np.shares_memory(mat, seq.ids) and np.shares_memory(counts, seq.counts)
    lm, lc = normalize_seq_ids([[0, 3], [1], [3, 2, 0]], 3, 4)
    used = np.arange(3)[None, :] < counts[:, None]
    assert np.array_equal(counts, lc) and np.array_equal(mat[used], lm[used])
    bad = {
        "outside 0..3": [[0], [4]],
        "outside": [[-1], [0]],
        "twice": [[0], [2, 1, 2]],
        "at least one": [[0], []],
        "n_seq_max is 4": [[0, 1, 2, 3, 0], [0]],
    }
    for msg, rows in bad.items():
        for form in (rows, SeqIds.from_lists(rows)):
            with pytest.raises(InputError, match=msg):
                normalize_seq_ids(form, 2, 4)
    with pytest.raises(InputError, match="for 1 tokens, batch has 2"):
        normalize_seq_ids(SeqIds.from_lists([[0]]), 2, 4)


def test_single_is_every_row_in_one_sequence() -> None:
    assert SeqIds.single(3).tolist() == [[0], [0], [0]]
    assert SeqIds.single(2, 5) == SeqIds.from_lists([[5], [5]])
    assert seq_matrix(SeqIds.single(2, 2)).tolist() == old_seq_matrix([[2], [2]]).tolist()


def _received(matrix: np.ndarray) -> Batch:
    """The batch a stage makes of a TOKENS frame carrying ``matrix`` as SEQ_IDS."""
    n = len(matrix)
    header, chunks = encode_frame(tokens_message(np.arange(n), np.arange(n), matrix))
    return message_batch(decode_payload(header, b"".join(bytes(c) for c in chunks)))[0]


@pytest.mark.parametrize("rows", [[[0]] * 3, [[2], [2]], [[0, 1], [1], [0, 9]], [[1, 3], [3]]])
def test_a_forwarded_batch_sends_the_matrix_it_came_with(rows) -> None:
    batch = _received(old_seq_matrix(rows))
    m = batch.seq_ids.to_bool_matrix()
    assert m is batch.seq_ids.to_bool_matrix() and not m.flags.writeable
    assert m.tolist() == old_seq_matrix(rows).tolist()
    assert batch.seq_ids.to_bool_matrix(m.shape[1]) is m
    wider = batch.seq_ids.to_bool_matrix(m.shape[1] + 2)  # another width: made afresh
    assert wider.shape[1] == m.shape[1] + 2 and wider[:, : m.shape[1]].tolist() == m.tolist()
    # A pruned batch is new SeqIds: its matrix is made from its own rows.
    kept = batch.select(np.array([True] + [False] * (len(rows) - 1))).seq_ids
    assert kept._matrix is None and kept.to_bool_matrix().tolist() == old_seq_matrix(rows[:1]).tolist()


def test_a_matrix_wider_than_its_ids_is_not_remembered() -> None:
    """A peer may send trailing empty columns; the frame sent on is (largest id + 1) wide, as
    before, so the bytes a stage sends never depend on how its input was padded."""
    m = np.zeros((2, 5), bool)
    m[0, 1] = m[1, 0] = m[1, 2] = True
    batch = _received(m)
    assert batch.seq_ids._matrix is None
    assert batch.seq_ids.to_bool_matrix().shape == (2, 3)


def test_remembering_a_writable_matrix_keeps_a_copy() -> None:
    m = np.array([[True], [True]])
    seq = SeqIds.from_bool_matrix(m, remember=True)
    m[0, 0] = False  # the caller's array changes; the SeqIds does not
    assert seq.to_bool_matrix().tolist() == [[True], [True]] and seq.tolist() == [[0], [0]]
    assert SeqIds.from_bool_matrix(m)._matrix is None  # remembers only when asked
