"""Mode ``sync``: one drafted tree per lap, verified as a whole on its return; the tree is
sized (0: a plain lap) from the cost model, with a probe every few plain steps.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from edgespec.batch import Sampling
from edgespec.tree import core


class SyncMode:
    """Mode ``sync``: one drafted tree per lap, verified as a whole on its return; the tree is"""

    def _budget(self) -> int:
        """Sync mode: nodes in the next tree (0: a plain step), from the cost model."""
        b = self.fixed_budget or self.cost.choose(self.sharers())
        if b == 0:
            self._plain_steps += 1
            if self._plain_steps >= self.PROBE_EVERY:
                self._plain_steps = 0
                b = min(self.cost.budgets)
        self.stats.budget = b
        self._log_choice("sync", budget=b)
        return b

    #: FlowSpec rows per segment when the budget is automatic. Measured with the 1.5B target
    #: and 0.5B draft on 4 stages at 10 ms per hop (4 HumanEval prompts, x none): 1 row 1.89,
    #: 2 rows 2.03, 3 rows 2.03, 4 rows 1.93. Two rows cost a stage 84 ms of decode instead
    #: of 2 x 50 ms on this CPU; bigger segments keep the ring waiting for the drafter.
    FLOW_SEGMENT = 2

    def _steps_sync(self, root: int, sampling: Sampling) -> Iterator[list[int]]:
        while True:
            budget = self._budget()
            if budget == 0:
                gained = self._plain_step(root, sampling)
                root = gained[-1]
                yield gained
                continue
            users = self.sharers()
            rnd = self._new_tree(root, sampling, budget)
            self._send_rows(rnd, sampling, 1)
            res = self.chain.next_result()
            self.stats.lap_timing.got(res)
            self.stats.laps += 1
            self.cost.observe_lap(rnd.sent_rows, (time.perf_counter() - rnd.t0) * 1e3,
                                  users=max(users, self.sharers()))
            decision = rnd.verifier.feed_targets(res.targets, 0, rows=res.nodes)
            if decision.status != core.ACCEPTED:
                raise RuntimeError("whole-tree verification did not reach a decision")
            gained = self._finish_tree(rnd, decision)
            root = gained[-1]
            yield gained
