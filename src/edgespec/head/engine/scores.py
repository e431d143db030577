"""The log probabilities of the tokens a generation gains (``ScoreQueue``), when its request
asks for them (``Sampling.logprobs``): the last stage scores every wanted row's target
(``batch.TargetScores``); a step queues those of the rows its tokens came from, in order
(token k of a step is the target of its path's row k, the root first), and each chunk the
engine hands out takes its own (docs/design.md 6.4, "What the draw is made from")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edgespec.batch import Result
from edgespec.head.engine.inflight import TreeInFlight


class ScoreQueue:
    """Scores of tokens gained and not yet handed out; ``last``: those of the last chunk."""

    def __init__(self, wanted: bool = False) -> None:
        self.wanted = wanted
        self._queue: list[Any] = []
        self.last: list[Any] | None = None

    def plain(self, res: Result) -> None:
        """A plain lap's (or the prefill's) one token: its result's one row."""
        if self.wanted:
            self._queue.append(None if res.scores is None else res.scores.entry(0))

    def path(self, rnd: TreeInFlight, rows: Sequence[int], start: int, stop: int) -> None:
        """Tokens ``[start, stop)`` of a tree step, token k the target of ``rows[k]``."""
        if self.wanted:
            for r in rows[start:stop]:
                scores, i = rnd.scores[int(r)]
                self._queue.append(scores.entry(i))

    def take(self, handed: int, gained: int) -> None:
        """A chunk of ``gained`` tokens, of which the first ``handed`` go out (max_tokens)."""
        if self.wanted:
            self.last = self._queue[:handed]
            del self._queue[:gained]
