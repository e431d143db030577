"""Anthropic's Messages API on the server's port: ``POST /v1/messages`` (the door agent tools
that speak Anthropic knock on), one body or the streamed events (``message_start``,
``content_block_start`` / ``content_block_delta`` / ``content_block_stop``, ``message_delta``,
``message_stop``). ``x-api-key`` carries the API key as well as a bearer token does
(``access``).

A request becomes the OpenAI chat request (``doors.openai_chat``) the OpenAI door runs:
``system``, the messages' text, ``tool_use`` and ``tool_result`` blocks, ``tools``
(``input_schema``), ``tool_choice`` (auto, any, tool, none; ``disable_parallel_tool_use``),
``stop_sequences``, ``max_tokens``, ``output_config.format`` (a JSON schema the answer
follows), ``temperature``, ``top_p`` and ``top_k``. Other blocks
(images, documents, thinking), ``thinking`` enabled and a field outside the API are a 400
naming it. Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from edgespec.server.chat_input import Deltas, answer_message
from edgespec.server.doors import (
    answered_in,
    call_arguments,
    check,
    json_schema_format,
    openai_chat,
    read_json,
    stop_sequence,
    unsupported,
)
from edgespec.server.replies import _failure, _failure_message
from edgespec.server.requests import _BadRequest, knob_type
from edgespec.server.runs import Runs, Started, _Piece, cut_off, streamed

_Str = Annotated[str, Field(strict=True)]

#: Anthropic's error type for each status.
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _KINDS.get(status, "api_error"),
                                       "message": message}}


def _error(status: int, message: str, _kind: str = "", _code: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


class _Text(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: _Str
    # A prompt-caching hint: the slot keeps the conversation's KV without one.
    cache_control: dict[_Str, Any] | None = None


class _ToolUse(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_use"]
    id: _Str
    name: _Str
    input: dict[_Str, Any]
    cache_control: dict[_Str, Any] | None = None


class _ToolResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["tool_result"]
    tool_use_id: _Str
    content: _Str | list[_Text] = ""
    is_error: Annotated[bool, Field(strict=True)] | None = None
    cache_control: dict[_Str, Any] | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else \
            "".join(t.text for t in self.content)
        return f"error: {body}" if self.is_error else body


_BLOCKS: dict[str, type[BaseModel]] = {"text": _Text, "tool_use": _ToolUse,
                                       "tool_result": _ToolResult}


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: _Str | list[dict[_Str, Any]]


class _Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(strict=True, pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: _Str | None = None
    input_schema: dict[_Str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[_Str, Any] | None = None


class _Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: _Str | None = None
    disable_parallel_tool_use: Annotated[bool, Field(strict=True)] | None = None


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[_Str, Any] = Field(alias="schema")


class _Output(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: _Format | None = None
    effort: Any = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: _Str
    max_tokens: Annotated[int, Field(strict=True, ge=1)]
    messages: Annotated[list[_Message], Field(min_length=1)]
    system: _Str | list[_Text] | None = None
    stop_sequences: list[_Str] | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=1.0)] | None = None
    top_p: knob_type("top_p") = None
    top_k: knob_type("top_k") = None
    stream: Annotated[bool, Field(strict=True)] = False
    tools: list[_Tool] | None = None
    tool_choice: _Choice | None = None
    # Informational: an end-user id for abuse monitoring.
    metadata: dict[_Str, Any] | None = None
    thinking: dict[_Str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Structured output: the answer follows ``format.schema``.
    output_config: _Output | None = None
    cache_control: dict[_Str, Any] | None = None


_HELP = {"temperature": "'temperature' must be a number between 0 and 1",
         "max_tokens": "'max_tokens' must be an integer >= 1",
         "tool_choice": "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | "
                        "\"none\"} (with \"name\" for \"tool\")",
         "service_tier": "'service_tier' must be \"auto\" or \"standard_only\""}


def _blocks(i: int, content: str | list[dict[str, Any]]) -> list[BaseModel]:
    if isinstance(content, str):
        return [_Text(type="text", text=content)]
    out = []
    for j, block in enumerate(content):
        kind = block.get("type")
        model = _BLOCKS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise unsupported(f"messages[{i}].content[{j}].type {kind!r}",
                              "send text, tool_use or tool_result blocks")
        out.append(check(model, block, at=f"messages[{i}].content[{j}]"))
    return out


def _messages(req: _Request) -> list[dict[str, Any]]:
    """Anthropic's system and messages as OpenAI's: tool results become tool messages,
    tool_use blocks an assistant's calls."""
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else \
            "".join(t.text for t in req.system)
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        blocks = _blocks(i, m.content)
        text = "".join(b.text for b in blocks if isinstance(b, _Text))
        uses = [b for b in blocks if isinstance(b, _ToolUse)]
        results = [b for b in blocks if isinstance(b, _ToolResult)]
        if m.role == "user" and uses:
            raise unsupported(f"messages[{i}].content: tool_use", "calls are the assistant's")
        if m.role == "assistant" and results:
            raise unsupported(f"messages[{i}].content: tool_result", "results are the user's")
        out += [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text()}
                for r in results]
        if uses:
            out.append({"role": "assistant", "content": text or None, "tool_calls": [
                {"id": u.id, "type": "function",
                 "function": {"name": u.name, "arguments": json.dumps(u.input)}}
                for u in uses]})
        elif text or not results:
            out.append({"role": m.role, "content": text})
    return out


def _openai_body(req: _Request) -> dict[str, Any]:
    if req.thinking and req.thinking.get("type") != "disabled":
        raise unsupported("thinking", "send {\"type\": \"disabled\"} or leave it out")
    out = req.output_config
    if out is not None and out.effort is not None:
        raise unsupported("output_config.effort", "leave it out")
    body: dict[str, Any] = {
        "model": req.model, "max_tokens": req.max_tokens, "messages": _messages(req),
        "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "response_format": json_schema_format(out.format.schema_)
        if out is not None and out.format is not None else None}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description else {})}}
            for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise _BadRequest("'tool_choice.name' is required with type \"tool\"",
                              "tool_choice")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type) or {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return body


class AnthropicDoor:
    """``POST /v1/messages`` over ``runs`` (the one path every door takes)."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs

    def routes(self, app: FastAPI) -> None:
        app.post("/v1/messages")(answered_in(_error)(self.messages))

    async def messages(self, request: Request) -> Response:
        req = check(_Request, await read_json(self.runs, request), _HELP)
        body = _openai_body(req)
        run = await self.runs.start(lambda: openai_chat(body, {
            "stop": "stop_sequences", "response_format": "output_config"}), "msg_")
        if req.stream:
            return streamed(run, self._events(req, run), "text/event-stream")
        gen = await self.runs.collect(request, run)
        message, called = answer_message(gen.text, run.names)
        content: list[dict[str, Any]] = []
        if message["content"]:
            content.append({"type": "text", "text": message["content"]})
        content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                     "input": call_arguments(c["function"]["arguments"])}
                    for c in message.get("tool_calls", ())]
        stop, reason = self._stop(req, gen, called)
        return JSONResponse({
            "id": run.rid, "type": "message", "role": "assistant", "model": req.model,
            "content": content, "stop_reason": reason, "stop_sequence": stop,
            "usage": {"input_tokens": gen.stats.prompt_tokens,
                      "output_tokens": gen.stats.tokens}})

    def _stop(self, req: _Request, gen: Any, called: bool) -> tuple[str | None, str]:
        """(the stop sequence that ended the answer, Anthropic's ``stop_reason``)."""
        if called:
            return None, "tool_use"
        if gen.finish_reason == "length":
            return None, "max_tokens"
        stop = stop_sequence(self.runs.ring, gen, req.stop_sequences)
        return stop, "stop_sequence" if stop else "end_turn"

    async def _events(self, req: _Request, run: Started) -> AsyncIterator[bytes]:
        def event(name: str, data: dict[str, Any]) -> bytes:
            return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n".encode()

        deltas = Deltas(run.names)
        index, text_open = -1, False
        yield event("message_start", {"message": {
            "id": run.rid, "type": "message", "role": "assistant", "model": req.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0}}})
        async for item in self.runs.items(run):
            if isinstance(item, Exception):
                status = _failure(item)[0]
                yield event("error", error_body(status, _failure_message(item)))
                return
            if not isinstance(item, _Piece) and item.finish_reason == "cancelled":
                yield event("error", error_body(503, cut_off(item)))
                return
            for d in deltas.feed(item.text) if isinstance(item, _Piece) else deltas.finish():
                if "content" in d:
                    if not text_open:
                        index, text_open = index + 1, True
                        yield event("content_block_start", {
                            "index": index, "content_block": {"type": "text", "text": ""}})
                    yield event("content_block_delta", {
                        "index": index, "delta": {"type": "text_delta", "text": d["content"]}})
                    continue
                if text_open:
                    yield event("content_block_stop", {"index": index})
                    text_open = False
                call = d["tool_calls"][0]
                index += 1
                yield event("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                    "input": {}}})
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
                yield event("content_block_stop", {"index": index})
            if isinstance(item, _Piece):
                continue
            if text_open:
                yield event("content_block_stop", {"index": index})
            stop, reason = self._stop(req, item, deltas.called > 0)
            yield event("message_delta", {"delta": {"stop_reason": reason,
                                                    "stop_sequence": stop},
                                          "usage": {"output_tokens": item.stats.tokens}})
            yield event("message_stop", {})
