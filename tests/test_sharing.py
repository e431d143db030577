"""Several requests on one ring share it (docs/design.md 5.8): the tree budget each one's cost
model chooses shrinks as more decode at once (one request: exactly today's choice), and a
prompt prefills in smaller chunks while others decode, with the same tokens as alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_auto_fallback import RightDrafter, _decode, _prompt, ring, tiny_target  # noqa: F401
from thread_helpers import race

from edgespec.head.engine import SpecEngine
from edgespec.head.engine.cost import CostModel
from edgespec.head.engine.flow import FlowMode


def test_budget_shrinks_with_users_and_is_unchanged_for_one() -> None:
    cost = CostModel(lap_ms=(40.0, 3.0))
    cost.hits[:] = [8.0, 2.0, 1.0, 0.5]  # a drafter right 80% of the time at rank 0
    alone = cost.choose()
    assert alone > 0 and cost.choose(users=1) == alone
    chosen = [cost.choose(users=k) for k in (1, 2, 4, 8, 32)]
    assert all(b >= c for b, c in zip(chosen, chosen[1:], strict=False)), chosen
    assert chosen[2] < alone  # 4 users: a smaller tree
    assert chosen[-1] == 0  # so many that a row costs more than it brings: plain laps
    # what the choice maximises: each extra row is charged to every user
    assert cost.rate(8, users=4) == pytest.approx(
        cost.expected_tokens(8) / (40.0 + 4 * 3.0 * 9 + cost.draft_ms * 8))


def test_laps_measured_beside_other_requests_do_not_move_the_lap_fit() -> None:
    """A lap that shared the ring waited behind the others' batches; ``rate`` charges that
    separately (users x the row cost). Fitted, it would make laps look dear once the request
    is alone again, and a lone request would choose bigger trees than on a quiet ring."""
    clean, polluted = CostModel(), CostModel()
    for cost in (clean, polluted):
        cost.hits[:] = [8.0, 2.0, 1.0, 0.5]
        for rows in (1, 5, 9):
            cost.observe_lap(rows, 40.0 + 3.0 * rows)
    fit = (clean.lap_a, clean.lap_b)
    assert fit == pytest.approx((40.0, 3.0))
    for rows in (1, 1, 5, 9):  # 4 requests at once: every lap waits for the others
        clean.observe_lap(rows, 300.0 + 3.0 * rows, users=4)
        polluted.observe_lap(rows, 300.0 + 3.0 * rows)
    assert (clean.lap_a, clean.lap_b) == fit
    assert polluted.choose(users=1) > clean.choose(users=1) > 0


def test_cost_model_shared_by_slot_threads_counts_every_observation() -> None:
    """The slots of a ring share one cost model (docs/design.md 5.8), fed by their threads at
    once: no observation is lost and the lap fit stays the one of the laps measured."""
    cost = CostModel()

    def feed(k: int) -> None:
        for i in range(3000):
            cost.observe_rank(0 if i % 2 else None, 4)
            cost.observe_lap(1 + (i + k) % 5, 40.0 + 3.0 * (1 + (i + k) % 5))
            cost.observe_draft(2, 10.0)

    race(feed, range(4))
    # every step tried rank 0: 12000 tries, half of them hits (on top of the prior's 10 and 6)
    assert cost.tries[0] == 10.0 + 12000 and cost.hits[0] == 6.0 + 6000
    assert cost.tries[1] == 10.0 + 6000  # the misses tried ranks 1-3 too
    assert (cost.lap_a, cost.lap_b) == pytest.approx((40.0, 3.0))
    assert cost.draft_ms == pytest.approx(5.0)


def test_flow_drafts_less_far_ahead_while_others_decode(ring) -> None:  # noqa: F811
    engine = SpecEngine(ring.chain, n_ctx=1024)
    engine.cost.hits[0], engine.cost.tries[0] = 95.0, 100.0  # top-1 draft right 95%
    limits = []
    for k in (1, 2, 4, 8):
        engine.sharers = lambda k=k: k
        limits.append(FlowMode(engine).ahead_limit())
    # alone: as deep as a chain of top-1 guesses stays >= 0.3 likely (0.95**23 = 0.307)
    assert limits[0] == min(engine.max_depth, 23)
    assert all(a >= b for a, b in zip(limits, limits[1:], strict=False)), limits
    assert limits[2] == int(math.log(1 - 0.7 * 0.75 ** 3) / math.log(0.95)) < limits[0]
    assert limits[-1] >= 1


def test_prefill_chunks_shrink_while_others_decode_same_tokens(ring, monkeypatch) -> None:  # noqa: F811
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, ring.tokenizer.n_vocab, 300)]
    ref = _prompt(ring)  # any reference continuation: the drafter is right on it or not
    sizes: dict[str, list[int]] = {}
    ahead: dict[str, list[int]] = {}
    outs = {}
    # (requests on the ring, this one included; others streaming answers; long from)
    cases = {"alone": (1, 0, 512), "prompts": (3, 0, 512), "streams": (3, 2, 256),
             "short": (3, 2, 512)}
    for name, (k, streams, long_from) in cases.items():
        monkeypatch.setattr(SpecEngine, "LONG_PREFILL", long_from)
        engine = SpecEngine(ring.chain, n_ctx=1024,
                            drafter=RightDrafter(prompt + ref, ring.tokenizer.n_vocab))
        engine.sharers = lambda k=k: k
        engine.streams = lambda streams=streams: streams
        sent: list[int] = []
        ahead[name] = []
        submit = engine.chain.submit

        def spy(batch, submit=submit, sent=sent, engine=engine, owed=ahead[name]):
            sent.append(len(batch))
            owed.append(engine.owed)  # results still to come when it is sent
            submit(batch)

        engine.chain.submit = spy
        try:
            outs[name] = {m: _decode(engine, prompt, 12, m) for m in ("none", "flow")}
        finally:
            del engine.chain.submit
        engine.reset()
        sizes[name] = sent
    assert all(out == outs["alone"] for out in outs.values())
    assert outs["alone"]["none"] == outs["alone"]["flow"]
    # 300 prompt tokens: chunks of 256 + 44 alone; of 64 (4 full, then 44) beside other
    # prompts, or beside streaming answers while the prompt is short of LONG_PREFILL;
    # a long one beside two streaming answers, of 2 (299 + the root: 150 chunks)
    assert sizes["alone"][:2] == [256, 44]
    assert sizes["prompts"][:5] == sizes["short"][:5] == [64, 64, 64, 64, 44]
    assert sizes["streams"][:150] == [2] * 150
    # Alone every chunk goes at once; beside others one per stage at most is in flight.
    assert ahead["alone"][:2] == [0, 1]
    n_stages = ring.chain.n_stages
    for name, n in (("prompts", 5), ("streams", 150)):
        assert max(ahead[name][:n]) == n_stages - 1
        assert ahead[name][:n_stages] == list(range(n_stages))


def test_stream_dropped_unfinished_frees_its_slot_without_gc(tiny_target) -> None:  # noqa: F811
    """A caller that stops reading a stream and drops it (a ``break``, a thread that ends)
    frees its slot on the ring's next round: nothing waits for the garbage collector."""
    import gc

    from edgespec.api import Ring

    with Ring.local(tiny_target, stages=2, processes=False, n_ctx=1024, parallel=2) as two:
        prompt = _prompt(two)
        gc.disable()
        try:
            stream = two.stream_tokens(prompt, max_tokens=32, spec="none")
            next(stream)
            assert two.scheduler.busy() == 1
            del stream
            assert two.scheduler.wait_idle(10) and two.scheduler.busy() == 0
        finally:
            gc.enable()
        two.reset()  # takes every slot in turn: would wait forever on a held one


def test_tree_budgets_make_laps_of_whole_kernel_blocks() -> None:
    """A tree of B nodes goes out as B + 1 rows; llama.cpp's CPU kernels work on row blocks
    (4 or 16 on the test host), and a lap one row past a block paid for a slow remainder:
    sync at one client ran at 10.8 tok/s with budgets 4..64 and 11.6 with 3..63
    (docs/design.md 3.8). Every budget the cost model can choose, the probe's included,
    makes a power-of-two lap."""
    cost = CostModel()
    assert cost.budgets == CostModel.BUDGETS
    assert all(((b + 1) & b) == 0 and b >= 3 for b in cost.budgets)
    cost.hits[:] = [8.0, 2.0, 1.0, 0.5]
    for users in (1, 2, 4, 8):
        assert cost.choose(users) in (0, *cost.budgets)
