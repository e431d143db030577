"""The speculative engine on the head: drafts trees, drives laps through the chain, verifies,
and plans the KV rollback every stage applies.

Modes (``mode=``):

- ``none``: pipelined autoregressive decoding, one token per lap (the baseline).
- ``sync``: one drafted tree per lap, verified as a whole on its return.
- ``flow`` (FlowSpec): the tree goes out in small segments, back to back, so every stage works
  at once; each segment's targets are verified as they return (step-wise), rows of rejected
  branches are pruned everywhere (also in flight), and whenever no result is waiting the head
  drafts further ahead below the accepted frontier and injects that too (dynamic expansion),
  as far ahead as the measured acceptance makes worthwhile. A round ends where the target's
  token was not drafted; the next tree starts from it at once.
- ``auto``: ``flow`` when the chain has several stages and a drafter exists, else ``sync``
  with a drafter, else ``none``.

Unless the budget is fixed, ``flow`` decodes a tree only while trees measurably pay: each
generation starts with a short trial, then tree rounds continue only while their tokens per
second beat a plain lap's, else plain laps (exactly mode ``none``) with probes that back off
(``GainMeter``). ``sync`` sizes its tree (0: a plain lap) from the cost model, with a probe every
few plain rounds.

KV discipline (docs/design.md 3): committed tokens live in llama.cpp sequence 0 on every
stage. A tree's root is the last accepted token, not yet in KV; every tree row carries the
seq ids of the leaves below it, and each leaf seq first receives the committed prefix. After a
decision the accepted path is copied into sequence 0 and every other sequence is dropped:
masked rollback, nothing recomputed. Those operations travel as ``pre_ops`` of the next batch,
so they reach each stage in order behind the rows they clean up.
"""

from __future__ import annotations

import heapq
import logging
import math
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgespec import core
from edgespec.chain import Batch, Chain, Sampling
from edgespec.laps import LapTimes
from edgespec.spec.drafters import Drafter, DraftTree
from edgespec.spec.gain import GainMeter
from edgespec.wire import KvOp, KvOpCode

log = logging.getLogger(__name__)

MODES = ("none", "sync", "flow", "auto")


@dataclass
class GenerationStats:
    """What one generation cost and gained."""

    mode: str = "none"
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed (the rest came from KV reuse)
    tokens: int = 0
    laps: int = 0  # verification results consumed (segments in flow mode)
    rounds: int = 0  # trees decided
    accepted_hist: Counter = field(default_factory=Counter)  # tokens gained per round -> count
    draft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    rows_sent: int = 0
    rows_pruned: int = 0
    budget: int = 0
    segment: int = 0
    recoveries: int = 0  # ring rebuilds after a node loss during this generation
    plain_rounds: int = 0  # rounds decoded as a plain lap (no tree): all of them in mode none
    probes: int = 0  # flow: trials of tree rounds after drafting had stopped paying
    # Plain laps: time from handing the batch to the chain to its result. What is left of
    # decode_s (in mode none) is the head's own work per token: engine, API, caller.
    plain_wait_s: float = 0.0
    lap_timing: LapTimes = field(default_factory=LapTimes)  # docs/design.md 8.1

    def merged(self, earlier: GenerationStats | None) -> GenerationStats:
        """These statistics with an earlier part of the same generation added in."""
        if earlier is None:
            return self
        out = GenerationStats(**{**self.__dict__, "accepted_hist": Counter(self.accepted_hist)})
        out.accepted_hist.update(earlier.accepted_hist)
        out.prompt_tokens = earlier.prompt_tokens
        for name in ("prefill_tokens", "laps", "rounds", "draft_s", "prefill_s", "decode_s",
                     "rows_sent", "rows_pruned", "recoveries", "plain_rounds", "probes",
                     "plain_wait_s"):
            setattr(out, name, getattr(out, name) + getattr(earlier, name))
        out.lap_timing = self.lap_timing.merged(earlier.lap_timing)
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean tokens gained per round (accepted draft tokens + the bonus token)."""
        n = sum(self.accepted_hist.values())
        return sum(k * v for k, v in self.accepted_hist.items()) / n if n else 0.0

    def as_dict(self) -> dict:
        return {
            "mode": self.mode, "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens, "tokens": self.tokens, "laps": self.laps,
            "rounds": self.rounds, "mean_accepted_per_round": round(self.mean_accepted, 3),
            "accepted_hist": dict(sorted(self.accepted_hist.items())),
            "draft_ms": round(self.draft_s * 1e3, 2), "prefill_ms": round(self.prefill_s * 1e3, 2),
            "decode_ms": round(self.decode_s * 1e3, 2),
            "tokens_per_s": round(self.tokens_per_s, 3), "rows_sent": self.rows_sent,
            "rows_pruned": self.rows_pruned, "budget": self.budget, "segment": self.segment,
            "recoveries": self.recoveries, "plain_rounds": self.plain_rounds,
            "probes": self.probes,
            "plain_lap_ms": round(self.plain_wait_s * 1e3 / self.plain_rounds, 2)
            if self.plain_rounds else None,
            "lap_timing": self.lap_timing.as_dict(),
        }


class CostModel:
    """Chooses the tree budget for the most tokens per second.

    Expected tokens per round for a budget B follow from measured per-rank acceptance: a child
    ranked r among its siblings (by draft score) matches the target with probability a_r
    (counted online, with a prior). Under that model the best tree of B nodes holds the B most
    likely paths, so E[accepted](B) is the sum of the B largest path probabilities (the greedy
    solution of Sequoia's tree-shape problem). Lap time is a + b*rows, fitted online from the
    chain's measured laps (seeded from profiling when given); drafting time per node likewise.
    """

    RANKS = 4

    def __init__(self, lap_ms: tuple[float, float] = (60.0, 2.0), draft_ms_per_node: float = 0.05,
                 budgets: Sequence[int] = (4, 8, 16, 32, 64)) -> None:
        self.hits = np.array([6.0, 2.0, 1.0, 0.5])  # prior: 60% top-1, ...
        self.tries = np.full(self.RANKS, 10.0)
        self.lap_a, self.lap_b = lap_ms
        self.draft_ms = draft_ms_per_node
        self.budgets = tuple(budgets)
        self._obs: list[tuple[int, float]] = []

    def acceptance(self) -> np.ndarray:
        return self.hits / self.tries

    def observe_rank(self, rank: int | None, n_children: int) -> None:
        """One verification step: the target matched the child of ``rank`` (0-based) among
        ``n_children`` drafted children, or none of them (rank None)."""
        for r in range(min(n_children, self.RANKS)):
            if rank is not None and r > rank:
                break
            self.tries[r] += 1
            if rank == r:
                self.hits[r] += 1

    def observe_lap(self, rows: int, ms: float) -> None:
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
        """E[tokens per round] = E[accepted draft tokens] + 1 bonus, for the best B-node tree."""
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
            self.draft_ms = 0.8 * self.draft_ms + 0.2 * (ms / nodes)

    def rate(self, budget: int) -> float:
        """Predicted tokens per millisecond with a tree of ``budget`` drafted nodes."""
        ms = self.lap_a + self.lap_b * (budget + 1) + self.draft_ms * budget
        return (self.expected_tokens(budget) if budget else 1.0) / ms

    def choose(self) -> int:
        """The budget with the best predicted rate; 0 means drafting does not pay (plain
        decoding, one token per lap, beats every tree at the measured acceptance)."""
        best = max(self.budgets, key=self.rate)
        return best if self.rate(best) > self.rate(0) else 0


@dataclass
class _Round:
    """State of one tree (lap id) while its segments are in flight."""

    lap: int
    tree: core.TokenTree
    verifier: core.Verification | None
    outstanding: set[int] = field(default_factory=set)  # segment ids not yet answered
    sent_rows: int = 0
    next_segment: int = 0
    t0: float = 0.0
    expansions: int = 0
    seg_rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    streamed: int = 0  # accepted tokens already handed out before the round's decision
    verified_rows: int = 0  # rows [0, verified_rows) were fed to the verifier
    frontier: int = 0  # deepest accepted node so far (flow: expansion goes below it)
    frontier_tokens: list[int] = field(default_factory=list)  # accepted tokens down to it


class SpecEngine:
    """Drives generations over a ``Chain``; owns the committed history (KV sequence 0)."""

    def __init__(self, chain: Chain, *, drafter: Drafter | None = None, n_ctx: int = 4096,
                 is_eog: Callable[[int], bool] = lambda t: False, budget: int | None = None,
                 max_depth: int = 12, segments: int | None = None, prefill_chunk: int = 256,
                 cost: CostModel | None = None) -> None:
        self.chain = chain
        self.drafter = drafter
        self.n_ctx = n_ctx
        self.is_eog = is_eog
        self.fixed_budget = budget
        self.max_depth = max_depth
        self.fixed_segments = segments
        self.prefill_chunk = prefill_chunk
        self.cost = cost or CostModel()
        self.gain = GainMeter()
        self.history: list[int] = []  # tokens committed in KV sequence 0 on every stage
        self.stats = GenerationStats()
        # Lap ids name batches on every stage (pruning remembers recent laps): start each head
        # somewhere random so a new head on the same stages never reuses a recent lap id.
        self._lap = secrets.randbits(30)
        # A new head knows nothing of what the stages hold: its first batch starts from an
        # empty cache (ordered ahead of that batch like any other KV operation).
        self._pending_ops: list[KvOp] = [KvOp(KvOpCode.RM, 0, -1, -1), KvOp(KvOpCode.KEEP, 0)]
        self._stale: Counter = Counter()  # lap -> results of decided trees still in flight
        self._plain_rounds = 0
        self._room = 0
        self._last_choice: tuple | None = None
        # Observers of tree events (the server's live view); empty: no event is even built.
        self.listeners: list[Callable[[dict], None]] = []

    # ------------------------------------------------------------------ public

    def reset(self) -> None:
        """Drop every stage's KV (all sequences) and forget the history."""
        self._pending_ops = []
        self.chain.kv([KvOp(KvOpCode.RM, 0, -1, -1), KvOp(KvOpCode.KEEP, 0)])
        self.history = []

    def resolve_mode(self, mode: str) -> str:
        if mode not in MODES:
            raise ValueError(f"spec mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "auto":
            if self.drafter is None:
                return "none"
            return "flow" if self.chain.n_stages > 1 else "sync"
        if mode in ("sync", "flow") and self.drafter is None:
            raise ValueError(f"spec={mode!r} needs a drafter; this ring has none")
        return mode

    def replace_chain(self, chain: Chain) -> None:
        """Continue on another chain (after a node loss): its stages hold nothing yet."""
        self.chain = chain
        self.history = []
        self._stale.clear()
        self._pending_ops = [KvOp(KvOpCode.RM, 0, -1, -1), KvOp(KvOpCode.KEEP, 0)]

    def run(self, prompt: Sequence[int], *, max_tokens: int, sampling: Sampling,
            mode: str = "auto", cancel: threading.Event | None = None,
            replay: int = 0) -> Iterator[list[int]]:
        """Generate after ``prompt``; yields the tokens gained by each round, in order.

        Stops after an end-of-generation token (which is yielded), ``max_tokens`` tokens, or
        at the next round once ``cancel`` is set. ``replay``: the last ``replay`` tokens before
        the prompt's last one are recomputed one per batch, as they were first decoded, so a
        generation resumed on a rebuilt ring sees the same numbers as the original.
        """
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        if len(prompt) + max_tokens > self.n_ctx:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                             f"exceeds the context size {self.n_ctx}")
        mode = self.resolve_mode(mode)
        self.stats = GenerationStats(mode=mode, prompt_tokens=len(prompt))
        self.gain.begin()
        t0 = time.perf_counter()
        root = self._prefill(prompt, singles=replay)
        self.stats.prefill_s = time.perf_counter() - t0
        if self.drafter is not None and mode != "none":
            td = time.perf_counter()
            self.drafter.begin(prompt)
            self.stats.draft_s += time.perf_counter() - td
        t1 = time.perf_counter()
        produced = 0
        self._room = max_tokens  # tokens the caller still wants (flow stops expanding past it)
        failed = False
        rounds = {"none": self._rounds_none, "sync": self._rounds_sync,
                  "flow": self._rounds_flow}[mode](root, sampling)
        try:
            for chunk in rounds:
                chunk = chunk[: max_tokens - produced]
                eog = next((i for i, t in enumerate(chunk) if self.is_eog(t)), None)
                if eog is not None:
                    chunk = chunk[: eog + 1]
                produced += len(chunk)
                self._room = max_tokens - produced
                self.stats.tokens = produced
                yield chunk
                if eog is not None or produced >= max_tokens:
                    break
                if cancel is not None and cancel.is_set():
                    break
        except GeneratorExit:
            raise
        except BaseException:
            failed = True  # the chain may be gone: do not wait on it
            raise
        finally:
            self.stats.decode_s = time.perf_counter() - t1
            self.stats.lap_timing.log(log)  # the lap-timing view with -v (DEBUG)
            if not failed:
                # Close the round generator now (not at garbage collection): a round cut
                # short registers its batches in flight, which are drained right after.
                rounds.close()
                self._flush_ops()

    # ------------------------------------------------------------------ prefill

    def _prefill(self, prompt: list[int], singles: int = 0) -> int:
        """Bring KV sequence 0 to ``prompt[:-1]``, reusing the longest common prefix with what
        is already committed; returns the root (the last prompt token, not yet in KV). The
        last ``singles`` tokens go one per batch (see ``run``'s ``replay``)."""
        keep = 0
        limit = min(len(self.history), len(prompt) - 1)
        while keep < limit and self.history[keep] == prompt[keep]:
            keep += 1
        if keep < len(self.history):
            self._pending_ops.append(KvOp(KvOpCode.RM, 0, keep, -1))
            del self.history[keep:]
        todo = prompt[keep:-1]
        self.stats.prefill_tokens = len(todo) + 1
        n_bulk = max(0, len(todo) - max(0, singles))
        chunks = [todo[off: min(off + self.prefill_chunk, n_bulk)]
                  for off in range(0, n_bulk, self.prefill_chunk)]
        chunks += [[t] for t in todo[n_bulk:]]
        start = keep
        for part in chunks:
            n = len(part)
            pos = np.arange(start, start + n, dtype=np.int32)
            start += n
            # No row is wanted: prefill only fills KV. Chunks stream back to back through the
            # stages, so a long prompt is pipelined across the ring.
            self._submit(Batch(np.array(part, np.int32), pos, [[0]] * n,
                               np.arange(n, dtype=np.int32), np.zeros(n, bool), lap=self._new_lap()))
        for _ in chunks:
            self.chain.next_result()
        self.history.extend(todo)
        return prompt[-1]

    # ------------------------------------------------------------------ helpers

    def _new_lap(self) -> int:
        self._lap = (self._lap + 1) & 0x7FFFFFFF
        return self._lap

    def _submit(self, batch: Batch) -> None:
        if self._pending_ops:
            batch.pre_ops = self._pending_ops + list(batch.pre_ops)
            self._pending_ops = []
        self.stats.rows_sent += len(batch)
        self.stats.lap_timing.sent(batch)
        self.chain.submit(batch)

    def _drain_stale(self) -> None:
        """Consume results of decided trees still in flight, so the next caller of
        ``next_result`` gets its own."""
        while sum(self._stale.values()) > 0:
            res = self.chain.next_result()
            self.stats.lap_timing.got(res)
            if self._stale[res.lap] <= 0:
                raise RuntimeError(f"unexpected result for lap {res.lap} while draining")
            self._stale[res.lap] -= 1
        self._stale.clear()

    def _flush_ops(self) -> None:
        self._drain_stale()
        if self._pending_ops:
            ops, self._pending_ops = self._pending_ops, []
            self.chain.kv(ops)

    def _commit(self, tokens: Sequence[int]) -> None:
        self.history.extend(int(t) for t in tokens)

    # ------------------------------------------------------------------ none

    def _rounds_none(self, root: int, sampling: Sampling) -> Iterator[list[int]]:
        while True:
            gained = self._plain_round(root, sampling, tell_drafter=False)
            root = gained[-1]
            yield gained

    # ------------------------------------------------------------------ trees

    PROBE_EVERY = 8  # plain rounds between two probing trees, so acceptance stays measured

    def _budget(self) -> int:
        """Sync mode: nodes in the next tree (0: a plain round), from the cost model."""
        b = self.fixed_budget or self.cost.choose()
        if b == 0:
            self._plain_rounds += 1
            if self._plain_rounds >= self.PROBE_EVERY:
                self._plain_rounds = 0
                b = min(self.cost.budgets)
        self.stats.budget = b
        self._log_choice("sync", budget=b)
        return b

    #: FlowSpec rows per segment when the budget is automatic. Measured with the 1.5B target
    #: and 0.5B draft on 4 stages at 10 ms per hop (4 HumanEval prompts, x none): 1 row 1.89,
    #: 2 rows 2.03, 3 rows 2.03, 4 rows 1.93. Two rows cost a stage 84 ms of decode instead
    #: of 2 x 50 ms on this CPU; bigger segments keep the ring waiting for the drafter.
    FLOW_SEGMENT = 2

    def _flow_segment(self) -> int:
        """Flow mode: rows per segment (0: a plain round). An explicit budget is spread over
        the stages; otherwise FLOW_SEGMENT while tree rounds measurably beat plain laps
        (``GainMeter``: a trial per generation, then probes that back off), else plain laps.
        How far ahead to draft follows the measured acceptance (_ahead_limit)."""
        if self.fixed_budget:
            seg = self._segment_size(self.fixed_budget)
        else:
            seg = self.FLOW_SEGMENT if self.gain.want_tree() else 0
            self.stats.probes = self.gain.probes
        self.stats.segment = seg
        self.stats.budget = self._ahead_limit() if seg else 0
        self._log_choice("flow", segment=seg, ahead=self.stats.budget)
        return seg

    def _log_choice(self, mode: str, **choice: int) -> None:
        """Log the cost model's tree sizing whenever it changes."""
        key = (mode, tuple(sorted(choice.items())))
        if key != self._last_choice:
            self._last_choice = key
            log.debug("%s sizing: %s (top-1 acceptance %.2f, lap %.1f ms + %.2f ms/row, "
                     "draft %.1f ms/node)", mode,
                     ", ".join(f"{k} {v}" for k, v in choice.items()),
                     float(self.cost.acceptance()[0]), self.cost.lap_a, self.cost.lap_b,
                     self.cost.draft_ms)

    def _plain_round(self, root: int, sampling: Sampling, tell_drafter: bool = True
                     ) -> list[int]:
        """One token, no tree: mode ``none``, or a tree mode whose cost model found that
        drafting does not pay right now (then the drafter still learns the token)."""
        pos = len(self.history)
        t = time.perf_counter()
        self._submit(Batch(np.array([root], np.int32), np.array([pos], np.int32), [[0]],
                           np.zeros(1, np.int32), np.ones(1, bool), lap=self._new_lap(),
                           sampling=sampling))
        res = self.chain.next_result()
        self.stats.lap_timing.got(res)
        waited = time.perf_counter() - t
        self.cost.observe_lap(1, waited * 1e3)
        self.stats.plain_wait_s += waited
        self.stats.laps += 1
        self.stats.rounds += 1
        self.stats.plain_rounds += 1
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

    def _draft_into(self, tree: core.TokenTree, under_node: int, dt: DraftTree) -> None:
        """Add a drafter's nodes below ``under_node`` (add_nodes: a parent >= 0 is a tree
        node, -(j+1) is entry j of the same call)."""
        if len(dt) == 0:
            return
        parents = np.where(dt.parents < 0, under_node, -(dt.parents.astype(np.int64) + 1))
        tree.add_nodes(parents.astype(np.int32), dt.tokens, dt.logprobs.astype(np.float64))

    def _new_tree(self, root: int, sampling: Sampling, budget: int) -> _Round:
        assert self.drafter is not None
        tree = core.TokenTree(root, len(self.history))
        td = time.perf_counter()
        dt = self.drafter.propose(root, budget, self.max_depth)
        spent = time.perf_counter() - td
        self.stats.draft_s += spent
        self.cost.observe_draft(len(dt), spent * 1e3)
        self._draft_into(tree, 0, dt)
        tree.select(budget)
        return _Round(self._new_lap(), tree, None, t0=time.perf_counter())

    def _send_rows(self, rnd: _Round, sampling: Sampling, n_segments: int) -> None:
        """Place the tree's pending nodes as rows and send them as ``n_segments`` segments."""
        ordered = rnd.tree.order()
        start, stop = int(ordered.start), int(ordered.stop)
        if stop <= start:
            return
        tokens_all, parents_all = rnd.tree.structure()
        if rnd.verifier is None:
            rnd.verifier = core.Verification(sampling_config(sampling), rnd.tree.root_pos,
                                             tokens_all, parents_all)
        else:
            rnd.verifier.extend(tokens_all[start:stop], parents_all[start:stop], start)
        kv = [_op_from_core(op) for op in np.asarray(ordered.ops).reshape(-1, 5)]
        count = max(1, min(n_segments, stop - start))
        bounds = rnd.tree.segment_bounds(count=count, start=start, stop=stop).tolist()
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            lay = rnd.tree.layout(a, b)
            seq_ids = [lay.seq_ids[i, : lay.n_seq[i]].tolist() for i in range(b - a)]
            seg = rnd.next_segment
            rnd.next_segment += 1
            rnd.outstanding.add(seg)
            rnd.seg_rows[seg] = (a, b)
            self._submit(Batch(lay.tokens, lay.pos, seq_ids, np.arange(a, b, dtype=np.int32),
                               np.ones(b - a, bool), lap=rnd.lap, segment=seg, pre_ops=kv,
                               sampling=sampling))
            kv = []
            if self.listeners:
                self._emit({"e": "rows", "lap": rnd.lap, "segment": seg, "rows": list(zip(
                    range(a, b), parents_all[a:b].tolist(), tokens_all[a:b].tolist(),
                    strict=True))})
        rnd.sent_rows = stop

    def _finish_round(self, rnd: _Round, decision) -> list[int]:
        """Commit the accepted path into sequence 0 (masked rollback) and return the tokens
        gained: accepted draft tokens, then the bonus token."""
        path = [int(r) for r in decision.path]
        self._observe_acceptance(rnd.tree, path, int(decision.bonus))
        root_token = int(rnd.tree.root_token)
        plan = rnd.tree.commit(decision)
        self._pending_ops.extend(_op_from_core(op) for op in np.asarray(plan.ops).reshape(-1, 5))
        tokens = [int(t) for t in plan.tokens]
        self._commit([root_token, *tokens])
        gained = [*tokens, int(decision.bonus)]
        if self.listeners:
            self._emit({"e": "decide", "lap": rnd.lap, "accepted": path,
                        "bonus": int(decision.bonus)})
        self.stats.rounds += 1
        self.stats.accepted_hist[len(gained)] += 1
        td = time.perf_counter()
        if self.drafter is not None:
            self.drafter.accept(gained)
        self.stats.draft_s += time.perf_counter() - td
        return gained

    def _observe_acceptance(self, tree: core.TokenTree, path: list[int], bonus: int) -> None:
        """Feed the cost model: at each step of the accepted path, which sibling rank (by
        draft score) held the target's token, if any."""
        n = tree.n_rows
        parents = tree.parents()[:n]
        scores = tree.scores()[:n]
        alive = tree.alive()[:n]
        steps = [*path[1:], None]
        for node, nxt in zip(path, steps, strict=True):
            kids = np.flatnonzero((parents == node) & alive)
            if not len(kids):
                continue
            kids = kids[np.argsort(-scores[kids], kind="stable")].tolist()
            rank = kids.index(nxt) if nxt is not None else None
            self.cost.observe_rank(rank, len(kids))

    def _rounds_sync(self, root: int, sampling: Sampling) -> Iterator[list[int]]:
        while True:
            budget = self._budget()
            if budget == 0:
                gained = self._plain_round(root, sampling)
                root = gained[-1]
                yield gained
                continue
            rnd = self._new_tree(root, sampling, budget)
            self._send_rows(rnd, sampling, 1)
            res = self.chain.next_result()
            self.stats.lap_timing.got(res)
            self.stats.laps += 1
            self.cost.observe_lap(rnd.sent_rows, (time.perf_counter() - rnd.t0) * 1e3)
            decision = rnd.verifier.feed_targets(res.targets, 0, rows=res.nodes)
            if decision.status != core.ACCEPTED:
                raise RuntimeError("whole-tree verification did not reach a decision")
            gained = self._finish_round(rnd, decision)
            root = gained[-1]
            yield gained

    def _segment_size(self, budget: int) -> int:
        """Rows per FlowSpec segment for an explicit budget: spread over the stages (or over
        ``segments``)."""
        n = self.fixed_segments or max(1, self.chain.n_stages)
        return max(1, math.ceil(budget / n))

    def _rounds_flow(self, root: int, sampling: Sampling) -> Iterator[list[int]]:
        stale = self._stale  # lap -> results still to come from decided trees
        gain = self.gain
        while True:
            seg = self._flow_segment()
            t_round = time.perf_counter()
            if seg == 0:
                self._drain_stale()  # a plain lap reads the next result: make it its own
                t = time.perf_counter()
                gain.charge_tree(t - t_round)  # the last tree's rows still in flight
                gained = self._plain_round(root, sampling)
                root = gained[-1]
                yield gained
                gain.record_plain(time.perf_counter() - t)
                continue
            # Start the ring on the first segment at once; the rest of the tree is drafted
            # while that segment is in flight (below).
            rnd = self._new_tree(root, sampling, seg)
            rnd_chain = self.chain
            self._send_rows(rnd, sampling, 1)
            decision = None
            ready: dict[int, object] = {}  # segment -> result, fed in segment order
            next_seg = 0
            streamed = 0  # accepted tokens of this round already handed out
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
                # The caller has all it wants in the middle of a round: forget the round
                # (nothing of it was committed) and drop its rows everywhere. (Unless the
                # chain was replaced after a failure: then there is nothing to clean.)
                if self.chain is not rnd_chain:
                    raise
                if rnd.outstanding:
                    stale[rnd.lap] += len(rnd.outstanding)
                self.chain.prune(range(rnd.sent_rows), (), lap=rnd.lap)
                self._pending_ops.append(KvOp(KvOpCode.KEEP, 0))
                raise
            # (No observe_lap here: a flow round overlaps many segments, so its duration is
            # not the lap time the sync-mode model needs.)
            if rnd.outstanding:
                # Everything still in flight belongs to a decided tree: drop it on the way.
                stale[rnd.lap] += len(rnd.outstanding)
                self.chain.prune(range(rnd.sent_rows), (), lap=rnd.lap)
            gained = self._finish_round(rnd, decision)
            root = gained[-1]
            yield gained[streamed:]
            gain.record_tree(len(gained), time.perf_counter() - t_round)

    def _prune(self, rnd: _Round, d) -> None:
        """After a partial decision: drop rows off the accepted path from batches still in
        flight, and move the round's frontier down the accepted path."""
        alive_before = rnd.tree.alive()[: rnd.tree.n_rows].copy()
        plan = rnd.tree.prune(d)
        dead = np.flatnonzero(alive_before & ~rnd.tree.alive()[: rnd.tree.n_rows])
        if len(dead):
            # Rows die at once everywhere (direct message); their seqs are freed in ring
            # order (pre_ops of the next batch), behind any of their rows still in flight.
            self.chain.prune(dead.tolist(), (), lap=rnd.lap)
            self.stats.rows_pruned += len(dead)
            self._pending_ops.extend(_op_from_core(op) for op in np.asarray(plan.ops).reshape(-1, 5))
        rnd.frontier = int(d.path[-1])
        rnd.frontier_tokens = [int(t) for t in d.tokens]
        if self.listeners:
            self._emit({"e": "verify", "lap": rnd.lap, "accepted": [int(r) for r in d.path],
                        "rejected": dead.tolist()})

    #: Draft ahead only while the next row is at least this likely to be needed: by the
    #: measured top-1 acceptance (_ahead_limit) and by the draft's own odds of the path to it.
    #: (10 ms hops, 4 prompts, x none: 0.15 -> 1.89, 0.3 -> 1.89, 0.5 -> 1.79.)
    AHEAD_MIN_P = 0.3
    #: Draft ahead along the likeliest leaf only (a chain), not best-first over the whole
    #: subtree: siblings were wasted rows more often than saved laps (10 ms hops, 4 prompts,
    #: 1-row segments: 1.89x none with chains, 1.81x best-first, which pruned 43% of the rows
    #: on the worst prompt).
    AHEAD_CHAIN = True

    def _ahead_limit(self) -> int:
        """Unverified rows worth having in flight: the depth k at which a chain of top-1 draft
        guesses, each accepted with the measured rate a, is still wholly accepted with
        probability a**k >= AHEAD_MIN_P (a deeper row is more likely wasted work than not)."""
        a = float(min(max(self.cost.acceptance()[0], 1e-3), 0.999))
        return max(1, min(self.max_depth, int(math.log(self.AHEAD_MIN_P) / math.log(a))))

    def _draft_ahead(self, rnd: _Round, sampling: Sampling, seg: int) -> bool:
        """Draft up to ``seg`` more nodes below the round's accepted frontier and send them as
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
    def _emit(self, event: dict) -> None:
        """Hand a tree event to every listener; a failing listener never stops decoding."""
        for fn in list(self.listeners):
            try:
                fn(event)
            except Exception:  # an observer's bug must not end a generation
                log.exception("tree event listener failed")


def sampling_config(s: Sampling) -> core.SamplerConfig:
    return core.SamplerConfig(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              seed=s.seed & 0xFFFFFFFFFFFFFFFF)


def _op_from_core(op) -> KvOp:
    kind, a, b, p0, p1 = (int(x) for x in op)
    if kind == core.SEQ_CP:
        return KvOp(KvOpCode.CP, a, p0, p1, b)
    if kind == core.SEQ_RM:
        return KvOp(KvOpCode.RM, a, p0, p1)
    if kind == core.SEQ_KEEP:
        return KvOp(KvOpCode.KEEP, a)
    raise ValueError(f"unknown core op {kind}")
