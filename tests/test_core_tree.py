"""Unit tests of the C++ core: tree rules, seq pool, input errors, and KV plans replayed on a
simulated llama.cpp unified KV cache (cells with a position and a set of seq ids)."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.tree import core
from edgespec.tree.kvop import KvOpCode


class KVSim:
    """llama.cpp's unified KV cache as far as masks go: cells (pos, seq set)."""

    def __init__(self, prefix_len: int) -> None:
        self.cells: list[tuple[int, set[int], tuple]] = [
            (p, {0}, ("prefix", p)) for p in range(prefix_len)
        ]

    def apply(self, ops: np.ndarray) -> None:
        for code, a, p0, p1, b in np.asarray(ops).reshape(-1, 5).tolist():
            lo, hi = (p0 if p0 >= 0 else -(2**31)), (p1 if p1 >= 0 else 2**31)
            for pos, seqs, _ in self.cells:
                if code == KvOpCode.CP and a in seqs and lo <= pos < hi:
                    seqs.add(b)
                elif code == KvOpCode.RM and a in seqs and lo <= pos < hi:
                    seqs.discard(a)
                elif code == KvOpCode.KEEP:
                    seqs.intersection_update({a})
            self.cells = [c for c in self.cells if c[1]]

    def decode(self, lay: core.Layout, label) -> dict:
        """Adds the batch and returns, per row, what it attends to (first seq id and pos rule)."""
        for r in range(len(lay.tokens)):
            self.cells.append(
                (
                    int(lay.pos[r]),
                    set(lay.seq_ids[r, : lay.n_seq[r]].tolist()),
                    label(lay.start + r),
                )
            )
        seen = {}
        for r in range(len(lay.tokens)):
            s0, pos = int(lay.seq_ids[r, 0]), int(lay.pos[r])
            seen[lay.start + r] = sorted(c[2] for c in self.cells if s0 in c[1] and c[0] <= pos)
        return seen


def expected_view(tree: core.TokenTree, row: int, prefix_len: int) -> list:
    parents = tree.parents()
    chain = []
    while row >= 0:
        chain.append(("row", row))
        row = int(parents[row])
    return sorted([("prefix", p) for p in range(prefix_len)] + chain)


def random_tree(rng, root_pos, n=40, vocab=6, max_seqs=255):
    t = core.TokenTree(1, root_pos, max_seqs)
    for _ in range(n):
        t.add(int(rng.integers(0, t.size)), int(rng.integers(0, vocab)), float(-rng.random() * 3))
    return t


@pytest.mark.parametrize("seed", range(30))
def test_plans_keep_every_row_attending_to_exactly_its_path(seed):
    rng = np.random.default_rng(seed)
    prefix = 5
    t = random_tree(rng, prefix, max_seqs=int(rng.choice([3, 8, 255])))
    t.select(30)
    o = t.order()
    kv = KVSim(prefix)
    kv.apply(o.ops)
    label = lambda r: ("row", r)  # noqa: E731
    segs = t.segments(count=min(3, t.n_rows))
    targets = rng.integers(0, 6, size=t.n_rows).astype(np.int32)
    tokens, parents = t.structure()
    first_child = {}
    for r in range(1, t.n_rows):
        first_child.setdefault(int(parents[r]), int(tokens[r]))
    targets = np.array(
        [first_child.get(r, 9) if rng.random() < 0.8 else 9 for r in range(t.n_rows)], np.int32
    )
    ver = core.Verifier().start(t)
    d = None
    for k, s in enumerate(segs):
        alive = t.alive()
        rows = [r for r in range(s.start, s.stop) if alive[r]]
        if not rows:
            continue
        lay = t.layout(rows[0], rows[-1] + 1) if len(rows) == rows[-1] - rows[0] + 1 else None
        if lay is None:  # pruned rows inside: decode the surviving ones one by one
            for r in rows:
                for row, view in kv.decode(t.layout(r, r + 1), label).items():
                    assert view == expected_view(t, row, prefix)
        else:
            for row, view in kv.decode(lay, label).items():
                assert view == expected_view(t, row, prefix)
        d = ver.feed_targets(targets[rows], s.start, rows=np.asarray(rows, np.int32))
        if d.status == core.PENDING and k == 0:
            plan = t.prune(d)
            kv.apply(plan.ops)
            # Expansion under the pending node, sent as a further segment with its own ops.
            t.add(int(d.need_row), 5, -0.1)
            t.add(int(d.need_row), 4, -0.2)
            t.select(10)
            ox = t.order()
            kv.apply(ox.ops)
            if ox.stop > ox.start:
                ver.extend(*[a[ox.start : ox.stop] for a in t.structure()], ox.start)
                segs.append(t.layout(ox.start, ox.stop))
                targets = np.concatenate([targets, np.full(ox.stop - ox.start, 9, np.int32)])
    if not d.accepted:
        d = ver.feed_targets(np.zeros(0, np.int32), ver.decision.n_processed)
    assert d.accepted
    plan = t.commit(d)
    kv.apply(plan.ops)
    committed = sorted(c[2] for c in kv.cells)
    assert committed == sorted(
        [("prefix", p) for p in range(prefix)] + [("row", int(r)) for r in d.path]
    )
    assert all(c[1] == {0} for c in kv.cells)


def test_merge_keeps_best_logprob_and_moves_subtree_scores():
    t = core.TokenTree(7, 0)
    a = t.add(0, 3, -2.0)
    b = t.add(a, 4, -1.0)
    assert t.add(0, 3, -0.5) == a
    assert t.score(a) == -0.5 and t.score(b) == -1.5
    assert t.add(0, 3, -3.0) == a and t.score(a) == -0.5


def test_select_is_best_first_and_closed_under_parents():
    t = core.TokenTree(0, 0)
    a = t.add(0, 1, -0.1)
    t.add(a, 2, -0.1)  # score -0.2
    t.add(0, 3, -1.0)
    t.add(0, 4, -0.15)
    remap = t.select(2)
    assert remap.tolist() == [0, 1, -1, -1, 2]  # -0.1 and -0.15 beat -0.2 and -1.0
    assert t.tokens().tolist() == [0, 1, 4]
    t.add(1, 2, -0.1)
    t.add(0, 3, -1.0)
    t.order()
    assert t.tokens().tolist() == [0, 1, 4, 2, 3]  # rows: descending score, parents first


def test_leaf_pool_bound_and_reuse_after_prune():
    t = core.TokenTree(0, 10)
    t.add_children(0, np.arange(1, 300), np.full(299, -1.0))
    with pytest.raises(ValueError, match="seq ids"):
        t.order()
    t.select(1000)
    o = t.order()
    assert t.n_rows == 256 and t.n_free_seqs == 0 and len(o.ops) == 255
    assert sorted(t.seqs()[1:].tolist()) == list(range(1, 256))
    tokens, parents = t.structure()
    d = core.Verifier().start(t).feed_targets(np.array([int(tokens[200])], np.int32), 0)
    assert d.status == core.PENDING and d.need_row == 200
    s200 = int(t.seqs()[200])
    plan = t.prune(d)
    assert t.n_free_seqs == 254 and plan.survivors.tolist() == [0, 200]
    assert plan.remap[200] == 1 and (plan.remap[1:200] == -1).all()
    assert len(plan.ops) == 254 and (plan.ops[:, 0] == KvOpCode.RM).all()
    t.add_children(200, [5, 6], [-0.1, -0.2])
    ox = t.order()
    # The first new leaf inherits row 200's seq; the second gets the lowest free seq and a copy
    # of root..row 200 (positions < 10 + 1 + 1).
    free = sorted(set(range(1, 256)) - set(t.seqs().tolist()) | {int(t.seqs()[257])})
    assert int(t.seqs()[256]) == s200 and int(t.seqs()[257]) == free[0]
    assert ox.ops.tolist() == [[KvOpCode.CP, s200, -1, 12, free[0]]]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t: t.add(0, 1, 0.5), "log-prob"),
        (lambda t: t.add(0, -1, -0.5), "token"),
        (lambda t: t.add(9, 1, -0.5), "not a node"),
        (lambda t: t.add(0, 1, float("nan")), "log-prob"),
        (lambda t: t.select(-1), "budget"),
        (lambda t: t.segment_bounds(size=2, count=2, start=0, stop=1), "exactly one"),
        (lambda t: t.layout(0, 5), "outside"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(call, message):
    t = core.TokenTree(0, 0)
    t.order()
    with pytest.raises((ValueError, IndexError), match=message):
        call(t)


def test_verifier_input_errors():
    t = core.TokenTree(0, 0)
    t.add(0, 1, -0.1)
    t.order()
    v = core.Verifier().start(t)
    with pytest.raises(ValueError, match="float32"):
        v.feed(np.zeros((2, 4)), 0)
    with pytest.raises(ValueError, match="exceed"):
        v.feed(np.zeros((3, 4), np.float32), 0)
    with pytest.raises(ValueError, match="never fed"):
        v.feed(np.zeros((1, 4), np.float32), 0, rows=np.array([1], np.int32))
    with pytest.raises(ValueError, match="NaN"):
        core.Verifier(temperature=1.0).verify(t, np.full((2, 4), np.nan, np.float32))
    with pytest.raises(ValueError):
        core.Verifier(temperature=-1.0)
    with pytest.raises(ValueError, match="parents-first"):
        core.Verification(core.SamplerConfig(), 0, np.array([0, 1]), np.array([-1, 5]))


def test_argmax_rows_ties_nan_and_strided_views():
    x = np.random.default_rng(0).standard_normal((5, 1001)).astype(np.float32)
    x[0, 17] = x[0, 900] = 50.0
    x[1, :] = np.nan
    x[2, 3] = np.nan
    x[3, 1000] = 99.0  # in the scalar tail
    want = [17, 0, int(np.nanargmax(x[2])), 1000, int(np.argmax(x[4]))]
    assert core.argmax_rows(x).tolist() == want
    big = np.zeros((5, 2000), np.float32)
    big[:, :1001] = x
    big[:, 1001:] = -1e9
    assert core.argmax_rows(big[:, :1001]).tolist() == want  # row stride 2000, no copy
