"""A generation's one way through the server, whichever door it came in by (OpenAI's
completions, Ollama, Anthropic Messages, OpenAI Responses): the body read under the size cap,
the request checked and tokenized off the event loop into the same ``GenerationParams``, its
place in the ring's queue (``Ring.admit``: 429 at once when full), the generation thread, and
what it yields (text pieces, then the ``Generation``). Every door is counted here alike: the
``/health`` counts, ``/metrics`` and the page's per-generation records.

A door turns its own request into the OpenAI chat (or completion) request that ``requests``
checks, and shapes the answer as its API does; the refusals (``_BadRequest``: 413, 429, 503)
and failures (``edgespec.errors``) raised here are mapped to its own error shape."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from edgespec import errors
from edgespec.api import Generation, Prepared, Ring, TextStream
from edgespec.head.output import TokenLogprob
from edgespec.head.tools import template_takes_tools
from edgespec.server.chat_input import chat_input, tool_names
from edgespec.server.health import Metrics
from edgespec.server.inflight import Inflight
from edgespec.server.live import _Live
from edgespec.server.requests import (
    _BadRequest,
    _ChatRequest,
    _CompletionRequest,
    generation_params,
)

log = logging.getLogger("edgespec.server")

#: Legacy completions stop after 16 tokens when max_tokens is omitted (OpenAI's default);
#: chat completions may use the rest of the context, as OpenAI's do.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class _Piece:
    """A piece of an answer's text and the log probabilities of the tokens it brought (those
    of tokens without text of their own ride with the next piece)."""

    text: str
    scores: list[TokenLogprob]


@dataclass
class Started:
    """A request admitted to the ring: its checked request, the functions its answer may
    call (None: the text is not parsed for calls), and the queue its generation thread fills
    (pieces, then the ``Generation`` or the exception, then None)."""

    rid: str
    created: int
    req: _ChatRequest | _CompletionRequest
    names: list[str] | None
    queue: asyncio.Queue
    cancel: threading.Event
    prompt_tokens: int = 0


class Runs:
    """Requests from every door: checked and tokenized off the event loop, queued, run in a
    thread of their own once the scheduler gives them a slot (up to ``Ring.parallel`` at
    once); a client that hangs up stops its generation (or withdraws it from the queue)."""

    def __init__(self, ring: Ring, model_name: str, *, inflight: Inflight,
                 live: _Live, count: Callable[[str], None], max_body: int,
                 known_names: set[str], metrics: Metrics | None = None) -> None:
        self.ring, self.model_name = ring, model_name
        self.metrics = metrics
        self.inflight, self.live, self.count = inflight, live, count
        self.max_body = max_body
        self.known_names = known_names
        self.warned_names: set[str] = set()

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed ``max_body``: from
        its Content-Length before reading anything, or while reading a chunked one."""
        too_big = _BadRequest(f"request body exceeds {self.max_body} bytes",
                              code="request_too_large", status=413)
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise _BadRequest("invalid Content-Length header")
            if int(length) > self.max_body:
                raise too_big
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, name: str | None) -> None:
        if name is None or name in self.known_names or name in self.warned_names:
            return
        self.warned_names.add(name)
        log.warning("request for model %r: serving %r (the only model here) under that name",
                    name, self.model_name)

    def _prompt_tokens(self, req: _ChatRequest | _CompletionRequest) -> list[int]:
        tok = self.ring.tokenizer
        if isinstance(req, _ChatRequest):
            msgs, tools = chat_input(req)
            if tools is not None and not template_takes_tools(tok.model.chat_template()):
                raise _BadRequest("this model's chat template does not take tools", "tools")
            try:
                return tok.chat_tokens(msgs, add_generation_prompt=True, tools=tools)
            except ValueError as e:  # the template refused the conversation (raise_exception)
                raise _BadRequest(f"the chat template refused the messages: {e}",
                                  "messages") from None
        return tok.encode(req.text(), add_special=True, parse_special=False)

    def _record(self, gen: Generation, ttft: float | None, kind: str) -> None:
        st = gen.stats
        self.live.add_generation({
            "time": time.time(), "kind": kind, "mode": st.mode, "tokens": st.tokens,
            "prompt_tokens": st.prompt_tokens, "tokens_per_s": round(st.tokens_per_s, 3),
            "laps": st.laps, "steps": st.steps,
            "tokens_per_lap": round(st.tokens / st.laps, 3) if st.laps else 0.0,
            "accepted_hist": {str(k): v for k, v in sorted(st.accepted_hist.items())},
            "ttft_ms": None if ttft is None else round(ttft * 1e3, 1),
            "finish": gen.finish_reason, "recoveries": st.recoveries})

    def _launch(self, name: str, stream: TextStream, cancel: threading.Event,
                kind: str = "chat") -> asyncio.Queue:
        """Run the generation in a thread of its own (it waits there for its turn); pieces,
        then the ``Generation`` (or the exception), then ``None`` arrive on the returned
        queue. A thread per request (not the loop's small default pool) so that requests
        waiting for their turn never starve other work."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def produce() -> None:
            try:
                t0 = time.perf_counter()
                ttft = None
                sent = 0  # log probabilities handed out with the pieces so far
                try:
                    for piece in stream:
                        if ttft is None:
                            ttft = time.perf_counter() - t0  # prefill + first step
                        scored = stream.logprobs[sent:]
                        sent += len(scored)
                        put(_Piece(piece, scored))
                    if len(stream.logprobs) > sent:  # tokens of no text after the last piece
                        put(_Piece("", stream.logprobs[sent:]))
                finally:
                    # Ends the generation (and frees its slot) now, also when this loop
                    # is left by an exception; the ring's stream stops at once on stop
                    # sequences, max_tokens and cancel (the client hung up).
                    stream.close()
                gen = stream.result
                if gen is not None:
                    self._record(gen, ttft, kind)
                # Abandoned: the client hung up (or the server is stopping) and the
                # generation stopped short for it.
                left = gen is not None and gen.finish_reason == "cancelled"
                self.count("abandoned" if left else "completed")
                if self.metrics is not None and gen is not None:
                    self.metrics.requests.labels(kind, "abandoned" if left else
                                                 "completed").inc()
                    self.metrics.finished(kind, gen, ttft)
                put(gen)
            except Exception as exc:  # reported to the client (error body or stream event)
                if not isinstance(exc, errors.RequestError):
                    log.warning("request failed: %s: %s", type(exc).__name__, exc)
                if self.metrics is not None:
                    self.metrics.requests.labels(kind, "failed").inc()
                put(exc)
            finally:
                self.inflight.discard(cancel)
                put(None)

        threading.Thread(target=produce, name=f"edgespec-serve-{name}", daemon=True).start()
        return queue

    def _prepare(self, parse: Callable[[], _ChatRequest | _CompletionRequest]
                 ) -> tuple[Any, Prepared]:
        """Validation, tokenization and the ring's own check (``Ring.prepare``: context room,
        mode, max_tokens fitted): run in a worker thread, since a large prompt takes a while
        to tokenize and must not hold up the event loop."""
        req = parse()
        chat = isinstance(req, _ChatRequest)
        tokens = self._prompt_tokens(req)
        # Chat may use the rest of the context by default (the ring fits it); legacy
        # completions stop after 16 tokens, as OpenAI's do.
        default = self.ring.n_ctx if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        params = generation_params(req, default)
        try:
            prepared = self.ring.prepare(tokens, params)
        except errors.RequestError as e:
            raise _BadRequest(str(e), "messages" if e.param == "prompt" and chat else e.param,
                              code=e.code) from None
        return req, prepared

    async def start(self, parse: Callable[[], _ChatRequest | _CompletionRequest],
                    prefix: str) -> Started:
        """Check (``parse`` builds the checked request, in a worker thread), tokenize, admit
        and launch a request; ``_BadRequest`` for a bad one, 503 while shutting down and
        429 when the queue is full. ``prefix``: the start of the answer's id."""
        req, prepared = await asyncio.to_thread(self._prepare, parse)
        chat = isinstance(req, _ChatRequest)
        kind = "chat" if chat else "completion"
        self.check_model(req.model)
        cancel = threading.Event()
        if not self.inflight.add(cancel):
            raise _BadRequest("the server is shutting down", code="shutting_down",
                              status=503, kind="server_error")
        try:
            ticket = self.ring.admit()
        except errors.RingBusy:
            self.inflight.discard(cancel)
            self.count("rejected")
            if self.metrics is not None:
                self.metrics.requests.labels(kind, "rejected").inc()
            # Retry-After: clients wait this long before their automatic retries.
            limit = self.ring.scheduler.max_queue
            raise _BadRequest(f"server busy: {limit} requests already queued; retry later",
                              code="rate_limit_exceeded", status=429,
                              kind="rate_limit_exceeded", headers={"Retry-After": "1"}
                              ) from None
        rid = prefix + uuid.uuid4().hex[:24]
        # A request cancelled while queued (the client left) withdraws at once and never
        # reaches the ring.
        queue = self._launch(rid, self.ring.stream_prepared(prepared, cancel, ticket),
                             cancel, kind)
        return Started(rid, int(time.time()), req, tool_names(req) if chat else None,
                       queue, cancel, len(prepared.prompt))

    async def collect(self, request: Request, run: Started) -> Generation:
        """The whole generation of a request answered in one body; the failure that ended
        it is raised, and a shutdown that cut it is a 503 ``_BadRequest``."""
        gen: Generation | None = None
        failure: Exception | None = None
        getter: asyncio.Task | None = None
        next_check = time.monotonic() + 0.5
        try:
            while True:
                # Nothing streams back to a plain request, so look for a hang-up every half
                # second (pieces keep arriving meanwhile, so not only on a quiet queue).
                if time.monotonic() >= next_check and not run.cancel.is_set():
                    next_check = time.monotonic() + 0.5
                    if await request.is_disconnected():
                        run.cancel.set()
                # One pending get at a time, never cancelled: no item can be lost to a timeout.
                getter = getter or asyncio.ensure_future(run.queue.get())
                done, _ = await asyncio.wait({getter}, timeout=0.5)
                if not done:
                    continue
                item, getter = getter.result(), None
                if item is None:
                    break
                if isinstance(item, Generation):
                    gen = item
                elif isinstance(item, Exception):
                    failure = item
        finally:
            if gen is None:
                run.cancel.set()
            if getter is not None:
                getter.cancel()
        if failure is not None:
            raise failure
        if gen is None:
            raise _BadRequest("the request was cancelled", code="cancelled", status=503,
                              kind="server_error")
        if gen.finish_reason == "cancelled":
            # Only a shutdown cuts an answer that still has a listener: say so, so the client
            # does not take the text so far for the whole answer.
            raise _BadRequest(f"the server is shutting down: the answer was cut off after "
                              f"{gen.stats.tokens} token(s); retry", code="shutting_down",
                              status=503, kind="server_error")
        return gen

    async def items(self, run: Started) -> AsyncIterator[_Piece | Generation | Exception]:
        """A streamed request's items as they come: pieces, then the ``Generation`` (or the
        exception that ended it). Leaving early (the client hung up) stops the generation."""
        try:
            while True:
                item = await run.queue.get()
                if item is None:
                    return
                yield item
        finally:
            # Reached on normal end too (harmless then); on a hang-up it stops the generation.
            run.cancel.set()


def streamed(run: Started, events: AsyncIterator[bytes], media_type: str
             ) -> StreamingResponse:
    """A door's stream of ``run``: when the client hangs up mid-stream (or the stream ends)
    the generation is stopped at its next step."""
    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in events:
                yield chunk
        finally:
            run.cancel.set()

    return StreamingResponse(guarded(), media_type=media_type)


def cut_off(gen: Generation) -> str:
    """What a stream says of an answer a shutdown cut off."""
    return (f"the server is shutting down: the answer was cut off after {gen.stats.tokens} "
            "token(s)")
