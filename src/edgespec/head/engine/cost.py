"""The engine's cost model (docs/design.md 3.8): verification is not free on a CPU, so the
tree budget comes from measured lap times per batch size and the measured acceptance."""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence

import numpy as np


class CostModel:
    """Chooses the tree budget for the most tokens per second.

    Expected tokens per step for a budget B follow from measured per-rank acceptance: a child
    ranked r among its siblings (by draft score) matches the target with probability a_r
    (counted online, with a prior). Under that model the best tree of B nodes holds the B most
    likely paths, so E[accepted](B) is the sum of the B largest path probabilities (the greedy
    solution of Sequoia's tree-shape problem). Lap time is a + b*rows, fitted online from the
    chain's measured laps (seeded from profiling when given); drafting time per node likewise.

    One per ring, shared by the engines of its slots (docs/design.md 5.8): what it measures
    belongs to the ring and the drafter, not to a slot, so a request starts from every lap
    and draft measured before it on any slot. With a model per slot, one client whose
    requests take the free slots in turn had each slot learn from a quarter of the laps,
    starting from the prior. Its observations may come from several threads at once.
    """

    RANKS = 4

    #: Tree budgets to choose from: B drafted nodes go out as B + 1 rows (the root with
    #: them), so these make laps of 4, 8, 16, 32 and 64 rows. llama.cpp's CPU kernels work
    #: on blocks of rows and a batch just past a block's end pays for a slow remainder: on
    #: the 2-core test host a middle stage of the 1.5B target (Q4_K_M) takes 72 ms for 16
    #: rows but 85 for 17 and 98 for 15, 33 ms for 4 rows but 40 for 5
    #: (``bench/row_cost_curve.py``, docs/design.md 3.8). Budgets 4, 8, ... 64 made every
    #: lap one row past a block: in one A/B run sync at one client took 426 ms a lap with 15
    #: nodes against 497 with 16 and ran at 11.6 tok/s against 10.8
    #: (docs/experiments.md 5).
    BUDGETS = (3, 7, 15, 31, 63)

    def __init__(self, lap_ms: tuple[float, float] = (60.0, 2.0), draft_ms_per_node: float = 0.05,
                 budgets: Sequence[int] = BUDGETS) -> None:
        self.hits = np.array([6.0, 2.0, 1.0, 0.5])  # prior: 60% top-1, ...
        self.tries = np.full(self.RANKS, 10.0)
        self.lap_a, self.lap_b = lap_ms
        self.draft_ms = draft_ms_per_node
        self.budgets = tuple(budgets)
        self._obs: list[tuple[int, float]] = []
        self._lock = threading.Lock()

    def acceptance(self) -> np.ndarray:
        with self._lock:
            return self.hits / self.tries

    def observe_rank(self, rank: int | None, n_children: int) -> None:
        """One verification step: the target matched the child of ``rank`` (0-based) among
        ``n_children`` drafted children, or none of them (rank None)."""
        with self._lock:
            self._observe_rank(rank, n_children)

    def _observe_rank(self, rank: int | None, n_children: int) -> None:
        for r in range(min(n_children, self.RANKS)):
            if rank is not None and r > rank:
                break
            self.tries[r] += 1
            if rank == r:
                self.hits[r] += 1

    def observe_lap(self, rows: int, ms: float, users: int = 1) -> None:
        """A lap of ``rows`` rows took ``ms``. Laps of a request that shared the ring
        (``users`` > 1 at its start or end) are not fitted: they include waiting behind the
        other requests' batches, which ``rate`` charges separately, and that inflated cost
        would stay in the fit once the request is alone again (seen in one of two full
        concurrency-bench runs: after the many-client cells one client's sync request chose
        trees of 16 nodes where the FIFO ring chose 8 for the same prompt, and took 21.2 s
        against 10.4)."""
        if users > 1:
            return
        with self._lock:
            self._obs.append((rows, ms))
            self._obs = self._obs[-64:]
            xs = np.array([o[0] for o in self._obs], float)
            ys = np.array([o[1] for o in self._obs], float)
            if len(set(xs.tolist())) >= 2:
                b, a = np.polyfit(xs, ys, 1)
                self.lap_a, self.lap_b = max(a, 0.1), max(b, 0.0)
            elif len(xs):
                self.lap_a = float(ys.mean()) - self.lap_b * float(xs.mean())

    def expected_tokens(self, budget: int) -> float:
        """E[tokens per step] = E[accepted draft tokens] + 1 bonus, for the best B-node tree."""
        a = self.acceptance()
        heap = [(-a[r], r, 1) for r in range(self.RANKS)]  # (-prob, rank, depth)
        heapq.heapify(heap)
        total = 0.0
        for _ in range(budget):
            if not heap:
                break
            negp, _r, d = heapq.heappop(heap)
            p = -negp
            total += p
            if d < 32:
                for r in range(self.RANKS):
                    heapq.heappush(heap, (-(p * a[r]), r, d + 1))
        return total + 1.0

    def observe_draft(self, nodes: int, ms: float) -> None:
        if nodes > 0:
            with self._lock:
                self.draft_ms = 0.8 * self.draft_ms + 0.2 * (ms / nodes)

    def rate(self, budget: int, users: int = 1) -> float:
        """Predicted tokens per millisecond with a tree of ``budget`` drafted nodes.

        ``users``: requests decoding on the ring at once, this one included. Their batches
        share the stages, so each row this request adds delays the laps of all of them: a
        row is charged ``users`` times its measured cost (the ring's tokens per second, not
        this request's, is what the budget should maximise). One user: the plain model."""
        ms = self.lap_a + users * self.lap_b * (budget + 1) + self.draft_ms * budget
        return (self.expected_tokens(budget) if budget else 1.0) / ms

    def choose(self, users: int = 1) -> int:
        """The budget with the best predicted rate; 0 means drafting does not pay (plain
        decoding, one token per lap, beats every tree at the measured acceptance). More
        users sharing the ring, smaller trees (``rate``)."""
        best = max(self.budgets, key=lambda b: self.rate(b, users))
        return best if self.rate(best, users) > self.rate(0, users) else 0
