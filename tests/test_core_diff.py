"""C++ core vs the pure-Python reference on hypothesis-generated trees, logits and seeds.

Every stage of a lap is compared: building (merges, scores), best-first selection, row order,
seq ids and setup ops, layouts of every segmentation, whole-tree and step-wise decisions for
greedy and sampling, FlowSpec prune + dynamic expansion, and commit plans.
"""

from __future__ import annotations

import math

import numpy as np
import ref_core as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgespec.tree import core

LOGPROBS = [0.0, -0.25, -0.5, -1.0, -2.0, -math.inf]


@st.composite
def scenarios(draw):
    vocab = draw(st.integers(2, 9))
    n_adds = draw(st.integers(0, 40))
    adds = [
        (
            draw(st.integers(0, 10_000)),  # parent, taken modulo the current size
            draw(st.integers(0, vocab - 1)),
            draw(st.one_of(st.sampled_from(LOGPROBS), st.floats(-6.0, 0.0))),
        )
        for _ in range(n_adds)
    ]
    greedy = draw(st.booleans())
    cfg = ref.Config(
        temperature=0.0 if greedy else draw(st.sampled_from([0.4, 1.0, 1.7])),
        seed=draw(st.integers(0, 2**64 - 1)),
    )
    return {
        # Tokens the sampler chain dropped (-inf logits) in some scenarios.
        "dropped": draw(st.sampled_from([0.0, 0.0, 0.3, 0.8])),
        "vocab": vocab,
        "root_token": draw(st.integers(0, vocab - 1)),
        "root_pos": draw(st.integers(0, 5000)),
        "max_seqs": draw(st.sampled_from([1, 2, 3, 5, 8, 255])),
        "adds": adds,
        "budget": draw(st.integers(0, 40)),
        "cfg": cfg,
        "logit_seed": draw(st.integers(0, 2**32 - 1)),
        "split_seed": draw(st.integers(0, 2**32 - 1)),
        "expand": [
            (
                draw(st.integers(0, 10_000)),
                draw(st.integers(0, vocab - 1)),
                draw(st.sampled_from(LOGPROBS[:4])),
            )
            for _ in range(draw(st.integers(0, 6)))
        ],
    }


def assert_tree_equal(t: core.TokenTree, r: ref.RefTree) -> None:
    assert t.size == r.size and t.n_rows == r.n_rows and t.last_start == r.last_start
    assert t.tokens().tolist() == r.token
    assert t.parents().tolist() == r.parent
    assert t.depths().tolist() == r.depth
    assert t.seqs().tolist() == r.seq
    assert t.alive().tolist() == r.alive
    assert t.scores().tolist() == r.score
    assert t.n_free_seqs == r.max_seqs - len(r.used)


def assert_layout_equal(lay: core.Layout, exp: tuple) -> None:
    got = (lay.tokens, lay.pos, lay.seq_ids, lay.n_seq, lay.parents, lay.depths)
    for g, e in zip(got, exp, strict=True):
        assert g.dtype == np.int32 and g.shape == e.shape and (g == e).all()


def assert_decision_equal(d: core.Decision, e: ref.RefDecision) -> None:
    assert d.status == e.status and d.path.tolist() == e.path and d.tokens.tolist() == e.tokens
    assert d.bonus == e.bonus and d.need_row == e.need_row and d.n_processed == e.n_processed


def assert_plan_equal(p: core.KvPlan, e: dict) -> None:
    assert p.ops.reshape(-1, 5).tolist() == e["ops"]
    for k in ("survivors", "remap", "path", "tokens"):
        assert getattr(p, k).tolist() == e[k], k
    assert p.next_root_token == e["next_root_token"] and p.next_root_pos == e["next_root_pos"]


def splits(n: int, rng: np.random.Generator) -> list[list[int]]:
    """Every size, every count, every single cut, and a few random multi-cut splits of n rows."""
    out = [[0, *range(s, n, s), n] for s in range(1, n + 1)]
    out += [core_bounds_count(n, c) for c in range(1, n + 1)]
    out += [[0, k, n] for k in range(1, n)]
    for _ in range(3):
        cuts = sorted(set(rng.integers(1, n, size=rng.integers(0, n)).tolist())) if n > 1 else []
        out.append([0, *cuts, n])
    return out


def core_bounds_count(n: int, count: int) -> list[int]:
    base, extra, b, x = n // count, n % count, [0], 0
    for k in range(count - 1):
        x += base + (1 if k < extra else 0)
        b.append(x)
    return [*b, n]


def build(sc):
    t = core.TokenTree(sc["root_token"], sc["root_pos"], sc["max_seqs"])
    r = ref.RefTree(sc["root_token"], sc["root_pos"], sc["max_seqs"])
    for parent, token, lp in sc["adds"]:
        p = parent % t.size
        assert t.add(p, token, lp) == r.add(p, token, lp)
    assert_tree_equal(t, r)
    return t, r


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_core_matches_reference(sc):
    t, r = build(sc)
    cfg = sc["cfg"]
    assert t.select(sc["budget"]).tolist() == r.select(sc["budget"])
    assert_tree_equal(t, r)
    assert t.n_live_leaves <= sc["max_seqs"]
    o = t.order()
    ro = r.order()
    assert o.remap.tolist() == ro[0] and (o.start, o.stop) == (ro[1], ro[2])
    assert o.ops.reshape(-1, 5).tolist() == ro[3]
    assert_tree_equal(t, r)
    n = t.n_rows
    # Rows are parents-first and in non-increasing score order.
    parents, scores = t.parents()[:n], t.scores()[:n]
    assert all(parents[i] < i for i in range(1, n)) and (scores[1:] <= scores[:-1]).all()
    assert_layout_equal(t.layout(), r.layout(0, n))

    rng = np.random.default_rng(sc["logit_seed"])
    logits = (np.round(rng.normal(0, 2, size=(n, sc["vocab"])) * 2) / 2).astype(np.float32)
    drop = rng.random(logits.shape) < sc["dropped"]
    drop[np.arange(n), logits.argmax(axis=1)] = False  # every row keeps a token
    logits[drop] = -np.inf
    verifier = core.Verifier(cfg.temperature, cfg.seed)
    whole = verifier.verify(t, logits)
    tokens, parents = t.structure()
    rv = ref.RefVerification(cfg, t.root_pos, tokens.tolist(), parents.tolist())
    assert_decision_equal(whole, rv.feed(logits, 0))
    assert whole.accepted
    # Same decision from targets drawn row by row (argmax_rows / sample_rows).
    targets = verifier.sample_rows(logits, t.layout().pos)
    if cfg.temperature == 0.0:
        assert (targets == core.argmax_rows(logits)).all()
    assert_decision_equal(verifier.start(t).feed_targets(targets, 0), rv.dec)

    for b in splits(n, np.random.default_rng(sc["split_seed"])):
        assert t.segment_bounds(start=0, stop=n, size=None, count=len(b) - 1).tolist()[-1] == n
        v = verifier.start(t)
        rvs = ref.RefVerification(cfg, t.root_pos, tokens.tolist(), parents.tolist())
        for k in range(len(b) - 1):
            assert_layout_equal(t.layout(b[k], b[k + 1]), r.layout(b[k], b[k + 1]))
            d = v.feed(logits[b[k] : b[k + 1]], b[k])
            assert_decision_equal(d, rvs.feed(logits[b[k] : b[k + 1]], b[k]))
            if d.status == core.PENDING:
                assert d.need_row >= b[k + 1] and d.path[-1] == d.need_row
        assert_decision_equal(d, rv.dec)  # step-wise ends where whole-tree verification ends

    for size in range(1, n + 1):
        assert t.segment_bounds(size=size, start=0, stop=n).tolist() == r.segments(0, n, size=size)
    for count in range(1, n + 1):
        assert t.segment_bounds(count=count, start=0, stop=n).tolist() == r.segments(
            0, n, count=count
        )

    flowspec_lap(sc, t, r, verifier, logits, rng)


def flowspec_lap(sc, t, r, verifier, logits, rng) -> None:
    """Step-wise lap with pruning and dynamic expansion, then the commit; both sides in step."""
    cfg, n = sc["cfg"], t.n_rows
    tokens, parents = t.structure()
    v = verifier.start(t)
    rv = ref.RefVerification(cfg, t.root_pos, tokens.tolist(), parents.tolist())
    cut = int(rng.integers(1, n + 1))
    d = v.feed(logits[:cut], 0)
    assert_decision_equal(d, rv.feed(logits[:cut], 0))
    fed = cut
    if d.status == core.PENDING:
        plan = t.prune(d)
        assert_plan_equal(plan, ref.plan_prune(r, rv.dec))
        assert_tree_equal(t, r)
        alive = t.alive()
        assert alive[plan.survivors].all() and alive.sum() == len(plan.survivors)
        # Dynamic expansion under survivors: a further segment with new leaf seqs.
        under = [
            s for s in plan.survivors.tolist() if s >= d.need_row
        ]  # subtree of the pending node
        for parent, token, lp in sc["expand"]:
            p = under[parent % len(under)]
            assert t.add(p, token, lp) == r.add(p, token, lp)
        assert t.select(64).tolist() == r.select(64)
        o, ro = t.order(), r.order()
        assert o.ops.reshape(-1, 5).tolist() == ro[3] and (o.start, o.stop) == (ro[1], ro[2])
        assert_tree_equal(t, r)
        if o.stop > o.start:
            assert_layout_equal(t.layout(o.start, o.stop), r.layout(o.start, o.stop))
            new_tokens, new_parents = t.tokens()[o.start : o.stop], t.parents()[o.start : o.stop]
            v.extend(new_tokens, new_parents, o.start)
            rv.extend(new_tokens.tolist(), new_parents.tolist(), o.start)
            extra = (
                np.round(rng.normal(0, 2, size=(o.stop - o.start, sc["vocab"])) * 2) / 2
            ).astype(np.float32)
            logits = np.concatenate([logits, extra])
        # The in-flight rows arrive with the rows of pruned nodes dropped by the stages.
        rest = [i for i in range(fed, t.n_rows) if t.alive()[i]]
        d = v.feed(logits[rest], fed, rows=np.asarray(rest, np.int32))
        assert_decision_equal(d, rv.feed(logits[rest], fed, rows=rest))
    else:
        d = v.feed(logits[fed:n], fed)
        assert_decision_equal(d, rv.feed(logits[fed:n], fed))
    assert d.accepted
    plan = t.commit(d)
    assert_plan_equal(plan, ref.plan_commit(r, rv.dec))
    assert_tree_equal(t, r)
    assert t.n_free_seqs == t.max_seqs and t.root_token == d.bonus
