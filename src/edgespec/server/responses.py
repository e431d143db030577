"""OpenAI's Responses API on the server's port: ``POST /v1/responses``, one body or its
streamed events (``response.created``, ``response.in_progress``, ``response.output_item.*``,
``response.content_part.*``, ``response.output_text.delta/done``,
``response.function_call_arguments.delta/done``, then ``response.completed`` or
``response.incomplete``).

A request becomes the OpenAI chat request (``doors.openai_chat``) the chat door runs:
``input`` (a string, or message, ``function_call`` and ``function_call_output`` items),
``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``, function ``tools``,
``tool_choice``, ``parallel_tool_calls`` and ``text.format`` (text, json_object,
json_schema). Nothing is stored: ``store: true``, ``previous_response_id``, ``background``,
``conversation``, reasoning and built-in tools are a 400 naming the field, as is a field
outside the API. Errors are OpenAI's shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from edgespec.api import Generation
from edgespec.server.chat_input import Deltas, answer_message
from edgespec.server.doors import (
    answered_in,
    check,
    json_schema_format,
    openai_chat,
    read_json,
    unsupported,
)
from edgespec.server.replies import _error, _failure, _failure_message
from edgespec.server.requests import _BadRequest, _is, _refuse_unsupported, knob_type
from edgespec.server.runs import Runs, Started, _Piece, cut_off, streamed

_Str = Annotated[str, Field(strict=True)]


def _shape(status: int, message: str, kind: str, code: str | None,
           headers: dict[str, str] | None) -> JSONResponse:
    return _error(status, message, kind, code=code, headers=headers)


#: Fields this server does not implement: (is the value neutral, the neutral values).
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (_is(False), "false"), "previous_response_id": (_is(), "null"),
    "reasoning": (_is(), "null"), "include": (_is([]), "[]"),
    "background": (_is(False), "false"), "conversation": (_is(), "null"),
    "prompt": (_is(), "null"), "top_logprobs": (_is(0), "0"),
    "max_tool_calls": (_is(), "null"), "stream_options": (_is(), "null"),
    "service_tier": (_is("auto", "default"), '"auto" or "default"'),
}


class _Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: Annotated[str, Field(strict=True, pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: _Str | None = None
    parameters: dict[_Str, Any] | None = None
    strict: Annotated[bool, Field(strict=True)] | None = None


class _Named(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: _Str


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: _Str | None = None
    schema_: dict[_Str, Any] | None = Field(default=None, alias="schema")
    description: _Str | None = None
    strict: Annotated[bool, Field(strict=True)] | None = None


class _Text(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: _Format | None = None
    verbosity: Literal["medium"] | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: _Str | None = None
    input: _Str | list[dict[_Str, Any]]
    instructions: _Str | None = None
    max_output_tokens: Annotated[int, Field(strict=True, ge=1)] | None = None
    temperature: knob_type("temperature") = None
    top_p: knob_type("top_p") = None
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _Named | None = None
    parallel_tool_calls: Annotated[bool, Field(strict=True)] | None = None
    text: _Text | None = None
    stream: Annotated[bool, Field(strict=True)] = False
    truncation: Literal["disabled"] | None = None
    # Informational, as in chat completions: nothing of the answer depends on them.
    metadata: dict[_Str, _Str] | None = None
    user: _Str | None = None
    safety_identifier: _Str | None = None
    prompt_cache_key: _Str | None = None
    # Unimplemented (``_NEUTRAL``).
    store: Any = None
    previous_response_id: Any = None
    reasoning: Any = None
    include: Any = None
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    stream_options: Any = None
    service_tier: Any = None


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text"]
    text: _Str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: _Str | list[_Part]
    id: _Str | None = None
    status: _Str | None = None


class _CallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: _Str
    name: _Str
    arguments: _Str
    id: _Str | None = None
    status: _Str | None = None


class _OutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: _Str
    output: _Str
    id: _Str | None = None
    status: _Str | None = None


_ITEMS: dict[str | None, type[BaseModel]] = {
    None: _MessageItem, "message": _MessageItem, "function_call": _CallItem,
    "function_call_output": _OutputItem}


def _messages(req: _Request) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as OpenAI chat messages: consecutive function calls
    are one assistant turn's calls, their outputs tool messages."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) \
        else req.input
    for i, raw in enumerate(items):
        if not isinstance(raw, dict):
            raise _BadRequest(f"'input[{i}]' must be an item object", "input")
        kind = raw.get("type")
        model = _ITEMS.get(kind) if kind is None or isinstance(kind, str) else None
        if model is None:
            raise unsupported(f"input[{i}].type {kind!r}", "send messages, function_call "
                              "and function_call_output items")
        item = check(model, raw, at=f"input[{i}]")
        if isinstance(item, _MessageItem):
            text = item.content if isinstance(item.content, str) else \
                "".join(p.text for p in item.content)
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": text})
        elif isinstance(item, _CallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and \
                    (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


def _response_format(text: _Text | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise _BadRequest("'text.format.schema' is required with type \"json_schema\"", "text")
    return json_schema_format(fmt.schema_, fmt.name or "answer")


def _openai_body(req: _Request) -> dict[str, Any]:
    _refuse_unsupported(req, _NEUTRAL)
    choice = req.tool_choice
    return {"model": req.model, "messages": _messages(req),
            "max_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text),
            "tools": None if req.tools is None else [
                {"type": "function", "function": t.model_dump(exclude={"type"},
                                                              exclude_none=True)}
                for t in req.tools],
            "tool_choice": {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, _Named) else choice}


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponsesDoor:
    """``POST /v1/responses`` over ``runs`` (the one path every door takes)."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs

    def routes(self, app: FastAPI) -> None:
        app.post("/v1/responses")(answered_in(_shape)(self.responses))

    async def responses(self, request: Request) -> Response:
        req = check(_Request, await read_json(self.runs, request))
        body = _openai_body(req)
        run = await self.runs.start(lambda: openai_chat(body, {
            "max_tokens": "max_output_tokens", "response_format": "text"}), "resp_")
        if req.stream:
            return streamed(run, self._events(req, run), "text/event-stream")
        gen = await self.runs.collect(request, run)
        message, _ = answer_message(gen.text, run.names)
        output = []
        if message["content"]:
            output.append(self._message(_id("msg_"), message["content"], "completed"))
        output += [self._call(_id("fc_"), c, "completed") for c in message.get("tool_calls", ())]
        return JSONResponse(self._response(req, run, "completed", output, gen))

    @staticmethod
    def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [] if text is None else
                [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def _call(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": item_id, "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"], "status": status}

    def _response(self, req: _Request, run: Started, status: str, output: list[Any],
                  gen: Generation | None) -> dict[str, Any]:
        length = gen is not None and gen.finish_reason == "length"
        out = {"id": run.rid, "object": "response", "created_at": run.created,
               "status": "incomplete" if length else status,
               "incomplete_details": {"reason": "max_output_tokens"} if length else None,
               "error": None, "model": req.model or self.runs.model_name, "output": output,
               "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
               "temperature": req.temperature, "top_p": req.top_p,
               "parallel_tool_calls": req.parallel_tool_calls is not False,
               "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, _Named)
                               else req.tool_choice or "auto"),
               "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
               "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                   if req.text and req.text.format else {"type": "text"})},
               "metadata": req.metadata or {}, "store": False, "truncation": "disabled",
               "previous_response_id": None, "reasoning": None, "usage": None}
        if gen is not None:
            st = gen.stats
            out["usage"] = {"input_tokens": st.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": 0},
                            "output_tokens": st.tokens,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": st.prompt_tokens + st.tokens}
        return out

    async def _events(self, req: _Request, run: Started) -> AsyncIterator[bytes]:
        seq = 0

        def event(name: str, data: dict[str, Any]) -> bytes:
            nonlocal seq
            seq += 1
            payload = {"type": name, "sequence_number": seq - 1, **data}
            return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()

        output: list[dict[str, Any]] = []
        text: list[str] | None = None  # the open message item's text so far
        msg_id = ""
        yield event("response.created", {"response": self._response(req, run, "in_progress",
                                                                    [], None)})
        yield event("response.in_progress", {"response": self._response(
            req, run, "in_progress", [], None)})

        def close_text() -> list[bytes]:
            nonlocal text
            if text is None:
                return []
            whole, text = "".join(text), None
            at = {"item_id": msg_id, "output_index": len(output), "content_index": 0}
            part = {"type": "output_text", "text": whole, "annotations": []}
            output.append(self._message(msg_id, whole, "completed"))
            return [event("response.output_text.done", {**at, "text": whole, "logprobs": []}),
                    event("response.content_part.done", {**at, "part": part}),
                    event("response.output_item.done", {"output_index": at["output_index"],
                                                        "item": output[-1]})]

        deltas = Deltas(run.names)
        async for item in self.runs.items(run):
            if isinstance(item, Exception):
                _, kind, code, param = _failure(item)
                yield event("error", {"code": code or kind, "message": _failure_message(item),
                                      "param": param})
                return
            if not isinstance(item, _Piece) and item.finish_reason == "cancelled":
                yield event("error", {"code": "shutting_down", "message": cut_off(item),
                                      "param": None})
                return
            for d in deltas.feed(item.text) if isinstance(item, _Piece) else deltas.finish():
                if "content" in d:
                    if text is None:
                        text, msg_id = [], _id("msg_")
                        at = {"item_id": msg_id, "output_index": len(output),
                              "content_index": 0}
                        yield event("response.output_item.added", {
                            "output_index": len(output),
                            "item": self._message(msg_id, None, "in_progress")})
                        yield event("response.content_part.added", {**at, "part": {
                            "type": "output_text", "text": "", "annotations": []}})
                    text.append(d["content"])
                    yield event("response.output_text.delta", {
                        "item_id": msg_id, "output_index": len(output), "content_index": 0,
                        "delta": d["content"], "logprobs": []})
                    continue
                for e in close_text():
                    yield e
                call = d["tool_calls"][0]
                fc = self._call(_id("fc_"), call, "in_progress")
                at = {"item_id": fc["id"], "output_index": len(output)}
                yield event("response.output_item.added", {
                    "output_index": len(output), "item": {**fc, "arguments": ""}})
                yield event("response.function_call_arguments.delta",
                            {**at, "delta": fc["arguments"]})
                yield event("response.function_call_arguments.done",
                            {**at, "name": fc["name"], "arguments": fc["arguments"]})
                output.append({**fc, "status": "completed"})
                yield event("response.output_item.done",
                            {"output_index": at["output_index"], "item": output[-1]})
            if isinstance(item, _Piece):
                continue
            for e in close_text():
                yield e
            final = self._response(req, run, "completed", output, item)
            name = "response.completed" if final["status"] == "completed" \
                else "response.incomplete"
            yield event(name, {"response": final})

