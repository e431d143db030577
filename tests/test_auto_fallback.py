"""``auto``/``flow`` without a useful drafter decode like mode ``none``: after a short trial
the engine measures that trees do not pay and decodes plain laps (probing now and then), with
exactly the tokens of mode ``none``; a useful drafter keeps its trees."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from thread_helpers import race
from tinygguf import make_tiny_gguf

from edgespec.api import Ring
from edgespec.drafters import Drafter, DraftTree
from edgespec.head.engine import SpecEngine
from edgespec.head.engine.gain import GainMeter, RingRates
from edgespec.head.engine.policy import TreePolicy
from edgespec.head.request import Request
from edgespec.params import GenerationParams


class WrongDrafter(Drafter):
    """Always drafts a token the target does not pick (greedy): the reference continuation's
    next token plus one. A drafter that never helps, as retrieval is on fresh text."""

    def __init__(self, reference: Sequence[int], n_vocab: int) -> None:
        super().__init__()
        self.reference = list(reference)
        self.n_vocab = n_vocab
        self._hist: list[int] = []

    def begin(self, prompt_tokens: Sequence[int]) -> None:
        self._hist = [int(t) for t in prompt_tokens]

    def _wrong(self) -> int:
        i = len(self._hist)
        right = self.reference[i] if i < len(self.reference) else 0
        return (right + 1) % self.n_vocab

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        self._check_root(root)
        return DraftTree.from_nodes([(-1, self._wrong(), -0.1)])

    def propose_under(self, path: Sequence[int], budget: int, max_depth: int) -> DraftTree:
        return DraftTree.empty()

    def accept(self, accepted_tokens: Sequence[int]) -> None:
        self._hist.extend(int(t) for t in accepted_tokens)

    @property
    def history(self) -> Sequence[int]:
        return self._hist


class RightDrafter(WrongDrafter):
    """Drafts the reference continuation itself, at no cost: trees always pay."""

    def _chain(self, below: Sequence[int], budget: int, max_depth: int) -> DraftTree:
        at = len(self._hist) + len(below)
        if list(below) != self.reference[len(self._hist):at]:
            return DraftTree.empty()
        toks = self.reference[at: at + min(budget, max_depth - len(below))]
        return DraftTree.from_nodes([(i - 1, t, -0.01) for i, t in enumerate(toks)])

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        self._check_root(root)
        return self._chain((), budget, max_depth)

    def propose_under(self, path: Sequence[int], budget: int, max_depth: int) -> DraftTree:
        return self._chain(path, budget, max_depth)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("auto") / "target.gguf", "qwen2", n_layer=4,
                          n_embd=64, seed=3)


@pytest.fixture(scope="module")
def ring(tiny_target):
    with Ring.local(tiny_target, stages=2, processes=False, n_ctx=1024) as r:
        yield r


def _prompt(ring: Ring) -> list[int]:
    rng = np.random.default_rng(1)
    return [int(t) for t in rng.integers(3, ring.tokenizer.n_vocab, 16)]


def _generate(engine: SpecEngine, prompt: list[int], n: int, mode: str) -> Request:
    """``prompt``'s generation on the engine itself, from an empty cache: the request, with
    its tokens and statistics."""
    engine.reset()
    req = Request(prompt, GenerationParams(max_tokens=n), mode)
    req.tokens = [t for chunk in engine.run(req) for t in chunk]
    return req


def _decode(engine: SpecEngine, prompt: list[int], n: int, mode: str) -> list[int]:
    return _generate(engine, prompt, n, mode).tokens


@pytest.mark.parametrize("mode", ["auto", "flow"])
def test_useless_drafter_decodes_plain_laps(ring, mode):
    prompt = _prompt(ring)
    n = 64
    # The engine itself, no end-of-generation token: every generation is n laps long.
    ref = _decode(SpecEngine(ring.chain, n_ctx=1024), prompt, n, "none")
    engine = SpecEngine(ring.chain, n_ctx=1024,
                        drafter=WrongDrafter(prompt + ref, ring.tokenizer.n_vocab))
    # First generation: a one-step trial, then one-step probes after 9, 17, 33 plain laps.
    # Second: its own trial step (the drafter may suit this prompt), then the probing
    # interval the first one reached (64).
    for generation, most in ((0, 5), (1, 2)):
        req = _generate(engine, prompt, n, mode)
        assert req.tokens == ref
        s = req.stats
        assert s.mode == "flow"
        trees = s.steps - s.plain_steps
        assert 1 <= trees <= most, f"generation {generation}: {trees} tree steps of {s.steps}"
        assert s.plain_steps >= n - most
        assert s.as_dict()["plain_steps"] == s.plain_steps
        assert s.as_dict()["plain_lap_ms"] > 0  # the lap-timing view: a plain lap's wait
        if generation == 0:
            assert s.probes >= 1


@pytest.fixture(scope="module")
def heavier_ring(tmp_path_factory):
    # Big enough that a lap costs several milliseconds: on the 64-wide model a lap is
    # ~1 ms, less than the head's own work per tree step, so there trees rightly lose.
    path = make_tiny_gguf(tmp_path_factory.mktemp("auto") / "heavier.gguf", "qwen2",
                          n_layer=8, n_embd=512, seed=3)
    with Ring.local(path, stages=2, processes=False, n_ctx=1024) as r:
        yield r


def test_useful_drafter_keeps_its_trees(heavier_ring):
    """A drafter that is always right: trees keep paying, most tokens come from them."""
    ring = heavier_ring
    prompt = _prompt(ring)
    ref = _decode(SpecEngine(ring.chain, n_ctx=1024), prompt, 64, "none")
    engine = SpecEngine(ring.chain, n_ctx=1024,
                        drafter=RightDrafter(prompt + ref, ring.tokenizer.n_vocab))
    req = _generate(engine, prompt, 64, "auto")
    assert req.tokens == ref
    s = req.stats
    assert s.mode == "flow"
    assert s.mean_accepted > 2
    # Tokens from tree steps. (The first one-step trial may lose on this serial in-process
    # chain, where a round is as many laps as it gains tokens early on: then 8 plain laps
    # follow before the probe that wins.)
    assert s.tokens - s.plain_steps > 3 * s.plain_steps


def _trial(meter: GainMeter, steps: list[tuple[int, float]], sharers: int = 1) -> bool:
    """A new generation's trial of ``steps`` (tokens, seconds); then: trees or plain laps?"""
    meter.begin()
    for tokens, seconds in steps:
        assert meter.want_tree(sharers)  # still in the trial
        meter.record_tree(tokens, seconds)
    return meter.want_tree(sharers)


def test_lost_trial_alone_keeps_trees_that_pay_over_the_long_run() -> None:
    """A good draft model's first steps of an answer gain little; judged on them alone, the
    generation would fall back to plain laps. Alone on the ring, its tree steps of earlier
    generations say trees pay here: they are kept. Without that record, with a poor one, or
    while other requests decode (a tree's rows are their compute too), the trial's own rate
    decides, as before."""
    slow_start = [(2, 0.4)] * GainMeter.TRIAL_MAX  # 5 tok/s against plain laps' 10
    good, poor, fresh = GainMeter(), GainMeter(), GainMeter()
    for meter in (good, poor, fresh):
        meter.record_plain(0.1)
    for _ in range(GainMeter.LONG_RUN_MIN):
        good.record_tree(20, 0.5)  # 40 tok/s
        poor.record_tree(2, 0.4)
    assert _trial(good, slow_start)
    assert not _trial(good, slow_start, sharers=2)
    assert not _trial(fresh, slow_start)
    assert not _trial(poor, slow_start)
    # A trial of one-token steps is a plain lap's worth whatever came before.
    assert not _trial(good, [(1, 0.1)] * GainMeter.TRIAL_MAX)
    # The long run follows this generation too: steps that stop paying end the trees.
    assert _trial(good, slow_start)
    for _ in range(GainMeter.LONG_RUN):
        if not good.want_tree():
            break
        good.record_tree(2, 0.4)
    else:
        raise AssertionError("trees kept through a whole long run of losing steps")


def test_slots_sharing_ring_rates_judge_a_fresh_slot_on_the_ring_s_long_run() -> None:
    """A user's successive chats rotate through a ring's free slots: the slot a request lands
    on judges its trial on the tree steps of every slot (RingRates, docs/design.md 5.8), not
    on its own quarter of them; a slot of another ring knows nothing of them."""
    rates = RingRates()
    first, second = GainMeter(rates), GainMeter(rates)
    other_ring = GainMeter()
    first.record_plain(0.1)
    for _ in range(GainMeter.LONG_RUN_MIN):
        first.record_tree(20, 0.5)  # 40 tok/s against plain laps' 10
    slow_start = [(2, 0.4)] * GainMeter.TRIAL_MAX
    assert second.plain_ms == pytest.approx(100.0)
    assert _trial(second, slow_start)
    other_ring.record_plain(0.1)
    assert not _trial(other_ring, slow_start)
    # Draining a tree's rows still in flight charges that meter's own step, though another
    # slot's steps came after it.
    second.record_tree(3, 0.1)
    first.record_tree(4, 0.2)
    second.charge_tree(0.05)
    steps, tokens, seconds = rates.long_run()
    assert steps == GainMeter.LONG_RUN_MIN + GainMeter.TRIAL_MAX + 2
    assert seconds == pytest.approx(8 * 0.5 + 3 * 0.4 + 0.15 + 0.2)


def test_a_request_alone_is_judged_on_steps_taken_alone() -> None:
    """Tree steps and plain laps measured while other requests decoded are slower (their
    batches share the stages). A request alone on the ring judges its trial on the long run
    of steps taken alone, whatever a busy spell left in the run of every step."""
    rates = RingRates()
    before, busy, after = GainMeter(rates), GainMeter(rates), GainMeter(rates)
    before.record_plain(0.1)
    for _ in range(GainMeter.LONG_RUN_MIN):
        before.record_tree(20, 0.5)  # alone: 40 tok/s against plain laps' 10
    for _ in range(RingRates.LONG_RUN):  # 4 requests at once: trees no better than plain
        busy.record_tree(3, 0.9, sharers=4)
        busy.record_plain(0.3, sharers=4)
    steps, tokens, seconds = rates.long_run()
    assert steps == RingRates.LONG_RUN and tokens / seconds == pytest.approx(10 / 3)
    assert rates.long_run(alone=True)[0] == GainMeter.LONG_RUN_MIN
    assert rates.plain_ms_alone == pytest.approx(100.0) and rates.plain_ms > 250.0
    slow_start = [(2, 0.8)] * GainMeter.TRIAL_MAX  # 2.5 tok/s: loses on its own
    assert _trial(after, slow_start)  # alone: the steps taken alone say trees pay
    assert not _trial(after, slow_start, sharers=2)  # beside others: its own rate decides


def test_ring_rates_fed_by_slot_threads_lose_no_tree_step() -> None:
    """Slot threads record into and judge from one RingRates at once: no judgement trips
    over another thread's step, and every step and charge is counted."""
    rates = RingRates()

    def feed(meter: GainMeter) -> None:
        for _ in range(3000):
            meter.record_tree(1, 0.001)
            meter.charge_tree(0.001)
            meter.record_plain(0.01)
            rates.long_run()  # what ``pays`` reads

    race(feed, [GainMeter(rates) for _ in range(4)])
    steps, tokens, seconds = rates.long_run()
    assert steps == tokens == RingRates.LONG_RUN
    assert seconds == pytest.approx(RingRates.LONG_RUN * 0.002)
    assert rates.plain_ms == pytest.approx(10.0)


def test_beside_others_a_tree_step_counts_once_for_every_request_decoding() -> None:
    """A tree step's rows hold up every request decoding on the ring: while k decode, its
    time counts k times. Trees twice as fast as plain laps for their own request pay alone,
    not beside another request (they would cost it as much as they save)."""
    meter = GainMeter()
    meter.record_plain(0.1)  # plain laps: 10 tok/s
    twice = [(8, 0.4)] * GainMeter.TRIAL_MAX  # 20 tok/s for the request itself
    assert _trial(meter, twice)
    assert not _trial(meter, twice, sharers=2)
    assert _trial(meter, [(40, 0.4)] * GainMeter.TRIAL_MAX, sharers=4)  # 100 tok/s: still pays


def test_flow_decodes_plain_laps_while_requests_fill_the_pipeline() -> None:
    """As many requests as stages keep every stage busy at one row a token: flow's steps are
    plain laps then, whatever the trees gained; with fewer, the gain meter decides. A fixed
    budget is taken as given."""
    policy = TreePolicy()
    policy.record_plain(0.1)
    for _ in range(GainMeter.LONG_RUN_MIN):
        policy.record_tree(40, 0.4)  # 100 tok/s against plain laps' 10
    policy.begin()
    assert policy.flow_segment(1, 3) == TreePolicy.FLOW_SEGMENT
    assert policy.flow_segment(2, 3) == TreePolicy.FLOW_SEGMENT
    assert policy.flow_segment(3, 3) == 0 and policy.flow_segment(4, 3) == 0
    assert policy.flow_segment(4, 1) == TreePolicy.FLOW_SEGMENT  # one stage: no pipeline
    assert TreePolicy(budget=12).flow_segment(4, 3) == 4


class CountingDrafter(RightDrafter):
    """RightDrafter that records what it was given to read."""

    def __init__(self, reference: Sequence[int], n_vocab: int) -> None:
        super().__init__(reference, n_vocab)
        self.begun: list[list[int]] = []

    def begin(self, prompt_tokens: Sequence[int]) -> None:
        self.begun.append([int(t) for t in prompt_tokens])
        super().begin(prompt_tokens)


def test_a_request_on_a_full_pipeline_leaves_the_drafter_until_it_drafts(ring) -> None:
    """A request that starts beside others leaves the head's draft model to them: while as
    many requests decode as the ring has stages it decodes plain laps, and its drafter does
    not read the prompt meanwhile; once the ring has room again, its first tree has the
    drafter read the whole text so far, and the answer is the one mode none gives. Alone,
    the drafter reads the prompt while the prefill lap is in flight."""
    prompt = _prompt(ring)
    n = 48  # trees come after 10 plain steps: more than CATCH_UP_ROOM tokens left then
    ref = _decode(SpecEngine(ring.chain, n_ctx=1024), prompt, n, "none")
    engine = SpecEngine(ring.chain, n_ctx=1024,
                        drafter=CountingDrafter(prompt + ref, ring.tokenizer.n_vocab))
    engine.sharers = lambda: 2  # two stages: full
    req = _generate(engine, prompt, n, "flow")
    assert req.tokens == ref
    assert engine.drafter.begun == [] and req.stats.plain_steps == n
    # Full while the first 10 steps are decided, then alone: trees from the text so far.
    calls = iter(range(10**6))
    engine.sharers = lambda: 2 if next(calls) < 12 else 1
    req = _generate(engine, prompt, n, "flow")
    assert req.tokens == ref
    (text,) = engine.drafter.begun
    assert text[:len(prompt)] == prompt and len(prompt) < len(text) < len(prompt) + n
    assert text == (prompt + ref)[:len(text)]
    assert req.stats.plain_steps < n
    engine.sharers = lambda: 1
    assert _decode(engine, prompt, n, "flow") == ref
    assert engine.drafter.begun[-1] == prompt
    # The first of several that came at once, the others waiting for their slots: its
    # drafter leaves the draft model to them from the start.
    begun = len(engine.drafter.begun)
    engine.demand = lambda: 3
    first = iter(range(10**6))
    engine.sharers = lambda: 1 if next(first) == 0 else 3  # its slot the only busy one yet
    req = _generate(engine, prompt, 4, "flow")
    assert req.tokens == ref[:4]
    assert len(engine.drafter.begun) == begun
    # Left behind at its start, then room on the ring, but an answer of fewer tokens than
    # reading the whole text would pay for: plain laps to its end.
    first = iter(range(10**6))
    engine.sharers = lambda: 2 if next(first) == 0 else 1
    engine.demand = lambda: 1
    req = _generate(engine, prompt, SpecEngine.CATCH_UP_ROOM - 1, "flow")
    assert req.tokens == ref[:SpecEngine.CATCH_UP_ROOM - 1]
    assert len(engine.drafter.begun) == begun and req.stats.plain_steps == len(req.tokens)
