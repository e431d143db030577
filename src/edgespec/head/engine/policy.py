"""Does a tree pay on this ring now, and how big should it be: the one policy every mode asks
(docs/design.md 6.7-6.8).

Two measurements, one decision each:

- *whether* a step is a tree or a plain lap is measured (``GainMeter``): tree steps are kept
  while their tokens per second, as the caller saw them, beat a plain lap's; otherwise plain
  laps (exactly mode ``none``) with probes that back off. Sync and flow both ask it, so a
  drafter that does not help costs every mode the same few probe steps, and ``auto`` decodes
  at ``none``'s speed then;
- *how big* a tree is comes from the cost model (``CostModel``: lap time per row and
  acceptance per sibling rank, fitted online): sync's budget is the one with the best
  predicted rate; flow sends ``FLOW_SEGMENT`` rows per segment and drafts ahead as far as the
  measured acceptance makes worthwhile (``FlowMode.ahead_limit``);
- flow decodes plain laps while as many requests decode as the ring has stages: they fill
  the pipeline at one row a token already.

A fixed ``budget`` (``EngineConfig.budget``) bypasses both: every step is a tree of that size.
One ``CostModel`` and one ``RingRates`` per ring, shared by its slots; one policy per slot
(its generation's trial and probing state).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from edgespec.head.engine.cost import CostModel
from edgespec.head.engine.gain import GainMeter, RingRates

if TYPE_CHECKING:
    from edgespec.tree import core


class TreePolicy:
    """The tree-or-plain decision and the tree's size, for one slot's generations."""

    #: FlowSpec rows per segment when the budget is automatic: two rows cost a stage less
    #: than two one-row laps on a CPU, bigger segments keep the ring waiting for the drafter
    #: (docs/experiments.md 3).
    FLOW_SEGMENT = 2

    def __init__(self, cost: CostModel | None = None, rates: RingRates | None = None, *,
                 budget: int | None = None, segments: int | None = None) -> None:
        self.cost = cost or CostModel()
        self.gain = GainMeter(rates)
        self.fixed_budget = budget
        self.fixed_segments = segments

    @property
    def probes(self) -> int:
        """Probe trials of the current generation."""
        return self.gain.probes

    def begin(self) -> None:
        """A new generation."""
        self.gain.begin()

    def sync_budget(self, sharers: int = 1) -> int:
        """Drafted nodes in sync's next tree; 0: a plain lap."""
        if self.fixed_budget:
            return self.fixed_budget
        if not self.gain.want_tree(sharers):
            return 0
        # Trees pay as measured; the cost model sizes them (its smallest tree when it would
        # predict none: the measurement outranks the prediction).
        return self.cost.choose(sharers) or min(self.cost.budgets)

    def flow_segment(self, sharers: int, n_stages: int) -> int:
        """Rows per segment of flow's next step; 0: a plain lap. An explicit budget is spread
        over the stages (or over ``segments``)."""
        if self.fixed_budget:
            n = self.fixed_segments or max(1, n_stages)
            return max(1, math.ceil(self.fixed_budget / n))
        if self.pipeline_full(sharers, n_stages):
            return 0
        return self.FLOW_SEGMENT if self.gain.want_tree(sharers) else 0

    @staticmethod
    def pipeline_full(sharers: int, n_stages: int) -> bool:
        """As many requests decode as the ring has stages: plain laps keep every stage busy at
        the fewest rows a token can cost, a tree's rows would delay the others, and every
        request's drafts queue on the head's one draft model (docs/design.md 5.8)."""
        return n_stages > 1 and sharers >= n_stages

    # ---------------------------------------------------------------- measurements

    def observe_path(self, tree: core.TokenTree, path: list[int]) -> None:
        """A decided step: at each node of the accepted ``path``, which sibling rank (by draft
        score) held the target's token, if any (the cost model's acceptance per rank)."""
        n = tree.n_rows
        parents = tree.parents()[:n]
        scores = tree.scores()[:n]
        alive = tree.alive()[:n]
        for node, nxt in zip(path, [*path[1:], None], strict=True):
            kids = np.flatnonzero((parents == node) & alive)
            if not len(kids):
                continue
            kids = kids[np.argsort(-scores[kids], kind="stable")].tolist()
            self.cost.observe_rank(kids.index(nxt) if nxt is not None else None, len(kids))

    def observe_lap(self, rows: int, ms: float, users: int = 1) -> None:
        """A lap of ``rows`` rows took ``ms`` (the cost model's fit)."""
        self.cost.observe_lap(rows, ms, users=users)

    def record_plain(self, seconds: float, sharers: int = 1) -> None:
        """A plain step took ``seconds`` as the caller saw it."""
        self.gain.record_plain(seconds, sharers)

    def record_tree(self, tokens: int, seconds: float, sharers: int = 1) -> None:
        """A tree step gained ``tokens`` in ``seconds`` as the caller saw it."""
        self.gain.record_tree(tokens, seconds, sharers)

    def charge_tree(self, seconds: float) -> None:
        """Time the last tree step cost after it ended (its rows still in flight)."""
        self.gain.charge_tree(seconds)
