"""Parking a sequence's KV in host memory and restoring it (edgespec.llm.kv_park,
docs/design.md 5.8) on a real llama.cpp context: the cells are freed, come back with the same
attention results, fit a fragmented cache, and a cache without room gives a clear error that
leaves the runtime and the other sequences as they were."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stage_fixtures import tiny_dir, tiny_qwen2  # noqa: F401 - fixtures

from edgespec.node.runtime import KVCacheFullError, StageRuntime
from edgespec.node.worker import apply_kv_ops
from edgespec.tree.kvop import KvOp, KvOpCode

N = 150  # positions of the parked conversation


def _toks(n: int, off: int = 0) -> np.ndarray:
    return (np.arange(n, dtype=np.int32) * 7 + off) % 240 + 3


def _next_logits(rt: StageRuntime, seq: int, pos: int) -> np.ndarray:
    """Logits of one more token on ``seq`` at ``pos``, rolled back after."""
    out = np.array(rt.forward(np.array([11], np.int32), pos, seq_ids=[[seq]], want_rows=[0]))
    rt.kv_seq_rm(seq, pos, -1)
    return out


@pytest.fixture()
def rt(tiny_qwen2: Path):  # noqa: F811
    with StageRuntime(tiny_qwen2, n_ctx=512, n_batch=512, n_threads=1, n_seq_max=8) as r:
        yield r


def test_park_frees_the_cells_and_restore_brings_the_same_attention_back(rt) -> None:
    rt.forward(_toks(N), 0, seq_ids=[[0]] * N)
    before = _next_logits(rt, 0, N)
    assert rt.kv_seq_park(0) > 0
    assert rt.n_past(0) == 0 and rt.parked_bytes > 0
    # The cells are free: another sequence can fill the whole cache meanwhile.
    rt.forward(_toks(rt.n_ctx - 8, 5), 0, seq_ids=[[2]] * (rt.n_ctx - 8))
    with pytest.raises(KVCacheFullError, match="no room"):  # and then there is none left
        rt.kv_seq_restore(0)
    assert rt.n_past(0) == 0 and rt.parked_bytes == 0
    assert rt.n_past(2) == rt.n_ctx - 8  # the other sequence is untouched

    rt.kv_seq_rm(2)
    rt.forward(_toks(N), 0, seq_ids=[[0]] * N)
    rt.kv_seq_park(0)
    assert rt.kv_seq_restore(0) is True
    assert (rt.seq_pos_min(0), rt.n_past(0)) == (0, N)
    assert np.abs(_next_logits(rt, 0, N) - before).max() <= 1e-4
    assert rt.kv_seq_restore(0) is False  # nothing parked any more: a no-op
    assert rt.n_past(0) == N
    assert rt.kv_seq_park(5) == 0 and rt.kv_seq_restore(5) is False  # an empty sequence


def test_restore_fits_a_fragmented_cache(rt) -> None:
    rt.forward(_toks(N), 0, seq_ids=[[0]] * N)
    before = _next_logits(rt, 0, N)
    rt.kv_seq_park(0)
    # Seqs 2 and 3 take every cell in turn; then seq 3 goes: every other cell is free, no
    # two free cells are neighbours.
    half = rt.n_ctx // 2
    rt.forward(_toks(2 * half), np.repeat(np.arange(half), 2), seq_ids=[[2], [3]] * half)
    rt.kv_seq_rm(3)
    assert rt.kv_seq_restore(0) is True
    assert rt.n_past(0) == N and rt.n_past(2) == half
    assert np.abs(_next_logits(rt, 0, N) - before).max() <= 1e-4


def test_clearing_a_sequence_drops_its_parked_copy(rt) -> None:
    for seq in (0, 2, 4):
        rt.forward(_toks(20, seq), 0, seq_ids=[[seq]] * 20)
        rt.kv_seq_park(seq)
    rt.kv_seq_rm(2)  # the whole sequence: its parked copy too
    assert rt.kv_seq_restore(2) is False and rt.n_past(2) == 0
    rt.kv_seq_rm(4, 5, -1)  # part of it: the parked copy stays whole
    rt.kv_seq_keep(4)  # every other sequence goes, parked ones too
    assert rt.kv_seq_restore(0) is False
    assert rt.kv_seq_restore(4) is True and rt.n_past(4) == 20


def test_park_and_restore_as_kv_ops(rt) -> None:
    rt.forward(_toks(N), 0, seq_ids=[[0]] * N)
    rt.apply_plan([KvOp(KvOpCode.PARK, 0)])
    assert rt.n_past(0) == 0
    apply_kv_ops(rt, [KvOp(KvOpCode.RESTORE, 0)])  # a node's worker
    assert rt.n_past(0) == N
    apply_kv_ops(rt, [KvOp(KvOpCode.PARK, 0)])
    rt.apply_plan([KvOp(KvOpCode.RESTORE, 0), KvOp(KvOpCode.RM, 0, 100, -1)])
    assert rt.n_past(0) == 100
    rt.kv_seq_park(0)
    assert rt.parked_bytes > 0
    rt.reset()  # an empty cache parks nothing either
    assert rt.parked_bytes == 0 and rt.kv_seq_restore(0) is False
