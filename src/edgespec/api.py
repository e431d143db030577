"""Python API: ``from edgespec import Ring``.

Over 450 lines: the whole user-facing API of a ring (open, generate, chat, stream, observe,
close) is one class, read in one place; the work is in the modules it names.

>>> with Ring.local("qwen2.5-coder-0.5b", stages=2) as ring:          # doctest: +SKIP
...     out = ring.generate("def fib(n):", max_tokens=64)
...     print(out.text, out.stats.tokens_per_s)

A ``Ring`` is the head: it owns the tokenizer and chat template (from llama.cpp), the
drafters and the speculative engine, and drives a chain of stages (local, or on nodes). A
ring serves ``parallel`` requests at once (default 1: one at a time, others wait their turn),
each in a slot of its own (``edgespec.head.slots``): its own range of KV sequences, engine and
committed history. The KV cache is reused across calls, so a prompt that extends a slot's
history (a chat's next turn) only prefills its new tokens.

A bad request raises ``RequestError`` before anything is sent. Every request runs on the
ring's loop (``edgespec.head.loop``), which also owns the ring's failures: a stage that fails
a request raises ``StageFailure`` after its slot was resynchronised (its next request starts
clean, nothing is rebuilt); a lost node makes it re-form the ring and replay every running
generation, at most ``MAX_RECOVERIES`` times in a row, with backoff, before it gives up with
``RingError``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from edgespec.errors import RequestError, RingError, TakenOver
from edgespec.grammar import vocab_tokenizer
from edgespec.head.chain import Chain
from edgespec.head.config import HeadConfig
from edgespec.head.engine import EngineConfig, GenerationStats, SpecEngine
from edgespec.head.engine.cost import CostModel
from edgespec.head.engine.gain import RingRates
from edgespec.head.engine.registry import AUTO, MODES, SPEC_MODES
from edgespec.head.loop import RingLoop
from edgespec.head.output import OutputProcessor, TokenLogprob
from edgespec.head.request import END, Generation, Request
from edgespec.head.scheduler import Scheduler, Ticket
from edgespec.params import GenerationParams
from edgespec.seqs import N_SEQ, slot_width

log = logging.getLogger("edgespec")


#: What ``Ring.prepare`` returns (a request checked against the ring, not yet streamed).
Prepared = Request

__all__ = ["Generation", "Prepared", "Request", "Ring", "TextStream", "TokenLogprob"]


class TextStream:
    """Iterator over a request's text pieces as they are accepted (the ring's loop produces
    them); ``.result`` holds the ``Generation`` once the iterator is exhausted (or closed).
    Dropping it unfinished ends the request."""

    #: How often a reader waiting for a piece checks that the ring's loop still runs.
    ALIVE_CHECK_S = 1.0

    def __init__(self, request: Request, loop: RingLoop) -> None:
        self._request = request
        self._loop = loop
        self._ended = False
        #: With ``logprobs``: a ``TokenLogprob`` per token accepted so far (it grows as the
        #: pieces come; a streaming server sends the new ones with each piece).
        assert request.output is not None
        self.logprobs: list[TokenLogprob] = request.output.logprobs
        weakref.finalize(self, _abandon, request, loop)

    @property
    def result(self) -> Generation | None:
        return self._request.result

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._ended:
            raise StopIteration
        while True:
            try:
                item = self._request.outbox.get(timeout=self.ALIVE_CHECK_S)
            except queue.Empty:
                if not self._loop.alive:
                    self._ended = True
                    raise RingError("the ring's loop has stopped") from None
                continue
            if item is END:
                self._ended = True
                raise StopIteration
            if isinstance(item, BaseException):
                self._ended = True
                raise item
            return item

    def close(self) -> None:
        """End the generation (freeing its slot on the next lap), or give up its place in
        the queue if it never started; returns once it ended."""
        req = self._request
        if req.done.is_set():
            return
        req.stop()
        self._loop.poke()
        while not req.done.wait(self.ALIVE_CHECK_S):
            if not self._loop.alive:
                return


def _abandon(request: Request, loop: RingLoop) -> None:
    """A stream dropped before its end: its request stops at the next lap."""
    if not request.done.is_set():
        request.stop()
        loop.poke()


class Ring:
    """The head of a ring: generate, stream and chat over the stages it drives."""

    def __init__(self, chain: Chain, tokenizer, *, model_name: str, spec: str = AUTO,
                 drafter_factory: Callable[[], Any] | None = None, n_ctx: int = 4096,
                 on_close: Callable[[], None] | None = None, engine: EngineConfig | None = None,
                 recover: Callable[[Exception], Chain] | None = None,
                 parallel: int = 1, max_queue: int | None = None) -> None:
        """``spec``: the mode of requests that do not name one (``registry.SPEC_MODES``);
        ``engine``: the engine's settings; ``parallel``: requests served at once (slots; each
        gets ``n_ctx // parallel`` of the context, as llama-server divides it);
        ``max_queue``: requests that may wait for a slot (None: any number); one more is
        refused with ``RingBusy`` at once."""
        if spec not in SPEC_MODES:
            raise ValueError(f"spec must be one of {', '.join(SPEC_MODES)}, got {spec!r}")
        # ValueError unless 1 <= parallel <= n_seq // 2
        width = slot_width(parallel, getattr(chain, "n_seq_max", N_SEQ))
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.default_spec = spec
        self.n_ctx = n_ctx
        self.slot_ctx = n_ctx // parallel  # the context of one slot
        self._on_close = on_close
        self._drafters: list[Any] = []
        config = engine or EngineConfig()
        # A slot's tree seqs (edgespec.head.slots).
        max_seqs = {"max_seqs": width - 1}
        # One cost model and one set of gain rates for the ring: laps, drafts and tree steps
        # measured on any slot serve them all (docs/design.md 5.8).
        cost, rates = CostModel(), RingRates()

        def make_engine(ch: Chain, _index: int) -> SpecEngine:
            drafter = drafter_factory() if drafter_factory is not None else None
            if drafter is not None:
                self._drafters.append(drafter)
            return SpecEngine(ch, drafter=drafter, n_ctx=self.slot_ctx, config=config,
                              cost=cost, ring_rates=rates, vocab=getattr(tokenizer, "model", None),
                              **max_seqs)

        #: Set once another head took the ring over on purpose (``--take-over``): this head
        #: then does not take the nodes back by itself (a recovery would undo the other's
        #: choice); its requests fail saying so until it is restarted.
        self.taken_over: str | None = None
        self._rebalance_fn: Callable[..., Chain] | None = None
        self.can_recover = recover is not None

        def recover_chain(exc: Exception) -> Chain:
            taken = str(exc) if isinstance(exc, TakenOver) else next(
                (m.taken_over for m in getattr(self.scheduler.chain, "members", ())
                 if getattr(m, "taken_over", None)), None)
            if taken is not None and self.taken_over is None:
                self.taken_over = f"{taken}; restart this head to take the ring back"
            if self.taken_over is not None:
                raise RingError(self.taken_over)
            assert recover is not None
            return recover(exc)

        # The scheduler admits requests, gives them slots and rebuilds the ring once for all
        # of them after a lost node; the loop runs them all (and their replays).
        self.scheduler = Scheduler(chain, make_engine, parallel=parallel, max_queue=max_queue,
                                   recover=recover_chain if recover is not None else None)
        self._drafter = self._drafters[0] if self._drafters else None
        self._last_slot = self.scheduler.slots[0]
        # Slot 0's engine (the only one when parallel=1).
        self.engine = self._last_slot.engine
        self.loop = RingLoop(self.scheduler, self._finish)
        self.last: Generation | None = None
        self.local_nodes: Any = None  # set by Ring.local: its node processes
        self.draft_name: str | None = None  # the draft model's file name, if any

    @property
    def parallel(self) -> int:
        """Requests served at once (slots)."""
        return self.scheduler.parallel

    def slots(self) -> list[dict[str, Any]]:
        """One entry per slot: ``slot``, ``state`` ("busy"/"free"), ``tokens`` (generated by
        its current or last request), ``tokens_per_s`` (that request's decode speed),
        ``prompt_tokens``, ``history_tokens`` (committed tokens it holds) and ``kv_parked``
        (their KV waits in the stages' host memory for the conversation's next turn,
        docs/design.md 5.8)."""
        return [s.info() for s in self.scheduler.slots]

    @property
    def recovering(self) -> bool:
        """True while the ring is being re-formed after a lost node."""
        return self.scheduler.recovering

    def admit(self) -> Ticket:
        """A place in the ring's queue for a request about to be streamed
        (``stream_prepared(..., ticket=)``), or ``RingBusy`` at once when ``max_queue``
        requests wait already: a server refuses then, before it starts an answer."""
        return self.scheduler.admit()

    def rebalance(self, nodes: Sequence[str] = (), profile: bool = True) -> None:
        """Re-plan this head's ring over every node that answers (its known nodes, a node
        that returned, and ``nodes``: more ``host:port``), profiling them unless ``profile``
        is false; saves the new plan where the ring was saved. Requests in flight finish
        first and new ones wait until the new ring is up. RequestError on a ring that cannot
        be re-planned this way (every window in this process, or a local ring)."""
        if self._rebalance_fn is None:
            raise RequestError("this ring cannot be rebalanced: its nodes are processes of "
                               "this head (a local ring); restart it to re-plan", "nodes")
        if self.taken_over is not None:
            raise RingError(self.taken_over)
        from edgespec.head.addresses import parse_nodes

        try:
            extra = parse_nodes(",".join(nodes)) if nodes else []
        except ValueError as e:
            raise RequestError(str(e), "nodes") from None
        fn = self._rebalance_fn

        def rebuild() -> None:
            self.scheduler.rebuild(lambda: fn(extra, profile))
            self.loop._reset_slots()

        self.loop.exclusive(rebuild)

    @property
    def chain(self) -> Chain:
        """The chain in force (a new one after the ring was re-formed)."""
        return self.scheduler.chain

    @property
    def recovery_log(self) -> list[dict[str, Any]]:
        """One entry per ring rebuild: the error, seconds taken, stages after."""
        return self.scheduler.recovery_log

    # ---------------------------------------------------------------- construction

    @classmethod
    def local(cls, model: str | Path = "qwen2.5-coder-0.5b", stages: int = 2, *,
              n_ctx: int = 4096, processes: bool = True, verbose: bool = False,
              **kwargs: Any) -> Ring:
        """A ring of ``stages`` windows on this machine.

        With ``processes=True`` (the default) each window runs in its own ``edgespec node``
        process on loopback, over the same authenticated transport as a LAN ring; with
        ``processes=False`` all windows run in this process (fast start, for scripts/tests).
        The head's settings (``HeadConfig``): ``spec``, ``draft`` (a draft model with the
        same tokenizer; without one, retrieval drafting), ``drafter``, ``draft_quant``,
        ``parallel``, ``max_queue``, and the engine's (``EngineConfig``): ``budget``,
        ``segments``, ``max_depth``, ``prefill_chunk``. The ring's: ``ranges`` / ``rounds``
        (layer windows), ``threads`` (per node), ``encoding`` ("f32" exact, "f16", "q8"),
        ``proxy`` (address -> address, e.g. a link emulator on every connection).
        """
        from edgespec.head.build import open_local_ring

        config = HeadConfig.take(kwargs)
        return open_local_ring(cls, model, stages, config, n_ctx=n_ctx, processes=processes,
                               verbose=verbose, **kwargs)

    @classmethod
    def attach(cls, state: str | Path | None = None, **kwargs: Any) -> Ring:
        """Attach to the ring brought up by ``edgespec ring up`` (its saved state file):
        ``key``, ``take_over`` and the head's settings as for ``local``."""
        from edgespec.head.build import attach

        return attach(cls, state, HeadConfig.take(kwargs), **kwargs)

    @classmethod
    def up(cls, model: str | Path = "qwen2.5-coder-0.5b", nodes: str = "auto", *,
           key: str | Path | None = None, **kwargs: Any) -> Ring:
        """Discover nodes (``nodes="auto"``: mDNS; or ``"host:port,..."``), plan, load and
        connect a ring, and return its head (the head's settings as for ``local``; ``proxy``
        as there, e.g. a link emulator in front of every node)."""
        from edgespec.head.build import up

        return up(cls, model, nodes, HeadConfig.take(kwargs), key=key, **kwargs)

    # ---------------------------------------------------------------- generation

    def prepare(self, prompt_tokens: Sequence[int], params: GenerationParams) -> Request:
        """Check a request against this ring before anything reaches it: the prompt's ids
        against the vocabulary, the room its slot's context leaves, the speculative mode
        (``RequestError`` naming the field). ``max_tokens`` beyond the context left is capped
        to it (as llama.cpp does: cap, don't fail) and the cap reported."""
        if self.taken_over is not None:  # the nodes serve another head now, on purpose
            raise RingError(self.taken_over)
        prompt = [int(t) for t in prompt_tokens]
        if not prompt:
            raise RequestError("empty prompt: give at least one token", "prompt")
        n_vocab = int(getattr(self.tokenizer, "n_vocab", 0) or 0)
        bad = [t for t in prompt if t < 0 or (n_vocab and t >= n_vocab)]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary "
                               f"0..{n_vocab - 1}", "prompt")
        biased = [t for t, _ in params.logit_bias if n_vocab and t >= n_vocab]
        if biased:
            raise RequestError(f"logit_bias names token {biased[0]}, outside the vocabulary "
                               f"0..{n_vocab - 1}", "logit_bias")
        if params.grammar is not None:
            model = getattr(self.tokenizer, "model", None)
            if model is None:
                raise RequestError("this ring's head has no vocabulary to compile a grammar "
                                   "against", params.grammar.param)
            params.grammar.check(vocab_tokenizer(model))
        try:  # resolved once, here: the mode the request runs as on this ring
            mode = self.engine.resolve_mode(params.spec or self.default_spec)
        except ValueError as e:
            raise RequestError(str(e), "spec") from None
        room = self.slot_ctx - len(prompt)
        if room < 1:
            each = (f" ({self.slot_ctx} per slot of {self.parallel})"
                    if self.parallel > 1 else "")
            raise RequestError(f"the prompt has {len(prompt)} tokens but the ring's context "
                               f"is {self.n_ctx}{each}: shorten it, or bring the ring up with "
                               f"a larger --ctx", "prompt", code="context_length_exceeded")
        capped = None
        if params.max_tokens > room:
            capped = room
            log.info("max_tokens %d capped to %d: the context (%d) has no more room after the "
                     "prompt (%d tokens)", params.max_tokens, room, self.slot_ctx, len(prompt))
            params = params.replace(max_tokens=room)
        return Request(prompt, params, mode, capped)

    def stream_prepared(self, request: Request, cancel: threading.Event | None = None,
                        ticket: Ticket | None = None) -> TextStream:
        """Run a request ``prepare`` checked, on the ring's loop; text pieces as they are
        accepted. ``cancel`` stops it at the next step, or withdraws it while it waits for
        a slot (``finish_reason`` "cancelled"). ``ticket``: its place in the queue
        (``admit``); taken now when None."""
        if request.status != "new":
            raise RuntimeError("this request was streamed already: prepare it again")
        request.ticket = ticket if ticket is not None else self.scheduler.admit()
        if cancel is not None:
            request.cancel = cancel
        request.output = OutputProcessor(self.tokenizer, request.params)
        request.t_start = time.perf_counter()
        stream = TextStream(request, self.loop)
        self.loop.submit(request)
        return stream

    def _finish(self, request: Request) -> None:
        """Called on the loop: ``request``'s ``Generation``, from its output and statistics."""
        out = request.output
        assert out is not None
        slot = request.slot
        stats = request.stats
        if slot is None:  # withdrawn while it waited: it never reached the ring
            stats = GenerationStats(mode=request.mode, prompt_tokens=len(request.prompt))
            stats.queue_ms = (time.perf_counter() - request.t_start) * 1e3
        else:
            self._last_slot = slot
        stats.tokens = len(out.tokens)
        generation = Generation(out.text, out.tokens, stats, out.finish, request.capped,
                                list(out.logprobs) if request.scored else None)
        request.result = generation
        self.last = generation

    def _prompt_tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special=True, parse_special=False)
        return [int(t) for t in prompt]

    def stream_tokens(self, prompt_tokens: Sequence[int], params: GenerationParams | None = None,
                      *, cancel: threading.Event | None = None, **fields: Any) -> TextStream:
        """Stream from explicit prompt token ids (the chat CLI builds them turn by turn).
        ``params`` (or the ``GenerationParams`` fields as keywords: ``max_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``spec``, ``ignore_eos``,
        ``logit_bias``, ``logprobs``: then ``Generation.logprobs`` and the stream's
        ``logprobs`` hold a ``TokenLogprob`` per token; ``frequency_penalty``,
        ``presence_penalty``, ``repeat_penalty``; what the text must match: ``json_schema=``
        (a dict), ``response_format=`` (OpenAI's), ``regex=``, ``lark=`` or ``grammar=``
        (an ``edgespec.grammar.Grammar``))."""
        return self.stream_prepared(
            self.prepare(prompt_tokens, GenerationParams.of(params, **fields)), cancel)

    def stream(self, prompt: str | Sequence[int], params: GenerationParams | None = None, *,
               cancel: threading.Event | None = None, **fields: Any) -> TextStream:
        """Stream the continuation of ``prompt`` (text or token ids) as text pieces; settings
        as ``stream_tokens``. ``ignore_eos``: go on past end-of-generation tokens to
        ``max_tokens`` (for benchmarks: every answer as long as asked; the tokens are kept,
        their text is empty)."""
        return self.stream_tokens(self._prompt_tokens(prompt), params, cancel=cancel, **fields)

    def generate(self, prompt: str | Sequence[int], params: GenerationParams | None = None,
                 **fields: Any) -> Generation:
        """Generate a continuation of ``prompt``; greedy by default (``temperature=0``)."""
        return _drain(self.stream(prompt, params, **fields))

    def stream_chat(self, messages: Sequence[Mapping[str, str]],
                    params: GenerationParams | None = None, **fields: Any) -> TextStream:
        """Stream the assistant's answer to ``messages`` (rendered by the model's template)."""
        tokens = self.tokenizer.chat_tokens(messages, add_generation_prompt=True)
        return self.stream_tokens(tokens, params, **fields)

    def chat(self, messages: Sequence[Mapping[str, str]],
             params: GenerationParams | None = None, **fields: Any) -> Generation:
        """The assistant's answer to ``messages`` ([{"role", "content"}, ...])."""
        return _drain(self.stream_chat(messages, params, **fields))

    @property
    def history(self) -> list[int]:
        """Token ids committed in the ring's KV cache by the slot of the last request."""
        return list(self._last_slot.engine.history)

    def reset(self) -> None:
        """Forget the conversations: clear every slot's KV sequences on every stage (once
        the requests running are done; those admitted later wait for it)."""
        def clear() -> None:
            for slot in self.scheduler.slots:
                slot.engine.reset()

        self.loop.exclusive(clear)

    # ---------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Release the drafter, the chain and (for a local ring) its node processes."""
        try:
            self.loop.close()  # requests still running end as cancelled
            for drafter in self._drafters:
                if hasattr(drafter, "close"):
                    drafter.close()
            self.scheduler.close()
        finally:
            if self._on_close is not None:
                cb, self._on_close = self._on_close, None
                cb()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- observing

    def describe(self, probe: bool = True) -> dict[str, Any]:
        """A snapshot of the ring: model, mode, drafter, and per stage (in ring order) its
        layer window, node, address, device (backend, free RAM/VRAM), whether it answers,
        the head's round trip to it and its compute counters (batches, busy seconds: rates
        come from two snapshots). ``status`` is "up", or "down" with a ``message`` and a
        ``hint`` on bringing it back. ``probe``: ask every node for its health now (one
        control round trip each); else only what the head already knows. ``lap_timing``: the
        last answer's per-stage wait/compute and per-link transfer times (``edgespec.laps``).
        Also the per-node rows of ``ring status`` (``nodes``): this one typed view of the ring
        (``edgespec.head.view``) is what ``ring status --json`` and ``/v1/ring`` show."""
        from edgespec.head.view import view_of_chain

        view = view_of_chain(self.chain, self.model_name, self.n_ctx, probe=probe,
                             can_recover=self.can_recover)
        view.spec, view.drafter = self.default_spec, _drafter_name(self._drafter)
        view.modes = self.modes()
        view.recoveries = list(self.recovery_log)
        if self.taken_over is not None:
            view.status, view.message = "down", self.taken_over
            view.hint = "restart this head (e.g. `edgespec serve`) to take the ring back"
        elif view.status == "down" and self.local_nodes is not None:
            # A local ring's nodes are this head's own processes: no `edgespec node` to start.
            procs = list(getattr(self.local_nodes, "procs", []) or [])
            n = len(procs) or len(view.stages)
            running = any(p.poll() is None for p in procs)
            view.hint = (("the next request re-plans over the node processes still running; "
                          "or " if self.can_recover and running else "")
                         + f"restart this head to start its {n} node processes again "
                         f"(`edgespec serve --local {n}`, `edgespec chat --local {n}`)")
        last = self.last
        view.lap_timing = last.stats.lap_timing.as_dict() if last is not None else None
        return view.to_dict()

    def modes(self) -> list[str]:
        """The speculative modes a request may ask this ring for (``auto`` first)."""
        has_drafter = self._drafter is not None
        return [m for m in SPEC_MODES
                if m == AUTO or has_drafter or not MODES[m].needs_drafter]

    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """Call ``fn(event)`` on the ring's loop thread for every tree event: rows sent
        (``rows``: node, parent, token), partial verification (``verify``: accepted path,
        rejected rows), a step's decision (``decide``: path, bonus token) and plain one-token
        laps (``plain``). ``fn`` must be quick; with no listener no event is built."""
        for slot in self.scheduler.slots:
            slot.engine.listeners.append(fn)

    def remove_listener(self, fn: Callable[[dict], None]) -> None:
        for slot in self.scheduler.slots:
            with contextlib.suppress(ValueError):
                slot.engine.listeners.remove(fn)


def _drafter_name(drafter: Any) -> str | None:
    """How the page and ``describe`` name the head's drafter."""
    if drafter is None:
        return None
    path = getattr(drafter, "model_path", None)
    kind = type(drafter).__name__.replace("Drafter", "").lower().replace("draftmodel", "model")
    return f"{kind} ({Path(path).name})" if path is not None else kind


def _drain(stream: TextStream) -> Generation:
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result
