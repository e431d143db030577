"""Mode ``flow`` (FlowSpec): the tree goes out in small segments, back to back, so every stage
works at once; each segment's targets are verified as they return, rows of rejected branches
are pruned everywhere (also in flight), and whenever no result is waiting the head drafts
further ahead below the accepted frontier (dynamic expansion).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import numpy as np

from edgespec.batch import Sampling
from edgespec.head.engine.inflight import TreeInFlight
from edgespec.tree import core
from edgespec.tree.kvop import KvOp, KvOpCode


class FlowMode:
    """Mode ``flow`` (FlowSpec): the tree goes out in small segments, back to back, so every stage"""

    def _flow_segment(self) -> int:
        """Flow mode: rows per segment (0: a plain step). An explicit budget is spread over
        the stages; otherwise FLOW_SEGMENT while tree steps measurably beat plain laps
        (``GainMeter``: a trial per generation, then probes that back off), else plain laps.
        How far ahead to draft follows the measured acceptance (_ahead_limit)."""
        if self.fixed_budget:
            seg = self._segment_size(self.fixed_budget)
        else:
            seg = self.FLOW_SEGMENT if self.gain.want_tree(self.sharers()) else 0
            self.stats.probes = self.gain.probes
        self.stats.segment = seg
        self.stats.budget = self._ahead_limit() if seg else 0
        self._log_choice("flow", segment=seg, ahead=self.stats.budget)
        return seg

    def _segment_size(self, budget: int) -> int:
        """Rows per FlowSpec segment for an explicit budget: spread over the stages (or over
        ``segments``)."""
        n = self.fixed_segments or max(1, self.chain.n_stages)
        return max(1, math.ceil(budget / n))

    def _steps_flow(self, root: int, sampling: Sampling) -> Iterator[list[int]]:
        stale = self._stale  # lap -> results still to come from decided trees
        gain = self.gain
        while True:
            users = self.sharers()  # requests decoding during the step, at most (gain.py)
            seg = self._flow_segment()
            t_step = time.perf_counter()
            if seg == 0:
                self._drain_stale()  # a plain lap reads the next result: make it its own
                t = time.perf_counter()
                gain.charge_tree(t - t_step)  # the last tree's rows still in flight
                gained = self._plain_step(root, sampling)
                root = gained[-1]
                yield gained
                gain.record_plain(time.perf_counter() - t, max(users, self.sharers()))
                continue
            # Start the ring on the first segment at once; the rest of the tree is drafted
            # while that segment is in flight (below).
            rnd = self._new_tree(root, sampling, seg)
            rnd_chain = self.chain
            self._send_rows(rnd, sampling, 1)
            decision = None
            ready: dict[int, object] = {}  # segment -> result, fed in segment order
            next_seg = 0
            streamed = 0  # accepted tokens of this step already handed out
            try:
                while decision is None:
                    # Never wait idle: while no result is back, draft further below the
                    # accepted frontier and inject it (dynamic expansion).
                    if not self.chain.has_result() and self._draft_ahead(rnd, sampling, seg):
                        continue
                    res = self.chain.next_result()
                    self.stats.lap_timing.got(res)
                    self.stats.laps += 1
                    if res.lap != rnd.lap:
                        stale[res.lap] -= 1  # a decided tree's segment: already pruned
                        continue
                    rnd.outstanding.discard(res.segment)
                    ready[res.segment] = res
                    # A fully pruned segment may answer early (from the stage that dropped
                    # it); the verifier takes rows in order, so feed contiguous segments only.
                    while decision is None and next_seg in ready:
                        r = ready.pop(next_seg)
                        a, b = rnd.seg_rows[next_seg]
                        next_seg += 1
                        rnd.verified_rows = b
                        d = rnd.verifier.feed_targets(r.targets, a, rows=r.nodes)
                        if d.status == core.ACCEPTED:
                            decision = d
                        else:
                            self._prune(rnd, d)
                            # A pending decision's tokens are final: stream them now.
                            if len(d.tokens) > streamed:
                                new = [int(t) for t in d.tokens[streamed:]]
                                streamed = rnd.streamed = len(d.tokens)
                                yield new
                    if decision is None and not rnd.outstanding and next_seg not in ready:
                        raise RuntimeError("flow verification stalled: no segment in flight")
            except GeneratorExit:
                # The caller has all it wants in the middle of a step: forget the step
                # (nothing of it was committed) and drop its rows everywhere. (Unless the
                # chain was replaced after a failure: then there is nothing to clean.)
                if self.chain is not rnd_chain:
                    raise
                if rnd.outstanding:
                    stale[rnd.lap] += len(rnd.outstanding)
                self.chain.prune(range(rnd.sent_rows), lap=rnd.lap)
                self._pending_ops.append(KvOp(KvOpCode.KEEP, 0))
                raise
            # (No observe_lap here: a flow step overlaps many segments, so its duration is
            # not the lap time the sync-mode model needs.)
            if rnd.outstanding:
                # Everything still in flight belongs to a decided tree: drop it on the way.
                stale[rnd.lap] += len(rnd.outstanding)
                self.chain.prune(range(rnd.sent_rows), lap=rnd.lap)
            gained = self._finish_tree(rnd, decision)
            root = gained[-1]
            yield gained[streamed:]
            gain.record_tree(len(gained), time.perf_counter() - t_step,
                             max(users, self.sharers()))

    def _prune(self, rnd: TreeInFlight, d) -> None:
        """After a partial decision: drop rows off the accepted path from batches still in
        flight, and move the step's frontier down the accepted path."""
        alive_before = rnd.tree.alive()[: rnd.tree.n_rows].copy()
        plan = rnd.tree.prune(d)
        dead = np.flatnonzero(alive_before & ~rnd.tree.alive()[: rnd.tree.n_rows])
        if len(dead):
            # Rows die at once everywhere (direct message); their seqs are freed in ring
            # order (pre_ops of the next batch), behind any of their rows still in flight.
            self.chain.prune(dead.tolist(), lap=rnd.lap)
            self.stats.rows_pruned += len(dead)
            self._pending_ops.extend(KvOp.rows(plan.ops))
        rnd.frontier = int(d.path[-1])
        rnd.frontier_tokens = [int(t) for t in d.tokens]
        if self.listeners:
            self._emit({"e": "verify", "lap": rnd.lap, "accepted": [int(r) for r in d.path],
                        "rejected": dead.tolist()})

    #: Draft ahead only while the next row is at least this likely to be needed: by the
    #: measured top-1 acceptance (_ahead_limit) and by the draft's own odds of the path to it.
    #: (10 ms hops, 4 prompts, x none: 0.15 -> 1.89, 0.3 -> 1.89, 0.5 -> 1.79.)
    AHEAD_MIN_P = 0.3
    #: How much less waste each further request decoding allows (_ahead_limit). 1.5B/0.5B,
    #: 4 stages, 10 ms per hop, 4 clients on 4 slots, two reps each (tok/s): 0 -> 15.95,
    #: 14.59; 0.1 -> 16.75, 15.34; 0.25 -> 17.52, 16.78; 0.4 -> 16.21, 15.08; 0.6 -> 15.57,
    #: 15.16 (the rep-to-rep noise is about 1 tok/s). A shrink of 1 - 0.7/k (about 0.37
    #: here) was tried once, with different prompts on the two rings it compared, and taken
    #: out.
    AHEAD_SHARED = 0.25
    #: Draft ahead along the likeliest leaf only (a chain), not best-first over the whole
    #: subtree: siblings were wasted rows more often than saved laps (10 ms hops, 4 prompts,
    #: 1-row segments: 1.89x none with chains, 1.81x best-first, which pruned 43% of the rows
    #: on the worst prompt).
    AHEAD_CHAIN = True

    def _ahead_limit(self) -> int:
        """Unverified rows worth having in flight: the depth k at which a chain of top-1 draft
        guesses, each accepted with the measured rate a, is still wholly accepted with
        probability a**k >= AHEAD_MIN_P (a deeper row is more likely wasted work than not).

        Shrunk, gently, while other requests decode (docs/design.md 5.8): a row wasted then
        is compute taken from them, on a ring that their rows keep busy anyway."""
        a = float(min(max(self.cost.acceptance()[0], 1e-3), 0.999))
        # With k requests decoding, the allowance for waste shrinks by AHEAD_SHARED for
        # each other one (0.3 alone, 0.49 for 2, 0.61 for 3, 0.70 for 4).
        need = 1.0 - (1.0 - self.AHEAD_MIN_P) * (1.0 - self.AHEAD_SHARED) ** (self.sharers() - 1)
        return max(1, min(self.max_depth, int(math.log(need) / math.log(a))))

    def _draft_ahead(self, rnd: TreeInFlight, sampling: Sampling, seg: int) -> bool:
        """Draft up to ``seg`` more nodes below the step's accepted frontier and send them as
        one segment, unless enough unverified rows are in flight already or the caller wants
        no more tokens than those could give. False when nothing was sent."""
        if self.drafter is None:
            return False
        n = rnd.tree.n_rows
        alive = rnd.tree.alive()[:n].astype(bool)
        unverified = np.flatnonzero(alive[rnd.verified_rows:]) + rnd.verified_rows
        ahead = len(unverified)
        if ahead >= self._ahead_limit() or ahead + 1 >= self._room:
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
        dt = self.drafter.propose_under(path, seg, self.max_depth)
        spent = time.perf_counter() - td
        self.stats.draft_s += spent
        if len(dt) == 0:
            return False
        self.cost.observe_draft(len(dt), spent * 1e3)
        self._draft_into(rnd.tree, under, dt)
        rnd.tree.select(seg)
        rnd.expansions += 1
        before = rnd.sent_rows
        self._send_rows(rnd, sampling, 1)
        return rnd.sent_rows > before


# ---------------------------------------------------------------------- glue to the core
