"""OpenAI-compatible HTTP server over a ring (`edgespec serve`).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, with
``stream: true`` as server-sent events (``stream_options.include_usage`` adds a final usage
chunk), usage counts, stop sequences and errors in OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``) for every status, including 404s.
``GET /health`` reports whether a request is being served, how many wait, and how many
were completed, abandoned by their client, or rejected.

One ring holds one KV cache, so requests run one at a time in arrival order (a FIFO gate):
nothing from one request can leak into another's context. The queue is bounded: besides the
request being served, at most ``max_queue`` wait; one beyond that gets 429 at once instead of
waiting without end. A client that disconnects stops its generation at the next round (or
before it starts, if it was still queued), so abandoned requests do not hold the ring.
FastAPI/uvicorn are used because they are the standard ASGI stack for this kind of API.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .api import Generation, Ring, TextStream

#: Legacy completions stop after 16 tokens when max_tokens is omitted (OpenAI's default);
#: chat completions may use the rest of the context, as OpenAI's do.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _Gate:
    """A bounded first-come-first-served gate for the single ring: one request inside, up to
    ``max_queue`` waiting behind it, in ticket order."""

    def __init__(self, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0  # the ticket whose turn it is
        self._admitted = 0  # tickets handed out and not yet left (serving + waiting)

    def try_enter(self) -> int | None:
        """A ticket, or None when ``max_queue`` requests already wait."""
        with self._cond:
            if self._admitted > self.max_queue:  # one is served, max_queue wait: full
                return None
            self._admitted += 1
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def wait_turn(self, ticket: int) -> None:
        with self._cond:
            while self._serving != ticket:
                self._cond.wait()

    def leave(self) -> None:
        """End the current turn (called exactly once per ticket, after its turn came)."""
        with self._cond:
            self._admitted -= 1
            self._serving += 1
            self._cond.notify_all()

    def state(self) -> dict[str, int]:
        with self._cond:
            return {"serving": min(self._admitted, 1), "queued": max(self._admitted - 1, 0),
                    "max_queue": self.max_queue}


def _error(status: int, message: str, err_type: str, code: str | None = None,
           param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": err_type, "param": param, "code": code}})


class _BadRequest(Exception):
    """A client error, answered as OpenAI does (400, or 404 for an unknown model)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status


def _sampling_args(body: dict[str, Any]) -> dict[str, Any]:
    def num(name: str, default: Any, kind: type, lo: float, hi: float) -> Any:
        value = body.get(name, default)
        if value is None:
            value = default
        if value is None:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _BadRequest(f"'{name}' must be a number", name)
        if kind is int and value != int(value):
            raise _BadRequest(f"'{name}' must be an integer", name)
        if not lo <= value <= hi:
            raise _BadRequest(f"'{name}' must be between {lo} and {hi}", name)
        return kind(value)

    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise _BadRequest("'stop' must be a string or a list of up to 4 strings", "stop")
    if body.get("n", 1) not in (1, None):
        raise _BadRequest("only n=1 is supported", "n")
    # Newer clients send max_completion_tokens (chat); it means the same here.
    max_tokens = num("max_tokens", None, int, 1, 1 << 20)
    if max_tokens is None:
        max_tokens = num("max_completion_tokens", None, int, 1, 1 << 20)
    return {
        "max_tokens": max_tokens,
        "temperature": num("temperature", 1.0, float, 0.0, 2.0),
        "top_p": num("top_p", 1.0, float, 0.0, 1.0),
        "seed": num("seed", 0, int, -(1 << 63), (1 << 63) - 1),
        "stop": stops,
    }


def _message_text(content: Any) -> str | None:
    """A message's text: a string, or the text parts of a content-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    return None


def create_app(ring: Ring, model_name: str, max_queue: int = 16) -> FastAPI:
    """The ASGI app serving ``ring`` under ``model_name``."""
    app = FastAPI(title="edgespec", version="1")
    gate = _Gate(max_queue)

    @app.exception_handler(_BadRequest)
    async def _bad_request(_: Request, exc: _BadRequest) -> JSONResponse:
        return _error(exc.status, str(exc), "invalid_request_error", code=exc.code,
                      param=exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods answer in OpenAI's shape too, so clients can parse it.
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"{type(exc).__name__}: {exc}", "server_error")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "edgespec"}]}

    counts = {"completed": 0, "abandoned": 0, "rejected": 0}
    counts_lock = threading.Lock()

    def count(what: str) -> None:
        with counts_lock:
            counts[what] += 1

    @app.get("/health")
    async def health() -> dict[str, Any]:
        with counts_lock:
            done = dict(counts)
        return {"status": "ok", "model": model_name, **gate.state(), **done}

    async def _parse(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise _BadRequest("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        model = body.get("model")
        if model not in (None, model_name):
            raise _BadRequest(f"model {model!r} is not served here; use {model_name!r}",
                              "model", code="model_not_found", status=404)
        return body

    def _prompt_tokens(body: dict[str, Any], chat: bool) -> list[int]:
        tok = ring.tokenizer
        if chat:
            messages = body.get("messages")
            ok = isinstance(messages, list) and bool(messages)
            msgs = []
            for m in messages if ok else ():
                text = _message_text(m.get("content")) if isinstance(m, dict) else None
                if text is None or m.get("role") not in ("system", "user", "assistant"):
                    ok = False
                    break
                msgs.append({"role": m["role"], "content": text})
            if not ok:
                raise _BadRequest("'messages' must be a non-empty list of {role, content} with "
                                  "role system, user or assistant and text content", "messages")
            return tok.chat_tokens(msgs, add_generation_prompt=True)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _BadRequest("'prompt' must be a non-empty string", "prompt")
        return tok.encode(prompt, add_special=True, parse_special=False)

    def _usage(gen: Generation) -> dict[str, int]:
        return {"prompt_tokens": gen.stats.prompt_tokens,
                "completion_tokens": gen.stats.tokens,
                "total_tokens": gen.stats.prompt_tokens + gen.stats.tokens}

    def _launch(ticket: int, make_stream: Callable[[], TextStream], cancel: threading.Event,
                max_tokens: int) -> asyncio.Queue:
        """Run the generation in a thread of its own once its turn comes; pieces, then the
        ``Generation`` (or the exception), then ``None`` arrive on the returned queue.
        A thread per request (not the loop's small default pool) so that requests waiting
        for their turn never starve other work."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def produce() -> None:
            try:
                gate.wait_turn(ticket)
                if cancel.is_set():  # the client left while queued: skip it entirely
                    count("abandoned")
                    return
                stream = make_stream()
                for piece in stream:
                    put(piece)
                gen = stream.result
                # Abandoned: the client hung up and the generation stopped short for it.
                left = cancel.is_set() and gen is not None and gen.stats.tokens < max_tokens
                count("abandoned" if left else "completed")
                put(gen)
            except Exception as exc:  # reported to the client (error body or SSE event)
                put(exc)
            finally:
                gate.leave()
                put(None)

        threading.Thread(target=produce, name=f"edgespec-serve-{ticket}", daemon=True).start()
        return queue

    async def _run(request: Request, chat: bool) -> Any:
        body = await _parse(request)
        args = _sampling_args(body)
        tokens = _prompt_tokens(body, chat)
        room = ring.n_ctx - len(tokens)
        if args["max_tokens"] is None:
            args["max_tokens"] = room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        if room < 1 or args["max_tokens"] > room:
            raise _BadRequest(
                f"this model's context is {ring.n_ctx} tokens; the prompt has {len(tokens)} "
                f"and max_tokens asks for {args['max_tokens']} more",
                "messages" if chat else "prompt", code="context_length_exceeded")
        stream_opts = body.get("stream_options") or {}
        if not isinstance(stream_opts, dict):
            raise _BadRequest("'stream_options' must be an object", "stream_options")
        ticket = gate.try_enter()
        if ticket is None:
            count("rejected")
            # Retry-After: OpenAI clients wait this long before their automatic retries.
            return _error(429, f"server busy: {max_queue} requests already queued; retry later",
                          "rate_limit_exceeded", code="rate_limit_exceeded",
                          headers={"Retry-After": "1"})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        cancel = threading.Event()
        queue = _launch(ticket, lambda: ring.stream_tokens(tokens, cancel=cancel, **args),
                        cancel, args["max_tokens"])

        if body.get("stream"):
            return StreamingResponse(
                _sse(queue, cancel, chat, rid, created, bool(stream_opts.get("include_usage"))),
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
        if failure is not None or gen is None:
            return _error(500, f"generation failed: {failure or 'cancelled'}", "server_error")
        if chat:
            choice = {"index": 0, "finish_reason": gen.finish_reason,
                      "message": {"role": "assistant", "content": gen.text}}
        else:
            choice = {"index": 0, "finish_reason": gen.finish_reason, "text": gen.text,
                      "logprobs": None}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": created, "model": model_name, "choices": [choice],
                "usage": _usage(gen)}

    async def _sse(queue: asyncio.Queue, cancel: threading.Event, chat: bool, rid: str,
                   created: int, include_usage: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(payload: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(payload)}\n\n".encode()

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> bytes:
            if chat:
                d: dict[str, Any] = {}
                if first:
                    d["role"] = "assistant"
                if delta:
                    d["content"] = delta
                choice = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish,
                          "logprobs": None}
            return event({"id": rid, "object": obj, "created": created, "model": model_name,
                          "choices": [choice]})

        try:
            if chat:
                yield chunk(None, None, first=True)
            while True:
                item = await queue.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    yield event({"error": {"message": f"generation failed: {item}",
                                           "type": "server_error", "param": None,
                                           "code": None}})
                    continue
                if isinstance(item, Generation):
                    yield chunk(None, item.finish_reason)
                    if include_usage:
                        yield event({"id": rid, "object": obj, "created": created,
                                     "model": model_name, "choices": [],
                                     "usage": _usage(item)})
                    continue
                yield chunk(item, None)
            yield b"data: [DONE]\n\n"
        finally:
            # Reached on normal end too (harmless then); on a hang-up it stops the generation.
            cancel.set()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _run(request, chat=True)

    return app


def serve(ring: Ring, model_name: str, host: str = "127.0.0.1", port: int = 8080,
          max_queue: int = 16) -> None:
    """Run the server until SIGINT or SIGTERM, then return (so the caller closes the ring)."""
    import uvicorn

    # uvicorn shuts down gracefully on these signals and then re-raises the signal into the
    # handler that was installed before it. With the defaults that is KeyboardInterrupt (a
    # traceback) or, for SIGTERM, instant death: the caller never closes the ring, and a
    # local ring's node processes would outlive the server. A no-op handler makes run() simply
    # return instead.
    saved: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            saved[sig] = signal.signal(sig, lambda *_: None)
    try:
        uvicorn.run(create_app(ring, model_name, max_queue), host=host, port=port,
                    log_level="info")
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
