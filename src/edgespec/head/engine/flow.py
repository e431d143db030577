"""Mode ``flow`` (FlowSpec): the tree goes out in small segments, back to back, so every stage
works at once; each segment's targets are verified as they return, rows of rejected branches
are pruned everywhere (also in flight), and whenever no result is waiting the head drafts
further ahead below the accepted frontier (dynamic expansion). Whether a step is a tree at all
and its segments' size come from ``TreePolicy.flow_segment``; how far ahead to draft from the
measured acceptance (``ahead_limit``).
"""

from __future__ import annotations

import math
import time

import numpy as np

from edgespec.head.engine.inflight import TreeInFlight
from edgespec.head.engine.mode import POLL, Mode, Steps
from edgespec.sampling import SamplerSettings
from edgespec.tree import core
from edgespec.tree.kvop import KvOp, KvOpCode


class FlowMode(Mode):
    """FlowSpec steps: segments in flight back to back, step-wise verification, pruning in
    flight and dynamic expansion below the accepted frontier."""

    name = "flow"
    summary = ("FlowSpec: the tree streams through the ring in segments, verified step by "
               "step, pruned and expanded in flight")

    #: Draft ahead only while the next row is at least this likely to be needed: by the
    #: measured top-1 acceptance (``ahead_limit``) and by the draft's own odds of the path
    #: to it (docs/experiments.md 3).
    AHEAD_MIN_P = 0.3
    #: How much less waste each further request decoding allows (``ahead_limit``;
    #: docs/experiments.md 8).
    AHEAD_SHARED = 0.25
    #: Draft ahead along the likeliest leaf only (a chain), not best-first over the whole
    #: subtree: siblings were wasted rows more often than saved laps (docs/experiments.md 3).
    AHEAD_CHAIN = True

    def steps(self, root: int, sampling: SamplerSettings) -> Steps:
        ctx, policy = self.ctx, self.ctx.policy
        stale = ctx.stale  # lap -> results still to come from decided trees
        while True:
            users = ctx.sharers()  # requests decoding during the step, at most
            seg = policy.flow_segment(users, ctx.chain.n_stages) if ctx.may_draft() else 0
            ctx.req.stats.probes = policy.probes
            ctx.req.stats.segment = seg
            ctx.req.stats.budget = self.ahead_limit() if seg else 0
            ctx.log_choice("flow", segment=seg, ahead=ctx.req.stats.budget)
            t_step = time.perf_counter()
            if seg == 0:
                # a plain lap reads the next result: make it its own
                yield from ctx.drain_stale()
                t = time.perf_counter()
                policy.charge_tree(t - t_step)  # the last tree's rows still in flight
                gained = yield from ctx.plain_step(root, sampling)
                root = gained[-1]
                yield gained
                policy.record_plain(time.perf_counter() - t, max(users, ctx.sharers()))
                continue
            # Start the ring on the first segment at once; the rest of the tree is drafted
            # while that segment is in flight (below).
            rnd = ctx.new_tree(root, sampling, seg)
            rnd_chain = ctx.chain
            ctx.send_rows(rnd, sampling, 1)
            decision = None
            ready: dict[int, object] = {}  # segment -> result, fed in segment order
            next_seg = 0
            streamed = 0  # accepted tokens of this step already handed out
            try:
                while decision is None:
                    # Never wait idle: while no result is back, draft further below the
                    # accepted frontier and inject it (dynamic expansion).
                    if not (yield POLL) and self.draft_ahead(rnd, sampling, seg):
                        continue
                    res = yield from ctx.next_result()
                    ctx.req.stats.lap_timing.got(res)
                    ctx.req.stats.laps += 1
                    if res.lap != rnd.lap:
                        stale[res.lap] -= 1  # a decided tree's segment: already pruned
                        continue
                    rnd.outstanding.discard(res.segment)
                    ready[res.segment] = res
                    # A fully pruned segment may answer early (from the stage that dropped
                    # it); the verifier takes rows in order, so feed contiguous segments only.
                    while decision is None and next_seg in ready:
                        r = ready.pop(next_seg)
                        a, _b = rnd.seg_rows[next_seg]
                        next_seg += 1
                        rnd.verified_rows = _b
                        assert rnd.verifier is not None
                        rnd.note(r)
                        d = rnd.verifier.feed_targets(r.targets, a, rows=r.nodes)
                        if d.status == core.ACCEPTED:
                            decision = d
                        else:
                            self.prune(rnd, d)
                            # A pending decision's tokens are final: stream them now.
                            if len(d.tokens) > streamed:
                                ctx.req.scores.path(rnd, d.path, streamed, len(d.tokens))
                                new = [int(t) for t in d.tokens[streamed:]]
                                streamed = rnd.streamed = len(d.tokens)
                                yield new
                    if decision is None and not rnd.outstanding and next_seg not in ready:
                        raise RuntimeError("flow verification stalled: no segment in flight")
            except GeneratorExit:
                # The caller has all it wants in the middle of a step: forget the step
                # (nothing of it was committed) and drop its rows everywhere. (Unless the
                # chain was replaced after a failure: then there is nothing to clean.)
                if ctx.chain is not rnd_chain:
                    raise
                if rnd.outstanding:
                    stale[rnd.lap] += len(rnd.outstanding)
                ctx.chain.prune(range(rnd.sent_rows), lap=rnd.lap)
                ctx.pending_ops.append(KvOp(KvOpCode.KEEP, 0))
                raise
            # (No lap observed here: a flow step overlaps many segments, so its duration is
            # not the lap time the cost model fits.)
            if rnd.outstanding:
                # Everything still in flight belongs to a decided tree: drop it on the way.
                stale[rnd.lap] += len(rnd.outstanding)
                ctx.chain.prune(range(rnd.sent_rows), lap=rnd.lap)
            gained = ctx.finish_tree(rnd, decision)
            root = gained[-1]
            yield gained[streamed:]
            policy.record_tree(len(gained), time.perf_counter() - t_step,
                               max(users, ctx.sharers()))

    def prune(self, rnd: TreeInFlight, d: core.Decision) -> None:
        """After a partial decision: drop rows off the accepted path from batches still in
        flight, and move the step's frontier down the accepted path."""
        ctx = self.ctx
        alive_before = rnd.tree.alive()[: rnd.tree.n_rows].copy()
        plan = rnd.tree.prune(d)
        dead = np.flatnonzero(alive_before & ~rnd.tree.alive()[: rnd.tree.n_rows])
        if len(dead):
            # Rows die at once everywhere (direct message); their seqs are freed in ring
            # order (pre_ops of the next batch), behind any of their rows still in flight.
            ctx.chain.prune(dead.tolist(), lap=rnd.lap)
            ctx.req.stats.rows_pruned += len(dead)
            ctx.pending_ops.extend(KvOp.rows(plan.ops))
        rnd.frontier = int(d.path[-1])
        rnd.frontier_tokens = [int(t) for t in d.tokens]
        if ctx.listeners:
            ctx.emit({"e": "verify", "lap": rnd.lap, "accepted": [int(r) for r in d.path],
                      "rejected": dead.tolist()})

    def ahead_limit(self) -> int:
        """Unverified rows worth having in flight: the depth k at which a chain of top-1 draft
        guesses, each accepted with the measured rate a, is still wholly accepted with
        probability a**k >= AHEAD_MIN_P (a deeper row is more likely wasted work than not).

        Shrunk, gently, while other requests decode (docs/design.md 6.5): a row wasted then
        is compute taken from them, on a ring that their rows keep busy anyway."""
        ctx = self.ctx
        a = float(min(max(ctx.policy.cost.acceptance()[0], 1e-3), 0.999))
        # With k requests decoding, the allowance for waste shrinks by AHEAD_SHARED for
        # each other one (0.3 alone, 0.49 for 2, 0.61 for 3, 0.70 for 4).
        need = 1.0 - (1.0 - self.AHEAD_MIN_P) * (1.0 - self.AHEAD_SHARED) ** (ctx.sharers() - 1)
        return max(1, min(ctx.max_depth, int(math.log(need) / math.log(a))))

    def draft_ahead(self, rnd: TreeInFlight, sampling: SamplerSettings, seg: int) -> bool:
        """Draft up to ``seg`` more nodes below the step's accepted frontier and send them as
        one segment, unless enough unverified rows are in flight already or the caller wants
        no more tokens than those could give. False when nothing was sent."""
        ctx = self.ctx
        if ctx.req.drafter is None:
            return False
        n = rnd.tree.n_rows
        alive = rnd.tree.alive()[:n].astype(bool)
        unverified = np.flatnonzero(alive[rnd.verified_rows:]) + rnd.verified_rows
        ahead = len(unverified)
        if ahead >= self.ahead_limit() or ahead + 1 >= ctx.req.room:
            return False
        under, path = rnd.frontier, list(rnd.frontier_tokens)
        if ahead:
            parents = rnd.tree.parents()[:n]
            has_child = np.zeros(n, bool)
            up = parents[unverified]
            has_child[up[up >= 0]] = True
            leaves = unverified[~has_child[unverified]]
            scores = rnd.tree.scores()
            best_leaf = max(leaves.tolist(), key=lambda i: float(scores[i]), default=-1)
            # The draft's own odds that the likeliest leaf in flight is reached from the
            # frontier: below AHEAD_MIN_P, rows drafted under it are probably wasted.
            if (best_leaf >= 0 and
                    math.exp(float(scores[best_leaf]) - float(scores[rnd.frontier]))
                    < self.AHEAD_MIN_P):
                return False
            if self.AHEAD_CHAIN and best_leaf >= 0:
                tokens = rnd.tree.tokens()
                below: list[int] = []
                walk = best_leaf
                while walk != rnd.frontier and walk >= 0:
                    below.append(int(tokens[walk]))
                    walk = int(parents[walk])
                if walk == rnd.frontier:
                    under, path = best_leaf, path + below[::-1]
        td = time.perf_counter()
        dt = ctx.req.drafter.propose_under(path, seg, ctx.max_depth)
        spent = time.perf_counter() - td
        ctx.req.stats.draft_s += spent
        if len(dt) == 0:
            return False
        ctx.policy.cost.observe_draft(len(dt), spent * 1e3)
        ctx.draft_into(rnd.tree, under, dt)
        rnd.tree.select(seg)
        rnd.expansions += 1
        before = rnd.sent_rows
        ctx.send_rows(rnd, sampling, 1)
        return rnd.sent_rows > before
