"""OpenAI-compatible HTTP server over a ring (`edgespec serve`).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, with
``stream: true`` as server-sent events, usage counts, stop sequences and errors in OpenAI's
shape (``{"error": {"message", "type", "param", "code"}}``).

One ring holds one KV cache, so requests run one at a time in arrival order (a FIFO lock):
nothing from one request can leak into another's context. The queue is bounded
(``max_queue``); a request beyond it gets 429 at once instead of waiting without end.
FastAPI/uvicorn are used because they are the standard ASGI stack for this kind of API.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .api import Generation, Ring


class _Fifo:
    """A bounded first-come-first-served gate for the single ring."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._next_ticket = 0
        self._serving = 0
        self._waiting = 0

    def try_enter(self) -> int | None:
        with self._lock:
            if self._waiting >= self.max_queue:
                return None
            self._waiting += 1
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def wait_turn(self, ticket: int) -> None:
        with self._cond:
            while self._serving != ticket:
                self._cond.wait()

    def leave(self) -> None:
        with self._cond:
            self._waiting -= 1
            self._serving += 1
            self._cond.notify_all()


def _error(status: int, message: str, err_type: str, code: str | None = None,
           param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={
        "error": {"message": message, "type": err_type, "param": param, "code": code}})


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _sampling_args(body: dict[str, Any]) -> dict[str, Any]:
    def num(name: str, default: Any, kind: type, lo: float, hi: float) -> Any:
        value = body.get(name, default)
        if value is None:
            value = default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _BadRequest(f"'{name}' must be a number", name)
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
    return {
        "max_tokens": num("max_tokens", 128, int, 1, 1 << 20),
        "temperature": num("temperature", 1.0, float, 0.0, 2.0),
        "top_p": num("top_p", 1.0, float, 0.0, 1.0),
        "seed": num("seed", 0, int, -(1 << 63), (1 << 63) - 1),
        "stop": stops,
    }


def create_app(ring: Ring, model_name: str, max_queue: int = 16) -> FastAPI:
    """The ASGI app serving ``ring`` under ``model_name``."""
    app = FastAPI(title="edgespec", version="1")
    gate = _Fifo(max_queue)

    @app.exception_handler(_BadRequest)
    async def _bad_request(_: Request, exc: _BadRequest) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error", param=exc.param)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "edgespec"}]}

    async def _parse(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise _BadRequest("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _BadRequest("request body must be a JSON object")
        model = body.get("model")
        if model not in (None, model_name):
            raise _BadRequest(f"model {model!r} is not served here; use {model_name!r}", "model")
        return body

    def _usage(gen: Generation) -> dict[str, int]:
        return {"prompt_tokens": gen.stats.prompt_tokens,
                "completion_tokens": gen.stats.tokens,
                "total_tokens": gen.stats.prompt_tokens + gen.stats.tokens}

    async def _run(request: Request, chat: bool) -> Any:
        body = await _parse(request)
        args = _sampling_args(body)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("content"), str)
                    and m.get("role") in ("system", "user", "assistant") for m in messages):
                raise _BadRequest("'messages' must be a non-empty list of {role, content}",
                                  "messages")
            source: Any = [{"role": m["role"], "content": m["content"]} for m in messages]
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise _BadRequest("'prompt' must be a string", "prompt")
            source = prompt
        ticket = gate.try_enter()
        if ticket is None:
            return _error(429, f"server busy: {max_queue} requests already queued; retry later",
                          "rate_limit_exceeded", code="rate_limit_exceeded")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())

        def start() -> Iterator[str]:
            gate.wait_turn(ticket)
            if chat:
                return ring.stream_chat(source, **args)
            return ring.stream(source, **args)

        if not body.get("stream"):
            def work() -> Generation:
                try:
                    stream = start()
                    for _ in stream:
                        pass
                    return stream.result  # type: ignore[attr-defined]
                finally:
                    gate.leave()

            gen = await asyncio.to_thread(work)
            if chat:
                choice = {"index": 0, "finish_reason": gen.finish_reason,
                          "message": {"role": "assistant", "content": gen.text}}
            else:
                choice = {"index": 0, "finish_reason": gen.finish_reason, "text": gen.text,
                          "logprobs": None}
            return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                    "created": created, "model": model_name, "choices": [choice],
                    "usage": _usage(gen)}

        return StreamingResponse(_sse(start, chat, rid, created), media_type="text/event-stream")

    async def _sse(start, chat: bool, rid: str, created: int) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        def produce() -> None:
            try:
                stream = start()
                for piece in stream:
                    loop.call_soon_threadsafe(queue.put_nowait, piece)
                loop.call_soon_threadsafe(queue.put_nowait, stream.result)
            except Exception as exc:  # reported to the client as an SSE error event
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            finally:
                gate.leave()
                loop.call_soon_threadsafe(queue.put_nowait, done)

        threading.Thread(target=produce, name="edgespec-serve", daemon=True).start()
        obj = "chat.completion.chunk" if chat else "text_completion"

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
            payload = {"id": rid, "object": obj, "created": created, "model": model_name,
                       "choices": [choice]}
            return f"data: {json.dumps(payload)}\n\n".encode()

        if chat:
            yield chunk(None, None, first=True)
        while True:
            item = await queue.get()
            if item is done:
                break
            if isinstance(item, Exception):
                err = {"error": {"message": str(item), "type": "server_error", "param": None,
                                 "code": None}}
                yield f"data: {json.dumps(err)}\n\n".encode()
                continue
            if isinstance(item, Generation):
                yield chunk(None, item.finish_reason)
                continue
            yield chunk(item, None)
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _run(request, chat=True)

    return app


def serve(ring: Ring, model_name: str, host: str = "127.0.0.1", port: int = 8080,
          max_queue: int = 16) -> None:
    """Run the server until interrupted."""
    import uvicorn

    uvicorn.run(create_app(ring, model_name, max_queue), host=host, port=port, log_level="info")
