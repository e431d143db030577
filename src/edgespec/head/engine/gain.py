"""Measured gain: does drafting pay on this ring, for this generation, right now?

A cost model predicts; this meter checks. It times every step as the caller sees it (from the
step's start to the moment the caller asks for more, so drafting, verification, pruned rows
and results of decided trees still in flight all count) and compares the tokens per second of
recent tree steps with the wall time of a plain lap (one token, no tree). When trees do not
beat plain laps, the engine decodes plain laps (exactly mode ``none``) and probes with one tree
step now and then, backing off each time the probe loses, so a useless drafter costs about
two tree steps per generation and a useful one is found again when it starts to help (a
prompt that begins to repeat its own text, say). Every generation opens with a trial: its
prompt may suit the drafter where the last one did not. A request alone on the ring judges a
trial that gained several tokens on the longer run of tree steps too (``pays``).

What the meter learns of the ring rather than of a generation (a plain lap's time, the long
run of tree steps) lives in ``RingRates``, which the slots of a ring share (docs/design.md 5.8).
"""

from __future__ import annotations

import threading
from collections import deque


class RingRates:
    """A plain lap's wall time and the last ``LONG_RUN`` tree steps of any generation: what a
    ``GainMeter`` measures of the ring. One per ring, shared by its slots' meters (slot
    threads feed it at once, hence the lock): new conversations take the least recently used
    free slot, so one user's successive chats rotate through the slots, and each would
    otherwise be judged on a quarter of that user's history (a slot's first, on none).

    Both are kept twice: over every step, and over the steps of requests alone on the ring
    (``alone``), which is what a request alone is judged on. Steps taken while others decode
    are slower for it (their batches share the stages), plain laps and tree steps unlike
    (trees add rows to everyone's laps): a busy spell's steps say nothing of what a tree
    brings a request alone (docs/design.md 5.8)."""

    #: Weight of the newest plain lap in the running mean of ``plain_ms``.
    ALPHA = 0.25
    #: Tree steps (across generations) the long-run judgement looks back on.
    LONG_RUN = 32

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.plain_ms: float | None = None
        self.plain_ms_alone: float | None = None
        # [tokens, seconds] of the last LONG_RUN tree steps (and of those taken alone); a
        # meter may still charge its own last entry (``charge``), whichever slot's steps came
        # after it.
        self._long: deque[list] = deque(maxlen=self.LONG_RUN)
        self._long_alone: deque[list] = deque(maxlen=self.LONG_RUN)

    def _mean(self, old: float | None, ms: float) -> float:
        return ms if old is None else (1 - self.ALPHA) * old + self.ALPHA * ms

    def record_plain(self, seconds: float, alone: bool = True) -> None:
        """A plain lap took ``seconds``; ``alone``: no other request decoded meanwhile."""
        ms = seconds * 1e3
        with self._lock:
            self.plain_ms = self._mean(self.plain_ms, ms)
            if alone:
                self.plain_ms_alone = self._mean(self.plain_ms_alone, ms)

    def record_tree(self, tokens: int, seconds: float, alone: bool = True) -> list:
        """A tree step gained ``tokens`` in ``seconds``; returns its entry for ``charge``."""
        entry = [tokens, seconds]
        with self._lock:
            self._long.append(entry)
            if alone:
                self._long_alone.append(entry)
        return entry

    def charge(self, entry: list, seconds: float) -> None:
        """More time spent on the tree step of ``entry`` after it ended."""
        with self._lock:
            entry[1] += seconds

    def long_run(self, alone: bool = False) -> tuple[int, int, float]:
        """Steps, tokens and seconds of the last LONG_RUN tree steps (taken ``alone``)."""
        with self._lock:
            steps = self._long_alone if alone else self._long
            return len(steps), sum(t for t, _ in steps), sum(s for _, s in steps)


class GainMeter:
    """Chooses between a tree step and a plain step from measured rates.

    ``plain_ms`` (a plain lap's wall time) and the long run of tree steps are properties of
    the ring (``rates``, shared by a ring's slots); the probing interval persists across this
    meter's generations; each generation (``begin``) opens with a trial judged on its own.
    """

    #: Tree steps in one trial (the first of a generation and every probe): one while steps
    #: gain a single token (on a 2-stage loopback ring a flow step of a useless drafter costs
    #: about two plain laps: its drafted-ahead rows are computed, then dropped), up to
    #: TRIAL_MAX while they gain more (or while recent tree steps gained LIKELY_TOKENS on
    #: average: a good drafter's first guess misses now and then, see ``record_tree``).
    TRIAL = 1
    TRIAL_MAX = 3
    #: Tree steps the running judgement looks back on while trees are winning.
    WINDOW = 8
    #: Plain steps after a lost trial before the next probe; doubled after every lost probe
    #: (up to MAX_WAIT), halved by a won one.
    FIRST_WAIT = 8
    MAX_WAIT = 64
    #: Trees must beat plain laps by this factor: a trial is one step, its rate is noisy, and
    #: a draft that pays only within noise is not worth a tree step's extra compute.
    MARGIN = 1.1

    #: Mean tokens per tree step (over the last LONG_RUN, across generations) from which a
    #: one-token step does not end a trial.
    LIKELY_TOKENS = 2.5
    #: Tree steps (across generations, RingRates.LONG_RUN at most) the long-run judgement
    #: needs: a request alone on the ring keeps trees that pay over this longer run (``pays``).
    LONG_RUN = RingRates.LONG_RUN
    LONG_RUN_MIN = 8

    def __init__(self, rates: RingRates | None = None) -> None:
        self.rates = rates or RingRates()
        self._backoff = self.FIRST_WAIT
        self._last: list | None = None  # this meter's newest entry in rates' long run
        self.begin()

    @property
    def plain_ms(self) -> float | None:
        """The running mean wall time of a plain lap on this ring."""
        return self.rates.plain_ms

    def begin(self) -> None:
        """A new generation: judge the drafter on this prompt (a trial first)."""
        self._tree: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)
        self._trial_left = self.TRIAL
        self._trial_steps = 0
        self._wait = 0
        self.probes = 0

    def want_tree(self, sharers: int = 1) -> bool:
        """Whether the next step should be a tree step; ``sharers``: requests decoding on
        the ring now, this one included (``pays``)."""
        if self.plain_ms is None:
            return False  # measure one plain lap first: nothing to compare with otherwise
        if self._trial_left > 0:
            return True
        if self._wait > 0:
            self._wait -= 1
            if self._wait == 0:  # probe: a fresh trial, judged on its own steps
                self._tree.clear()
                self._trial_left = self.TRIAL
                self._trial_steps = 0
                self.probes += 1
            return False
        if self.pays(sharers):
            self._backoff = max(self.FIRST_WAIT, self._backoff // 2)
            return True
        self._wait = self._backoff
        self._backoff = min(2 * self._backoff, self.MAX_WAIT)
        return False

    def pays(self, sharers: int = 1) -> bool:
        """Recent tree steps gained more than one token per step and MARGIN times the tokens
        per second of plain laps, in this generation's window or, for a request alone on the
        ring (``sharers`` 1), over the last LONG_RUN tree steps of any generation.

        Why the long run: a good draft model's first steps of an answer often gain 2-3 tokens
        where its later ones gain 20-80 (1.5B/0.5B, 4 stages, 10 ms per hop, code prompts: a
        flow step of 2 tokens took 260 ms against a plain lap's 113). Judged on those first
        steps alone, 6 of 8 generations fell back to plain laps for 9-65 steps, and a
        generation's speed (9-15 tok/s) followed whether its trial happened to win. Why alone
        only: while other requests decode, a tree's rows are their compute too, so a lost
        trial falls back to plain laps as before (4 clients on 4 slots, in one process:
        12.0 and 12.6 tok/s with the gate, 12.5 and 13.7 without it, within this host's
        noise; docs/design.md 5.8)."""
        if not self._tree or self.plain_ms is None:
            return False
        tokens = sum(t for t, _ in self._tree)
        if tokens <= len(self._tree):  # one token per step: what a plain lap gives
            return False
        # Alone, against plain laps taken alone (RingRates). While others decode, a tree
        # step's rows hold up every one of them, as the cost model charges a row (``rate``):
        # its time counts ``sharers`` times.
        plain = self.plain_ms if sharers > 1 else self.rates.plain_ms_alone or self.plain_ms
        if self._beats_plain(tokens, sharers * sum(s for _, s in self._tree), plain):
            return True
        if sharers > 1:
            return False
        steps, tokens, seconds = self.rates.long_run(alone=True)
        return steps >= self.LONG_RUN_MIN and self._beats_plain(tokens, seconds, plain)

    def _beats_plain(self, tokens: int, seconds: float, plain_ms: float | None = None) -> bool:
        plain_ms = plain_ms or self.plain_ms
        assert plain_ms is not None
        return tokens / max(seconds, 1e-9) > self.MARGIN * 1e3 / plain_ms

    def record_plain(self, seconds: float, sharers: int = 1) -> None:
        """A plain lap took ``seconds``; ``sharers``: requests decoding meanwhile, at most."""
        self.rates.record_plain(seconds, alone=sharers <= 1)

    def record_tree(self, tokens: int, seconds: float, sharers: int = 1) -> None:
        """A tree step gained ``tokens`` in ``seconds`` (``sharers`` as for ``record_plain``)."""
        self._tree.append((tokens, seconds))
        self._last = self.rates.record_tree(tokens, seconds, alone=sharers <= 1)
        if self._trial_left > 0:
            self._trial_steps += 1
            # A drafter whose steps usually gain several tokens gets the whole trial even
            # after a miss (1.5B/0.5B, 4 stages, 10 ms hops: a trial lost on a first-step
            # miss on a prompt where the other steps gained 3-37 tokens); one that gains
            # little (retrieval on fresh chat answers, 1.0-1.35 a step) ends it at a miss.
            steps, long_tokens, _ = self.rates.long_run()
            likely = steps >= 4 and long_tokens / steps >= self.LIKELY_TOKENS
            gained_more = (tokens > 1 or likely) and self._trial_steps < self.TRIAL_MAX
            self._trial_left = 1 if gained_more else max(0, self._trial_left - 1)

    def charge_tree(self, seconds: float) -> None:
        """Time spent on tree steps after they ended (draining their rows still in flight)."""
        if self._tree:
            tokens, s = self._tree[-1]
            self._tree[-1] = (tokens, s + seconds)
            if self._last is not None:
                self.rates.charge(self._last, seconds)
