"""Mode ``none``: pipelined autoregressive decoding, one token per lap (the baseline), and the
plain lap the tree modes fall back to.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from edgespec.batch import Batch, Sampling, SeqIds


class NoneMode:
    """Mode ``none``: pipelined autoregressive decoding, one token per lap (the baseline), and the"""

    def _steps_none(self, root: int, sampling: Sampling) -> Iterator[list[int]]:
        while True:
            gained = self._plain_step(root, sampling, tell_drafter=False)
            root = gained[-1]
            yield gained

    # ------------------------------------------------------------------ trees

    PROBE_EVERY = 8  # plain steps between two probing trees, so acceptance stays measured

    def _plain_step(self, root: int, sampling: Sampling, tell_drafter: bool = True
                     ) -> list[int]:
        """One token, no tree: mode ``none``, or a tree mode whose cost model found that
        drafting does not pay right now (then the drafter still learns the token)."""
        pos = len(self.history)
        users = self.sharers()
        t = time.perf_counter()
        self._submit(Batch(np.array([root], np.int32), np.array([pos], np.int32), SeqIds.single(1),
                           np.zeros(1, np.int32), np.ones(1, bool), lap=self._new_lap(),
                           sampling=sampling))
        res = self.chain.next_result()
        self.stats.lap_timing.got(res)
        waited = time.perf_counter() - t
        self.cost.observe_lap(1, waited * 1e3, users=max(users, self.sharers()))
        self.stats.plain_wait_s += waited
        self.stats.laps += 1
        self.stats.steps += 1
        self.stats.plain_steps += 1
        self.stats.plain_laps += 1
        self.stats.accepted_hist[1] += 1
        self._commit([root])
        token = int(res.targets[0])
        if self.listeners:
            self._emit({"e": "plain", "lap": int(res.lap), "root": int(root), "token": token})
        if tell_drafter and self.drafter is not None:
            td = time.perf_counter()
            self.drafter.accept([token])
            self.stats.draft_s += time.perf_counter() - td
        return [token]
