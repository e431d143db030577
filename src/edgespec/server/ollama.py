"""The Ollama API on the server's port (the door Open WebUI, Continue, Zed and Home Assistant
knock on): ``POST /api/chat`` and ``/api/generate`` (newline-delimited JSON when streamed,
Ollama's default, or one body), ``GET /api/tags``, ``/api/ps``, ``/api/version`` and
``POST /api/show``.

A request becomes the OpenAI chat request (``doors.openai_chat``; ``raw`` generate: a
completion) that the OpenAI door runs: ``options`` (every sampler field of
``edgespec.sampling.FIELDS``, which Ollama names alike, and ``num_predict``, ``stop``) onto
the same ``GenerationParams``, ``format`` (``"json"`` or a JSON
schema) as its grammar, ``tools`` and the messages' ``tool_calls`` / tool results as its
tools and messages. Any other option, and a field asking for what this server does not do
(images, ``think``, ``suffix``, ``template``, ``context``, ``keep_alive`` 0), is a 400 naming
it. Errors are Ollama's ``{"error": message}`` with the status."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

import edgespec
from edgespec.api import Generation
from edgespec.sampling import FIELDS
from edgespec.server.chat_input import Deltas, answer_message
from edgespec.server.doors import (
    answered_in,
    call_arguments,
    check,
    json_schema_format,
    openai_chat,
    read_json,
    unsupported,
)
from edgespec.server.replies import _failure_message
from edgespec.server.requests import _BadRequest, parse_request
from edgespec.server.runs import Runs, Started, _Piece, cut_off, streamed

_Str = Annotated[str, Field(strict=True)]

#: Ollama's options this server honours, as the OpenAI request's fields they become.
#: Every sampler field (``edgespec.sampling.FIELDS``) is an Ollama option of the same name.
OPTIONS = {**{k.name: k.name for k in FIELDS}, "num_predict": "max_tokens", "stop": "stop"}


#: OpenAI's names of the fields Ollama names otherwise, for the refusals' messages.
RENAMES = {"max_tokens": "num_predict", "response_format": "format"}


def _error(status: int, message: str, _kind: str = "", _code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class _CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: _Str
    arguments: dict[_Str, Any]
    index: int | None = None


class _Call(BaseModel):
    model_config = ConfigDict(extra="forbid")
    function: _CalledFunction


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: _Str = ""
    tool_calls: list[_Call] | None = None
    tool_name: _Str | None = None  # a tool result: the function that gave it
    images: Any = None
    thinking: Any = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: _Str
    format: Literal["", "json"] | dict[_Str, Any] | None = None
    options: dict[_Str, Any] | None = None
    stream: Annotated[bool, Field(strict=True)] = True
    keep_alive: int | float | _Str | None = None
    think: Any = None


class _Chat(_Common):
    messages: list[_Message] = []
    tools: list[dict[_Str, Any]] | None = None


class _Generate(_Common):
    prompt: _Str = ""
    system: _Str | None = None
    raw: Annotated[bool, Field(strict=True)] = False
    suffix: Any = None
    images: Any = None
    template: Any = None
    context: Any = None


def _refuse_unasked(req: _Common) -> None:
    """A field asking for what this server does not do: a ``_BadRequest`` naming it."""
    if req.think not in (None, False):
        raise unsupported("think", "this model does not think aloud; send false or leave it out")
    if req.keep_alive in (0, "0", "0s"):
        raise unsupported("keep_alive", "the ring's model stays loaded while the server runs")
    for name in ("suffix", "images", "template", "context"):
        if getattr(req, name, None):
            raise unsupported(name)
    for i, m in enumerate(getattr(req, "messages", ())):
        if m.images:
            raise unsupported(f"messages[{i}].images", "this model reads text only")
        if m.thinking:
            raise unsupported(f"messages[{i}].thinking")


def _options(options: dict[str, Any] | None) -> dict[str, Any]:
    """``options`` as the OpenAI request's fields; one this server cannot honour is refused."""
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if name not in OPTIONS:
            raise _BadRequest(f"option '{name}' is not supported by this server (it honours "
                              f"{', '.join(OPTIONS)})", "options", code="unsupported_parameter")
        if name == "num_predict" and type(value) is int and value < 0:
            continue  # -1: until the answer ends, -2: until the context fills (the default)
        out[OPTIONS[name]] = value
    return out


def _format(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if not fmt:
        return None
    return {"type": "json_object"} if fmt == "json" else json_schema_format(fmt)


def _messages(messages: list[_Message]) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's: calls get ids, and a tool result answers the earliest
    open call of its function (or the earliest open call)."""
    out: list[dict[str, Any]] = []
    open_calls: list[tuple[str, str]] = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            calls = [{"id": f"call_{i}_{j}", "type": "function",
                      "function": {"name": c.function.name,
                                   "arguments": json.dumps(c.function.arguments)}}
                     for j, c in enumerate(m.tool_calls)]
            open_calls += [(c["id"], c["function"]["name"]) for c in calls]
            msg.update(tool_calls=calls, content=m.content or None)
        if m.role == "tool":
            match = next((c for c in open_calls if c[1] == m.tool_name), None) or \
                (open_calls[0] if open_calls else (f"call_{i}", ""))
            if match in open_calls:
                open_calls.remove(match)
            msg["tool_call_id"] = match[0]
        out.append(msg)
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _ollama_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"function": {"name": c["function"]["name"],
                          "arguments": call_arguments(c["function"]["arguments"])}}
            for c in calls]


class OllamaDoor:
    """The Ollama endpoints over ``runs`` (the one path every door takes)."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs
        self.model_name = runs.model_name

    def routes(self, app: FastAPI) -> None:
        guard = answered_in(_error)
        app.post("/api/chat")(guard(self.chat))
        app.post("/api/generate")(guard(self.generate))
        app.post("/api/show")(guard(self.show))
        app.get("/api/tags")(guard(self.tags))
        app.get("/api/ps")(guard(self.ps))
        app.get("/api/version")(guard(self.version))

    def _model(self) -> dict[str, Any]:
        ring = self.runs.ring
        return {"name": self.model_name, "model": self.model_name, "modified_at": _now(),
                "size": 0, "digest": "",
                "details": {"format": "gguf", "family": "", "families": None,
                            "parameter_size": "", "quantization_level": "",
                            "parent_model": ""},
                "edgespec": {"gguf": ring.model_name + ".gguf", "parallel": ring.parallel}}

    async def tags(self) -> dict[str, Any]:
        return {"models": [self._model()]}

    async def ps(self) -> dict[str, Any]:
        return {"models": [{**self._model(), "expires_at": None, "size_vram": 0}]}

    async def version(self) -> dict[str, Any]:
        return {"version": edgespec.__version__}

    async def show(self, request: Request) -> dict[str, Any]:
        body = await read_json(self.runs, request)
        if not isinstance(body, dict) or not isinstance(body.get("model") or body.get("name"),
                                                        str):
            raise _BadRequest("'model' is required", "model")
        tok = self.runs.ring.tokenizer
        template = tok.model.chat_template() or ""
        return {"modelfile": "", "parameters": "", "template": template,
                "details": self._model()["details"], "model_info": {},
                "capabilities": ["completion", "tools"] if "tools" in template
                else ["completion"], "modified_at": _now()}

    async def chat(self, request: Request) -> Response:
        req = check(_Chat, await read_json(self.runs, request))
        _refuse_unasked(req)
        if not req.messages:  # Ollama's way to load a model: answered at once
            return self._loaded(req, {"message": {"role": "assistant", "content": ""}})
        body = {"model": req.model, "messages": _messages(req.messages), "tools": req.tools,
                "response_format": _format(req.format), **_options(req.options)}
        run = await self.runs.start(lambda: openai_chat(body, RENAMES), "chat-")
        return await self._answer(request, req, run, "message")

    async def generate(self, request: Request) -> Response:
        req = check(_Generate, await read_json(self.runs, request))
        _refuse_unasked(req)
        if not req.prompt:
            return self._loaded(req, {"response": ""})
        options = _options(req.options)
        if req.raw:
            if req.format:
                raise _BadRequest("'format' needs the chat template: leave out 'raw'", "format")
            if req.system:
                raise _BadRequest("'system' needs the chat template: leave out 'raw'", "system")
            body = {"model": req.model, "prompt": req.prompt,
                    "max_tokens": self.runs.ring.n_ctx, **options}
            run = await self.runs.start(lambda: parse_request(body, chat=False), "gen-")
        else:
            msgs = [{"role": "system", "content": req.system}] if req.system else []
            body = {"model": req.model, "response_format": _format(req.format), **options,
                    "messages": [*msgs, {"role": "user", "content": req.prompt}]}
            run = await self.runs.start(lambda: openai_chat(body, RENAMES), "gen-")
        return await self._answer(request, req, run, "response")

    def _loaded(self, req: _Common, empty: dict[str, Any]) -> Response:
        return JSONResponse({"model": req.model, "created_at": _now(), **empty, "done": True,
                             "done_reason": "load"})

    def _final(self, req: _Common, gen: Generation, t0: float) -> dict[str, Any]:
        st = gen.stats
        eval_ns = int(st.tokens / st.tokens_per_s * 1e9) if st.tokens_per_s else 0
        total = int((time.perf_counter() - t0) * 1e9)
        return {"model": req.model, "created_at": _now(), "done": True,
                "done_reason": gen.finish_reason, "total_duration": total,
                "load_duration": 0, "prompt_eval_count": st.prompt_tokens,
                "prompt_eval_duration": max(0, total - eval_ns), "eval_count": st.tokens,
                "eval_duration": eval_ns}

    async def _answer(self, request: Request, req: _Common, run: Started, field: str
                      ) -> Response:
        t0 = time.perf_counter()
        if req.stream:
            return streamed(run, self._lines(req, run, field, t0), "application/x-ndjson")
        gen = await self.runs.collect(request, run)
        out = self._final(req, gen, t0)
        if field == "response":
            out["response"] = gen.text
            return JSONResponse(out)
        message, _ = answer_message(gen.text, run.names)
        msg: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
        if message.get("tool_calls"):
            msg["tool_calls"] = _ollama_calls(message["tool_calls"])
        return JSONResponse({**out, "message": msg})

    async def _lines(self, req: _Common, run: Started, field: str, t0: float
                     ) -> AsyncIterator[bytes]:
        deltas = Deltas(run.names)

        def line(delta: dict[str, Any], done: bool = False) -> bytes:
            if field == "response":
                part: dict[str, Any] = {"response": delta.get("content", "")}
            else:
                msg: dict[str, Any] = {"role": "assistant", "content": delta.get("content", "")}
                if "tool_calls" in delta:
                    msg["tool_calls"] = _ollama_calls(delta["tool_calls"])
                part = {"message": msg}
            return (json.dumps({"model": req.model, "created_at": _now(), **part,
                                "done": done}) + "\n").encode()

        async for item in self.runs.items(run):
            if isinstance(item, Exception):
                yield (json.dumps({"error": _failure_message(item)}) + "\n").encode()
            elif isinstance(item, _Piece):
                for d in deltas.feed(item.text):
                    yield line(d)
            elif item.finish_reason == "cancelled":
                yield (json.dumps({"error": cut_off(item)}) + "\n").encode()
                return
            else:
                for d in deltas.finish():
                    yield line(d)
                final = self._final(req, item, t0)
                final[field] = {"role": "assistant", "content": ""} if field == "message" else ""
                yield (json.dumps(final) + "\n").encode()
