"""Measured gain: does drafting pay on this ring, for this generation, right now?

A cost model predicts; this meter checks. It times every step as the caller sees it (from the
step's start to the moment the caller asks for more, so drafting, verification, pruned rows
and results of decided trees still in flight all count) and compares the tokens per second of
recent tree steps with the wall time of a plain lap (one token, no tree). When trees do not
beat plain laps, the engine decodes plain laps (exactly mode ``none``) and probes with one tree
step now and then, backing off each time the probe loses, so a useless drafter costs about
two tree steps per generation and a useful one is found again when it starts to help (a
prompt that begins to repeat its own text, say). Every generation opens with a trial: its
prompt may suit the drafter where the last one did not.
"""

from __future__ import annotations

from collections import deque


class GainMeter:
    """Chooses between a tree step and a plain step from measured rates.

    ``plain_ms`` (a plain lap's wall time) is a property of the ring and persists across
    generations, and so does the probing interval; each generation (``begin``) opens with a
    trial step judged on its own.
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
    #: Weight of the newest plain lap in the running mean of ``plain_ms``.
    ALPHA = 0.25

    #: Mean tokens per tree step (over the last 32, across generations) from which a
    #: one-token step does not end a trial.
    LIKELY_TOKENS = 2.5

    def __init__(self) -> None:
        self.plain_ms: float | None = None
        self._backoff = self.FIRST_WAIT
        self._history: deque[int] = deque(maxlen=32)  # tokens of recent tree steps
        self.begin()

    def begin(self) -> None:
        """A new generation: judge the drafter on this prompt (a trial first)."""
        self._tree: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)
        self._trial_left = self.TRIAL
        self._trial_steps = 0
        self._wait = 0
        self.probes = 0

    def want_tree(self) -> bool:
        """Whether the next step should be a tree step."""
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
        if self.pays():
            self._backoff = max(self.FIRST_WAIT, self._backoff // 2)
            return True
        self._wait = self._backoff
        self._backoff = min(2 * self._backoff, self.MAX_WAIT)
        return False

    def pays(self) -> bool:
        """Recent tree steps gained more than one token per step and MARGIN times the tokens
        per second of plain laps."""
        if not self._tree or self.plain_ms is None:
            return False
        tokens = sum(t for t, _ in self._tree)
        seconds = sum(s for _, s in self._tree)
        if tokens <= len(self._tree):  # one token per step: what a plain lap gives
            return False
        return tokens / max(seconds, 1e-9) > self.MARGIN * 1e3 / self.plain_ms

    def record_plain(self, seconds: float) -> None:
        ms = seconds * 1e3
        self.plain_ms = ms if self.plain_ms is None else (
            (1 - self.ALPHA) * self.plain_ms + self.ALPHA * ms)

    def record_tree(self, tokens: int, seconds: float) -> None:
        """A tree step gained ``tokens`` in ``seconds``."""
        self._tree.append((tokens, seconds))
        self._history.append(tokens)
        if self._trial_left > 0:
            self._trial_steps += 1
            # A drafter whose steps usually gain several tokens gets the whole trial even
            # after a miss (1.5B/0.5B, 4 stages, 10 ms hops: a trial lost on a first-step
            # miss on a prompt where the other steps gained 3-37 tokens); one that gains
            # little (retrieval on fresh chat answers, 1.0-1.35 a step) ends it at a miss.
            likely = (len(self._history) >= 4
                      and sum(self._history) / len(self._history) >= self.LIKELY_TOKENS)
            gained_more = (tokens > 1 or likely) and self._trial_steps < self.TRIAL_MAX
            self._trial_left = 1 if gained_more else max(0, self._trial_left - 1)

    def charge_tree(self, seconds: float) -> None:
        """Time spent on tree steps after they ended (draining their rows still in flight)."""
        if self._tree:
            tokens, s = self._tree[-1]
            self._tree[-1] = (tokens, s + seconds)
