"""Mode ``sync``: one drafted tree per lap, verified as a whole on its return; the tree's size
(0: a plain lap) comes from ``TreePolicy.sync_budget``."""

from __future__ import annotations

import time

from edgespec.head.engine.mode import Mode, Steps
from edgespec.sampling import SamplerSettings
from edgespec.tree import core


class SyncMode(Mode):
    """Each step sends one whole tree in one batch and waits for its targets."""

    name = "sync"
    summary = "one drafted tree per lap, verified whole when it returns"

    def steps(self, root: int, sampling: SamplerSettings) -> Steps:
        ctx, policy = self.ctx, self.ctx.policy
        while True:
            users = ctx.sharers()
            budget = policy.sync_budget(users) if ctx.may_draft() else 0
            ctx.req.stats.budget = budget
            ctx.req.stats.probes = policy.probes
            ctx.log_choice("sync", budget=budget)
            t_step = time.perf_counter()
            if budget == 0:
                gained = yield from ctx.plain_step(root, sampling)
                root = gained[-1]
                yield gained
                policy.record_plain(time.perf_counter() - t_step, max(users, ctx.sharers()))
                continue
            rnd = ctx.new_tree(root, sampling, budget)
            ctx.send_rows(rnd, sampling, 1)
            res = yield from ctx.next_result()
            ctx.req.stats.lap_timing.got(res)
            ctx.req.stats.laps += 1
            users = max(users, ctx.sharers())
            policy.observe_lap(rnd.sent_rows, (time.perf_counter() - rnd.t0) * 1e3, users)
            assert rnd.verifier is not None
            rnd.note(res)
            decision = rnd.verifier.feed_targets(res.targets, 0, rows=res.nodes)
            if decision.status != core.ACCEPTED:
                raise RuntimeError("whole-tree verification did not reach a decision")
            gained = ctx.finish_tree(rnd, decision)
            root = gained[-1]
            yield gained
            policy.record_tree(len(gained), time.perf_counter() - t_step, users)
