"""The speculative engine on the head (``SpecEngine``).

Over 450 lines: the lifecycle and the step operations share one state (history, laps, KV
operations waiting) that every mode drives; split, each half would reach into the other.

A generation's lifecycle, its prefill,
and the step operations every mode shares (a plain lap, drafting a tree, sending its rows,
committing a decision with its KV rollback). What each step sends is the mode's
(``edgespec.head.engine.mode``, one file per mode, listed in ``registry``); whether a tree pays
and how big is ``TreePolicy``'s (``policy``).

KV discipline (docs/design.md 3): committed tokens live in llama.cpp sequence 0 on every
stage. A tree's root is the last accepted token, not yet in KV; every tree row carries the
seq ids of the leaves below it, and each leaf seq first receives the committed prefix. After a
decision the accepted path is copied into sequence 0 and every other sequence is dropped:
masked rollback, nothing recomputed. Those operations travel as ``pre_ops`` of the next batch,
so they reach each stage in order behind the rows they clean up.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from edgespec.batch import Batch, SamplerRef, SeqIds
from edgespec.drafters.base import Drafter, DraftTree
from edgespec.drafters.constrained import constrained_drafter
from edgespec.head.chain import Chain
from edgespec.head.engine.config import EngineConfig
from edgespec.head.engine.cost import CostModel
from edgespec.head.engine.gain import GainMeter, RingRates
from edgespec.head.engine.inflight import TreeInFlight, sampling_config
from edgespec.head.engine.mode import POLL, WAIT, Steps
from edgespec.head.engine.policy import TreePolicy
from edgespec.head.engine.registry import MODES, resolve
from edgespec.head.engine.sampler import SamplerHandle
from edgespec.head.engine.scores import ScoreQueue
from edgespec.head.engine.stats import GenerationStats
from edgespec.sampling import SamplerSettings
from edgespec.tree import core
from edgespec.tree.kvop import KvOp, KvOpCode

if TYPE_CHECKING:
    from edgespec.head.request import Request
    from edgespec.params import GenerationParams

log = logging.getLogger("edgespec.head.engine")

def drive_alone(steps: Steps, chain: Chain) -> Iterator[list[int]]:
    """Run an engine's coroutine on the calling thread, its only user of ``chain``: ``WAIT``
    reads the chain's next result, ``POLL`` asks whether one is there; the token chunks come
    out. Closing the iterator closes the coroutine (which cleans up what it has in flight)."""
    answer: Any = None
    try:
        while True:
            try:
                item = steps.send(answer)
            except StopIteration:
                return
            if item is WAIT:
                try:
                    answer = chain.next_result()
                except Exception as e:  # raised in the step that waited
                    answer = e
            elif item is POLL:
                answer = chain.has_result()
            else:
                answer = None
                yield item
    finally:
        steps.close()


class SpecEngine:
    """Drives generations over a ``Chain``; owns the committed history (KV sequence 0). The
    modes (``edgespec.head.engine.registry``) decode the steps; this is their
    ``StepContext``."""

    def __init__(self, chain: Chain, *, drafter: Drafter | None = None, n_ctx: int = 4096,
                 config: EngineConfig | None = None, cost: CostModel | None = None,
                 ring_rates: RingRates | None = None, max_seqs: int = core.MAX_SEQS,
                 vocab: Any = None) -> None:
        config = config or EngineConfig()
        # The head's llama.cpp model (a vocabulary is enough): grammars' matchers for drafting.
        self.vocab = vocab
        # The request this slot runs now (None between them): its generation's state is the
        # request's (``Request``: statistics, log probabilities, sampler, drafter), the
        # engine keeps what the slot's KV cache holds.
        self.req: Request | None = None
        self.chain = chain
        # Tree leaves at most (each owns a seq id 1..max_seqs): a slot of a ring serving
        # several sequences owns fewer seq ids (edgespec.head.slots).
        self.max_seqs = max_seqs
        self.drafter = drafter
        self.n_ctx = n_ctx
        self.config = config
        self.max_depth = config.max_depth
        self.prefill_chunk = config.prefill_chunk
        # Whether a tree pays and how big: what it measures of the ring (the cost model, the
        # gain meter's rates) is shared by a ring's slots (edgespec.api.Ring).
        self.policy = TreePolicy(cost, ring_rates, budget=config.budget,
                                 segments=config.segments)
        self.history: list[int] = []  # tokens committed in KV sequence 0 on every stage
        # Lap ids name batches on every stage (pruning remembers recent laps): start each head
        # somewhere random so a new head on the same stages never reuses a recent lap id.
        self._lap = secrets.randbits(30)
        self._lap_high, self._lap_mask = 0, 0x7FFFFFFF  # the whole space (see use_laps)
        # A new head knows nothing of what the stages hold: its first batch starts from an
        # empty cache (ordered ahead of that batch like any other KV operation).
        self.pending_ops: list[KvOp] = KvOp.clear()
        self.stale: Counter = Counter()  # lap -> results of decided trees still in flight
        # Results the chain still owes this engine (every batch sent is answered once):
        # a generation cut short leaves some, read and dropped before the next one starts.
        self.owed = 0
        # Observers of tree events (the server's live view); empty: no event is even built.
        self.listeners: list[Callable[[dict], None]] = []
        # Requests decoding on this ring at once, this one included (a slot pool sets it,
        # docs/design.md 5.8): the tree budget and prefill chunks are shared between them.
        self.sharers: Callable[[], int] = lambda: 1
        # Requests past their prefill on this ring (their answers streaming; a slot pool
        # sets it): a prompt beside them goes in chunks of as many rows (``_prefill``).
        self.streams: Callable[[], int] = lambda: 0
        # Requests on this ring, running or waiting for a slot, this one included (a slot
        # pool sets it): beside others, the head's one draft model (on the loop's thread) is
        # theirs too, so this request's drafter reads the text only when it first drafts.
        self.demand: Callable[[], int] = lambda: 1

    # ------------------------------------------------------------------ public

    @property
    def cost(self) -> CostModel:
        return self.policy.cost

    @property
    def gain(self) -> GainMeter:
        return self.policy.gain

    def reset(self) -> None:
        """Drop every stage's KV (all sequences) and forget the history."""
        self.pending_ops = []
        self.chain.kv(KvOp.clear())
        self.history = []
        self.owed = 0
        self.stale.clear()

    def resolve_mode(self, mode: str) -> str:
        """The mode ``mode`` runs as on this ring (``registry.resolve``)."""
        return resolve(mode, has_drafter=self.drafter is not None,
                       n_stages=self.chain.n_stages)

    def replace_chain(self, chain: Chain) -> None:
        """Continue on another chain (after a node loss): its stages hold nothing yet."""
        self.chain = chain
        self.history = []
        self.stale.clear()
        self.owed = 0
        self.pending_ops = KvOp.clear()

    def run(self, req: Request) -> Iterator[list[int]]:
        """``start``'s generation driven on the calling thread (``drive_alone``): the tokens
        gained by each step, in order."""
        return drive_alone(self.start(req), self.chain)

    def start(self, req: Request) -> Steps:
        """The coroutine of ``req``'s generation: after its prompt as its settings say (its
        own object, carried unchanged from where it was checked), in its mode. It yields the
        tokens gained by each step, in order, and ``WAIT``/``POLL`` where it needs the ring
        (``mode.Need``); its state (statistics, log probabilities, sampler, drafter) is set
        on ``req``.

        Stops after its ``max_tokens``, or at the next step once its ``cancel`` is set; where
        the answer ends before that (an end-of-generation token, a stop string) is the
        caller's to decide (``edgespec.head.output``): it closes the iterator.
        A request with tokens already (``req.tokens``: a replay on a rebuilt ring) goes on
        after them for the rest of its budget: they are recomputed one per batch after the
        prompt, as they were first decoded, so it sees the same numbers as the first time.
        Its time to first token counts from ``req.t_start`` (where set; else now).

        Every mode takes its first token from the prefill: the prompt's last token rides in
        the last prefill chunk, its row wanted, so the first token comes back one lap sooner
        (docs/design.md 5.8), and the first step (plain or tree) hangs below it. A drafter
        reads the prompt while the prefill is in flight.
        """
        done = len(req.tokens)
        prompt = [int(t) for t in req.prompt + req.tokens]
        params = (req.params.replace(max_tokens=req.params.max_tokens - done) if done
                  else req.params)
        req.drafter = self.drafter
        if (params.grammar is not None and self.drafter is not None and self.vocab is not None
                and self.resolve_mode(req.mode) != "none"):
            # This generation drafts what the grammar forces, and only what it allows.
            req.drafter = constrained_drafter(self.drafter, self.vocab, params.grammar.text,
                                              prompt[len(prompt) - done:])
        self.req = req
        try:
            yield from self._generate(req, prompt, params, done)
        finally:
            self.req = None

    def _generate(self, req: Request, prompt: list[int], params: GenerationParams,
                  replay: int) -> Steps:
        max_tokens, sampling, cancel = params.max_tokens, params.sampling, req.cancel
        if not prompt:
            raise ValueError("empty prompt: give at least one token")
        if len(prompt) + max_tokens > self.n_ctx:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) "
                             f"exceeds the context size {self.n_ctx}")
        mode = self.resolve_mode(req.mode)
        req.text_start = len(prompt) - replay
        req.stats = GenerationStats(mode=mode, prompt_tokens=len(prompt))
        req.scores = ScoreQueue(sampling.logprobs >= 0)
        req.sampler = SamplerHandle(sampling)
        req.last_choice = None
        self.policy.begin()
        yield from self.drain_stale()  # what an earlier generation cut short left in flight
        t0 = t1 = time.perf_counter()
        t_start = req.t_start or t0
        drafter = req.drafter if mode != "none" else None
        # Beside other requests the head's one draft model is theirs too, and on a full
        # pipeline this one decodes plain laps (TreePolicy.pipeline_full): its drafter reads
        # the text when it first drafts a tree (``new_tree``), not the prompt now.
        req.drafter_behind = drafter is not None and max(self.sharers(), self.demand()) > 1

        def begin_drafter() -> None:
            if drafter is None or req.drafter_behind:
                return
            if self.demand() > 1:  # others came while its prompt was sent
                req.drafter_behind = True
                return
            td = time.perf_counter()
            drafter.begin(prompt)
            req.stats.draft_s += time.perf_counter() - td

        failed = False
        steps = None
        try:
            # A replayed generation's first token came from its prefill lap too: the tokens
            # decoded since go one per batch, as they were decoded (see ``replay``).
            root, first = yield from self._prefill(prompt, singles=max(0, replay - 1),
                                                   want_root=True, sampling=sampling,
                                                   root_alone=replay > 0,
                                                   while_waiting=begin_drafter)
            assert first is not None  # want_root: the prefill brought the first token
            req.stats.prefill_s = time.perf_counter() - t0
            if drafter is not None and not req.drafter_behind:
                td = time.perf_counter()
                drafter.accept([first])
                req.stats.draft_s += time.perf_counter() - td
            t1 = time.perf_counter()
            produced = 0
            req.room = max_tokens
            steps = self._steps(mode, root, first, sampling)
            answer = None
            while True:
                chunk = steps.send(answer)
                answer = None
                if chunk is WAIT or chunk is POLL:  # the ring's answer goes down to the mode
                    answer = yield chunk
                    continue
                gained = len(chunk)
                chunk = chunk[: max_tokens - produced]
                req.scores.take(len(chunk), gained)
                if produced == 0 and chunk:
                    req.stats.ttft_ms = (time.perf_counter() - t_start) * 1e3
                produced += len(chunk)
                req.room = max_tokens - produced
                req.stats.tokens = produced
                yield chunk
                if produced >= max_tokens:
                    break
                if cancel is not None and cancel.is_set():
                    break
        except GeneratorExit:
            raise
        except BaseException:
            failed = True  # the chain may be gone: do not wait on it
            raise
        finally:
            req.stats.decode_s = time.perf_counter() - t1
            req.stats.lap_timing.log(log)  # the lap-timing view with -v (DEBUG)
            if not failed:
                # Close the step generator now (not at garbage collection): a step cut
                # short registers its batches in flight (``owed``: read before the next
                # generation) and drops its tree's seqs. Cells of sequence 0 past the
                # committed history (a lap or a prefill cut short) go too.
                if steps is not None:
                    steps.close()
                self.pending_ops.append(KvOp(KvOpCode.RM, 0, len(self.history), -1))
                # The request's sampler at the last stage goes with the last KV operations.
                self._flush_ops(release=[req.sampler.key] if req.sampler.key else ())
            elif req.sampler.key:
                # Best effort on a chain that may be gone (a rebuilt ring's replay
                # registers again; an unreleased sampler ages out at the last stage).
                try:
                    self.chain.kv((), [req.sampler.key])
                except Exception:
                    log.debug("sampler of a failed generation not released", exc_info=True)

    # ------------------------------------------------------------------ prefill

    def _steps(self, mode: str, root: int, first: int, sampling: SamplerSettings
               ) -> Steps:
        """The prefill's token (``root`` committed), then the mode's steps below it."""
        self.req.stats.steps += 1
        self.req.stats.plain_steps += 1  # no tree: a plain lap's token (the prefill's last lap)
        self.req.stats.accepted_hist[1] += 1
        if self.listeners:  # the prefill's last lap brought it
            self.emit({"e": "plain", "lap": self._lap, "root": int(root), "token": int(first)})
        yield [first]
        yield from MODES[mode](self).steps(first, sampling)

    #: Prefill chunk size (tokens) while other requests' prompts fill the ring (none of
    #: them streaming yet): two prompts' chunks pipeline across the stages, each still a
    #: batch that fills the matmuls.
    SHARED_PREFILL_CHUNK = 64
    #: Tokens an answer must still want for a drafter left behind (``Request.drafter_behind``)
    #: to read the text so far and draft: that reading holds up the head's loop, and every
    #: request on it, for about a second for a few hundred tokens of the 0.5B draft model on
    #: 90% of a core (docs/experiments.md 20), more than a few trees near an answer's end gain.
    CATCH_UP_ROOM = 32

    def may_draft(self) -> bool:
        """Whether this step may draft a tree (else a plain lap): not when the drafter would
        first have to read the text and fewer than CATCH_UP_ROOM tokens are left."""
        return not (self.req.drafter_behind and self.req.room < self.CATCH_UP_ROOM)

    #: Prompt tokens to prefill beyond which a prompt beside streaming answers goes in
    #: chunks of their size: a shorter one holds them up once, for seconds, in efficient
    #: chunks.
    LONG_PREFILL = 512

    def _prefill(self, prompt: list[int], singles: int = 0, want_root: bool = False,
                 sampling: SamplerSettings | None = None, root_alone: bool = False,
                 while_waiting: Callable[[], None] | None = None) -> Steps:
        """``yield from`` it: bring KV sequence 0 to ``prompt[:-1]``, reusing the longest common prefix with what
        is already committed; returns the root (the last prompt token) and None. The last
        ``singles`` tokens before the root go one per batch (see ``run``'s ``replay``).

        ``want_root``: the root rides in the last chunk too, its row wanted (drawn with
        ``sampling``): it is committed and the target's token after it is returned as the
        second value (the generation's first token, without a lap of its own);
        ``root_alone``: in a batch of its own (a replay: it was decoded so);
        ``while_waiting``: called once every chunk is sent, before their results are read."""
        keep = 0
        limit = min(len(self.history), len(prompt) - 1)
        while keep < limit and self.history[keep] == prompt[keep]:
            keep += 1
        # Cells past the shared prefix go (also any a generation cut short left past its
        # history: a prefill chunk or a lap whose answer it did not wait for).
        self.pending_ops.append(KvOp(KvOpCode.RM, 0, keep, -1))
        del self.history[keep:]
        todo = prompt[keep:-1]
        self.req.stats.prefill_tokens = len(todo) + 1
        n_bulk = max(0, len(todo) - max(0, singles))
        # A long prompt beside answers streaming (docs/design.md 5.8): chunks of as many
        # rows as they decode per lap (one each), one per stage in flight. A stage runs
        # their decodes before a queued chunk and a row costs about the same in any batch
        # on a CPU, so the prompt takes about as much of each stage as they do. Otherwise
        # beside others: chunks of SHARED_PREFILL_CHUNK, one per stage in flight,
        # pipelined. Alone: every chunk at once.
        streams = self.streams() if len(todo) > self.LONG_PREFILL else 0
        shared = streams > 0 or self.sharers() > 1
        size = (min(self.prefill_chunk, streams) if streams else
                min(self.prefill_chunk, self.SHARED_PREFILL_CHUNK) if shared
                else self.prefill_chunk)
        chunks = [todo[off: min(off + size, n_bulk)] for off in range(0, n_bulk, size)]
        chunks += [[t] for t in todo[n_bulk:]]
        if want_root:
            if (not root_alone and chunks and n_bulk == len(todo)
                    and len(chunks[-1]) < size):
                chunks[-1] = [*chunks[-1], prompt[-1]]
            else:
                chunks.append([prompt[-1]])
        window = max(1, self.chain.n_stages) if shared else len(chunks)
        start, sent, res = keep, 0, None
        for got in range(len(chunks)):
            while sent < len(chunks) and sent - got < window:
                part = chunks[sent]
                n = len(part)
                pos = np.arange(start, start + n, dtype=np.int32)
                start += n
                # No row is wanted (but the root's, see want_root): prefill only fills KV.
                want = np.zeros(n, bool)
                last = want_root and sent == len(chunks) - 1
                if last:
                    want[-1] = True
                self._submit(Batch(np.array(part, np.int32), pos, SeqIds.single(n),
                                   np.arange(n, dtype=np.int32), want, lap=self._new_lap(),
                                   sampling=(self.req.sampler.register(prompt[self.req.text_start:])
                                             if last and sampling is not None
                                             else SamplerRef())))
                sent += 1
                if sent == len(chunks) and while_waiting is not None:
                    while_waiting()  # every chunk is out: work while their results come
            res = yield from self.next_result()
        self.history.extend(todo)
        if not want_root:
            return prompt[-1], None
        assert res is not None and len(res.targets) == 1
        self.req.scores.plain(res)
        self.history.append(prompt[-1])
        return prompt[-1], int(res.targets[0])

    # ------------------------------------------------------------------ helpers

    def use_laps(self, index: int, count: int) -> None:
        """Take lap ids from part ``index`` of ``count`` disjoint parts of the 31-bit space
        (slots of one ring, docs/design.md 5.8): stages key pruning by lap, and the head
        routes results by it, so two slots must never share one."""
        bits = 31 - max(0, count - 1).bit_length()
        self._lap_high, self._lap_mask = index << bits, (1 << bits) - 1
        self._lap = self._lap_high | (secrets.randbits(bits) & self._lap_mask)

    def _new_lap(self) -> int:
        self._lap = self._lap_high | ((self._lap + 1) & self._lap_mask)
        return self._lap

    def _submit(self, batch: Batch) -> None:
        if self.pending_ops:
            batch.pre_ops = self.pending_ops + list(batch.pre_ops)
            self.pending_ops = []
        self.req.stats.rows_sent += len(batch)
        self.req.stats.lap_timing.sent(batch)
        self.chain.submit(batch)
        self.owed += 1

    def next_result(self) -> Steps:
        """``yield from`` it: the next result for this engine's chain (``WAIT``); an error
        sent back in is raised here, in the step that waited."""
        got = yield WAIT
        self.owed -= 1
        if isinstance(got, BaseException):
            raise got
        return got

    def drain_stale(self) -> Steps:
        """``yield from`` it: read and drop every result still owed (decided trees', or a
        generation's cut short), so the next ``next_result`` is the caller's own."""
        while self.owed > 0:
            res = yield from self.next_result()
            self.req.stats.lap_timing.got(res)
        self.stale.clear()

    def _flush_ops(self, release: Sequence[int] = ()) -> None:
        """Send the KV operations due (and the sampler's release) now, behind every batch
        sent: they need no result, so a generation's end frees its rows on the next lap."""
        ops, self.pending_ops = self.pending_ops, []
        if ops or release:
            self.chain.kv(ops, release)

    def _for_rows(self, root: int, parents: Sequence[int] = (),
                  tokens: Sequence[int] = ()) -> SamplerRef:
        """What a batch of the step below ``root`` (its tree: ``parents``, ``tokens``) tells
        the last stage's sampler (``SamplerHandle.ref``)."""
        return self.req.sampler.ref(self.history, self.req.text_start, root, (parents, tokens))

    def _commit(self, tokens: Sequence[int]) -> None:
        self.history.extend(int(t) for t in tokens)

    def plain_step(self, root: int, sampling: SamplerSettings, tell_drafter: bool = True
                   ) -> Steps:
        """``yield from`` it: one token, no tree: mode ``none``'s step, and a tree mode's when its policy found
        that a tree does not pay right now (then the drafter still learns the token)."""
        pos = len(self.history)
        users = self.sharers()
        t = time.perf_counter()
        self._submit(Batch(np.array([root], np.int32), np.array([pos], np.int32),
                           SeqIds.single(1), np.zeros(1, np.int32), np.ones(1, bool),
                           lap=self._new_lap(), sampling=self._for_rows(root)))
        res = yield from self.next_result()
        self.req.stats.lap_timing.got(res)
        waited = time.perf_counter() - t
        self.policy.observe_lap(1, waited * 1e3, users=max(users, self.sharers()))
        self.req.stats.plain_wait_s += waited
        self.req.stats.laps += 1
        self.req.stats.steps += 1
        self.req.stats.plain_steps += 1
        self.req.stats.plain_laps += 1
        self.req.stats.accepted_hist[1] += 1
        self._commit([root])
        token = int(res.targets[0])
        self.req.scores.plain(res)
        if self.listeners:
            self.emit({"e": "plain", "lap": int(res.lap), "root": int(root), "token": token})
        if tell_drafter and self.req.drafter is not None and not self.req.drafter_behind:
            td = time.perf_counter()
            self.req.drafter.accept([token])
            self.req.stats.draft_s += time.perf_counter() - td
        return [token]

    # ------------------------------------------------------------------ trees

    def log_choice(self, mode: str, **choice: int) -> None:
        """Log the policy's tree sizing whenever it changes."""
        key = (mode, tuple(sorted(choice.items())))
        if key != self.req.last_choice:
            self.req.last_choice = key
            log.debug("%s sizing: %s (top-1 acceptance %.2f, lap %.1f ms + %.2f ms/row, "
                     "draft %.1f ms/node)", mode,
                     ", ".join(f"{k} {v}" for k, v in choice.items()),
                     float(self.cost.acceptance()[0]), self.cost.lap_a, self.cost.lap_b,
                     self.cost.draft_ms)

    def draft_into(self, tree: core.TokenTree, under_node: int, dt: DraftTree) -> None:
        """Add a drafter's nodes below ``under_node`` (add_nodes: a parent >= 0 is a tree
        node, -(j+1) is entry j of the same call)."""
        if len(dt) == 0:
            return
        parents = np.where(dt.parents < 0, under_node, -(dt.parents.astype(np.int64) + 1))
        tree.add_nodes(parents.astype(np.int32), dt.tokens, dt.logprobs.astype(np.float64))

    def new_tree(self, root: int, sampling: SamplerSettings, budget: int) -> TreeInFlight:
        assert self.req.drafter is not None
        tree = core.TokenTree(root, len(self.history), self.max_seqs)
        td = time.perf_counter()
        if self.req.drafter_behind:  # it reads the whole text now (see ``_generate``)
            self.req.drafter.begin([*self.history, root])
            self.req.drafter_behind = False
        dt = self.req.drafter.propose(root, budget, self.max_depth)
        spent = time.perf_counter() - td
        self.req.stats.draft_s += spent
        self.policy.cost.observe_draft(len(dt), spent * 1e3)
        self.draft_into(tree, 0, dt)
        tree.select(budget)
        return TreeInFlight(self._new_lap(), tree, None, t0=time.perf_counter())

    def send_rows(self, rnd: TreeInFlight, sampling: SamplerSettings, n_segments: int) -> None:
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
        kv = KvOp.rows(ordered.ops)
        # Each row's distribution may depend on its path (a grammar, penalties).
        ref = self._for_rows(int(rnd.tree.root_token), parents_all[:stop], tokens_all[:stop])
        count = max(1, min(n_segments, stop - start))
        bounds = rnd.tree.segment_bounds(count=count, start=start, stop=stop).tolist()
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            lay = rnd.tree.layout(a, b)
            seq_ids = SeqIds(lay.seq_ids, lay.n_seq)  # the layout's own form (design.md 5.1)
            seg = rnd.next_segment
            rnd.next_segment += 1
            rnd.outstanding.add(seg)
            rnd.seg_rows[seg] = (a, b)
            self._submit(Batch(lay.tokens, lay.pos, seq_ids, np.arange(a, b, dtype=np.int32),
                               np.ones(b - a, bool), lap=rnd.lap, segment=seg, pre_ops=kv,
                               sampling=ref))
            kv = []
            if self.listeners:
                self.emit({"e": "rows", "lap": rnd.lap, "segment": seg, "rows": list(zip(
                    range(a, b), parents_all[a:b].tolist(), tokens_all[a:b].tolist(),
                    strict=True))})
        rnd.sent_rows = stop

    def finish_tree(self, rnd: TreeInFlight, decision) -> list[int]:
        """Commit the accepted path into sequence 0 (masked rollback) and return the tokens
        gained: accepted draft tokens, then the bonus token."""
        path = [int(r) for r in decision.path]
        self.policy.observe_path(rnd.tree, path)
        root_token = int(rnd.tree.root_token)
        plan = rnd.tree.commit(decision)
        self.pending_ops.extend(KvOp.rows(plan.ops))
        tokens = [int(t) for t in plan.tokens]
        self._commit([root_token, *tokens])
        gained = [*tokens, int(decision.bonus)]
        # A flow step handed out its first ``streamed`` tokens before its decision.
        self.req.scores.path(rnd, path, rnd.streamed, len(gained))
        if self.listeners:
            self.emit({"e": "decide", "lap": rnd.lap, "accepted": path,
                        "bonus": int(decision.bonus)})
        self.req.stats.steps += 1
        self.req.stats.accepted_hist[len(gained)] += 1
        td = time.perf_counter()
        if self.req.drafter is not None:
            self.req.drafter.accept(gained)
        self.req.stats.draft_s += time.perf_counter() - td
        return gained

    def emit(self, event: dict) -> None:
        """Hand a tree event to every listener; a failing listener never stops decoding."""
        for fn in list(self.listeners):
            try:
                fn(event)
            except Exception:  # an observer's bug must not end a generation
                log.exception("tree event listener failed")
