"""The completion endpoints' generations: the request checked at the edge, its place in the
ring's queue (``Ring.admit``: 429 at once when full), the generation thread, and the answer
as one JSON body or as server-sent events (OpenAI's chunk format)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from edgespec import errors
from edgespec.api import Generation, Prepared, Ring, TextStream
from edgespec.head.output import TokenLogprob
from edgespec.head.tools import template_takes_tools
from edgespec.server.chat_input import (
    Deltas,
    answer_message,
    chat_input,
    finish_reason,
    tool_names,
)
from edgespec.server.health import Metrics
from edgespec.server.inflight import Inflight
from edgespec.server.live import _Live
from edgespec.server.replies import _error, _failure, _failure_message
from edgespec.server.requests import (
    _BadRequest,
    _ChatRequest,
    _CompletionRequest,
    generation_params,
    parse_request,
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


class Completions:
    """``POST /v1/completions`` and ``/v1/chat/completions``: a request is checked and
    tokenized off the event loop, takes its place in the ring's queue, runs in a thread of its
    own once the scheduler gives it a slot (up to ``Ring.parallel`` at once), and answers as
    one body or as server-sent events; a client that hangs up stops it (or withdraws it from
    the queue)."""

    def __init__(self, ring: Ring, model_name: str, *, inflight: Inflight,
                 live: _Live, count: Callable[[str], None], max_body: int,
                 known_names: set[str], metrics: Metrics | None = None) -> None:
        self.ring, self.model_name = ring, model_name
        self.metrics = metrics
        self.inflight, self.live, self.count = inflight, live, count
        self.max_body = max_body
        self.known_names = known_names
        self.warned_names: set[str] = set()

    async def completions(self, request: Request) -> Any:
        return await self._run(request, chat=False)

    async def chat_completions(self, request: Request) -> Any:
        return await self._run(request, chat=True)

    async def _read_body(self, request: Request) -> bytes:
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

    def _check_model(self, name: str | None) -> None:
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

    def _usage(self, gen: Generation) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": gen.stats.prompt_tokens,
                                 "completion_tokens": gen.stats.tokens,
                                 "total_tokens": gen.stats.prompt_tokens + gen.stats.tokens}
        ttft = getattr(gen.stats, "ttft_ms", None)
        if ttft is not None:  # the ring's own figure: request start to first token
            usage["time_to_first_token_ms"] = round(float(ttft), 1)
        return usage

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
            except Exception as exc:  # reported to the client (error body or SSE event)
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

    def _prepare(self, raw: bytes, chat: bool) -> tuple[Any, Prepared]:
        """Validation, tokenization and the ring's own check (``Ring.prepare``: context room,
        mode, max_tokens fitted): run in a worker thread, since a large prompt takes a while
        to tokenize and must not hold up the event loop."""
        req = parse_request(raw, chat)
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

    async def _run(self, request: Request, chat: bool) -> Any:
        raw = await self._read_body(request)
        req, prepared = await asyncio.to_thread(self._prepare, raw, chat)
        self._check_model(req.model)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        cancel = threading.Event()
        if not self.inflight.add(cancel):
            return _error(503, "the server is shutting down", "server_error",
                          code="shutting_down")
        try:
            ticket = self.ring.admit()
        except errors.RingBusy:
            self.inflight.discard(cancel)
            self.count("rejected")
            if self.metrics is not None:
                self.metrics.requests.labels("chat" if chat else "completion", "rejected").inc()
            # Retry-After: OpenAI clients wait this long before their automatic retries.
            limit = self.ring.scheduler.max_queue
            return _error(429, f"server busy: {limit} requests already queued; retry later",
                          "rate_limit_exceeded", code="rate_limit_exceeded",
                          headers={"Retry-After": "1"})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        # A request cancelled while queued (the client left) withdraws at once and never
        # reaches the ring.
        queue = self._launch(rid, self.ring.stream_prepared(prepared, cancel, ticket),
                             cancel, "chat" if chat else "completion")

        names = tool_names(req) if chat else None
        if req.stream:
            return StreamingResponse(
                self._sse(queue, cancel, chat, rid, created, include_usage, names),
                media_type="text/event-stream")

        gen: Generation | None = None
        failure: Exception | None = None
        getter: asyncio.Task | None = None
        next_check = time.monotonic() + 0.5
        try:
            while True:
                # Nothing streams back to a plain request, so look for a hang-up every half
                # second (pieces keep arriving meanwhile, so not only on a quiet queue).
                if time.monotonic() >= next_check and not cancel.is_set():
                    next_check = time.monotonic() + 0.5
                    if await request.is_disconnected():
                        cancel.set()
                # One pending get at a time, never cancelled: no item can be lost to a timeout.
                getter = getter or asyncio.ensure_future(queue.get())
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
                cancel.set()
            if getter is not None:
                getter.cancel()
        if failure is not None:
            status, kind, code, param = _failure(failure)
            return _error(status, _failure_message(failure), kind, code=code, param=param)
        if gen is None:
            return _error(503, "the request was cancelled", "server_error", code="cancelled")
        if gen.finish_reason == "cancelled":
            # Only a shutdown cuts an answer that still has a listener: say so, so the client
            # does not take the text so far for the whole answer.
            return _error(503, f"the server is shutting down: the answer was cut off after "
                          f"{gen.stats.tokens} token(s); retry", "server_error",
                          code="shutting_down")
        scores = gen.logprobs
        if chat:
            message, called = answer_message(gen.text, names)
            choice = {"index": 0, "finish_reason": finish_reason(gen.finish_reason, called),
                      "message": message,
                      "logprobs": None if scores is None else
                      {"content": self._chat_logprobs(scores), "refusal": None}}
        else:
            choice = {"index": 0, "finish_reason": gen.finish_reason, "text": gen.text,
                      "logprobs": None if scores is None else
                      self._completion_logprobs(scores, 0)}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": self.model_name, "choices": [choice],
                "usage": self._usage(gen)}

    def _token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.ring.tokenizer.piece(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_logprobs(self, scores: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Chat's ``logprobs.content``: per token its text, bytes, log probability and the
        most likely tokens' (``top_logprobs``)."""
        out = []
        for s in scores:
            text, raw = self._token_text(s.token)
            top = []
            for t, lp in s.top:
                t_text, t_raw = self._token_text(t)
                top.append({"token": t_text, "logprob": lp, "bytes": t_raw})
            out.append({"token": text, "logprob": s.logprob, "bytes": raw, "top_logprobs": top})
        return out

    def _completion_logprobs(self, scores: Sequence[TokenLogprob], offset: int
                             ) -> dict[str, Any]:
        """Completions' ``logprobs``: tokens, their log probabilities, the most likely
        tokens' as ``{text: logprob}`` and each token's offset in the text (from
        ``offset``)."""
        tokens, offsets = [], []
        for s in scores:
            offsets.append(offset)
            text = self._token_text(s.token)[0]
            offset += len(text)
            tokens.append(text)
        return {"tokens": tokens, "token_logprobs": [s.logprob for s in scores],
                "top_logprobs": [{self._token_text(t)[0]: lp for t, lp in s.top}
                                 for s in scores],
                "text_offset": offsets}

    async def _sse(self, queue: asyncio.Queue, cancel: threading.Event, chat: bool, rid: str,
                   created: int, include_usage: bool, names: list[str] | None = None
                   ) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        offset = 0  # completions' text_offset: characters of text before a chunk's tokens
        deltas = Deltas(names)  # chat: the text as content, or content and tool calls

        def event(payload: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(payload)}\n\n".encode()

        def chunk(delta: str | dict[str, Any] | None, finish: str | None,
                  first: bool = False, scores: Sequence[TokenLogprob] = ()) -> bytes:
            nonlocal offset
            if chat:
                d: dict[str, Any] = {"role": "assistant"} if first else {}
                d.update(delta or {})
                choice = {"index": 0, "delta": d, "finish_reason": finish,
                          "logprobs": {"content": self._chat_logprobs(scores), "refusal": None}
                          if scores else None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish,
                          "logprobs": self._completion_logprobs(scores, offset)
                          if scores else None}
                offset += len(delta or "")
            return event({"id": rid, "object": obj, "created": created, "model": self.model_name,
                          "choices": [choice]})

        try:
            if chat:
                yield chunk(None, None, first=True)
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    _, kind, code, param = _failure(item)
                    yield event({"error": {"message": _failure_message(item), "type": kind,
                                           "param": param, "code": code}})
                    continue
                if isinstance(item, Generation):
                    if include_usage:  # the usage so far, also for an answer cut off
                        usage = event({"id": rid, "object": obj, "created": created,
                                       "model": self.model_name, "choices": [],
                                       "usage": self._usage(item)})
                    if item.finish_reason == "cancelled":
                        # Cut off by a shutdown: the usage, then an error event and no [DONE],
                        # so the client knows the text it has is not the whole answer.
                        if include_usage:
                            yield usage
                        yield event({"error": {
                            "message": f"the server is shutting down: the answer was cut off "
                                       f"after {item.stats.tokens} token(s)",
                            "type": "server_error", "param": None, "code": "shutting_down"}})
                        return
                    if chat:
                        for d in deltas.finish():
                            yield chunk(d, None)
                    yield chunk(None, finish_reason(item.finish_reason, deltas.called > 0))
                    if include_usage:
                        yield usage
                    continue
                if not chat:
                    yield chunk(item.text, None, scores=item.scores)
                    continue
                # A piece's log probabilities ride with its first delta (or an empty one
                # while its text is held back as the possible start of a call).
                scores = item.scores
                for d in deltas.feed(item.text) or ([{}] if scores else []):
                    yield chunk(d, None, scores=scores)
                    scores = ()
            yield b"data: [DONE]\n\n"
        finally:
            # Reached on normal end too (harmless then); on a hang-up it stops the generation.
            cancel.set()
