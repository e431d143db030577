"""A chat request's messages and tools (pydantic models, checked by ``requests``), what the
model's chat template renders of them (``chat_input``), and the answer as OpenAI's message or
stream deltas, tool calls parsed out of it (``answer_message``, ``Deltas``), all through
``edgespec.head.tools``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from edgespec.head.tools import (
    ToolCall,
    ToolCallParser,
    parse_tool_calls,
    template_messages,
    template_tools,
)

_Str = Annotated[str, Field(strict=True)]


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: _Str


_Name = Annotated[str, Field(strict=True, pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class _Function(BaseModel):
    """A tool's function: its name, what it does and its parameters' JSON schema."""

    model_config = ConfigDict(extra="forbid")
    name: _Name
    description: _Str | None = None
    parameters: dict[_Str, Any] | None = None
    # The call always follows the parameters' schema where a grammar forces it.
    strict: Annotated[bool, Field(strict=True)] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _Function


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: _Name


class NamedChoice(BaseModel):
    """``tool_choice`` naming the one function to call."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _FunctionName


class _CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: _Str
    arguments: _Str  # JSON text, as OpenAI writes it


class _ToolCall(BaseModel):
    """A call of an earlier assistant turn."""

    model_config = ConfigDict(extra="forbid")
    id: _Str
    type: Literal["function"]
    function: _CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    # Null only in an assistant turn that called tools (checked in ``_check_messages``).
    content: _Str | list[_TextPart] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: _Str | None = None  # a tool result: the call it answers
    # Unimplemented (``_MESSAGE_NEUTRAL``): Any, so any value reaches the refusal naming it.
    name: Any = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatParts(Protocol):
    """What these functions read of a chat request (``requests``' model has it)."""

    messages: Sequence[Message]
    tools: Sequence[Tool] | None
    tool_choice: Any


def chat_input(req: ChatParts
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """What the chat template renders: the messages (``head.tools.template_messages``) and
    the tools, None without tools or with ``tool_choice: "none"``: the template then writes
    no ``# Tools`` block, so the model is offered nothing to call, and its answer is not
    parsed (the template renders earlier calls and results with or without tools)."""
    msgs = template_messages(
        {"role": m.role, "content": m.text(), "tool_call_id": m.tool_call_id,
         "tool_calls": [c.model_dump() for c in m.tool_calls or ()]} for m in req.messages)
    return msgs, (template_tools(tool_dicts(req)) if tool_names(req) is not None else None)


def tool_names(req: ChatParts) -> list[str] | None:
    """The functions the answer may call (its text is then parsed for calls), or None."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.function.name for t in req.tools]


def tool_dicts(req: ChatParts) -> list[dict[str, Any]]:
    return [t.model_dump(exclude_none=True) for t in req.tools or ()]


# ----------------------------------------------------------------------------- answers

def answer_message(text: str, names: list[str] | None) -> tuple[dict[str, Any], bool]:
    """A whole answer as OpenAI's assistant message, and whether it called tools: with
    ``names`` (``tool_names``) the text is parsed for calls (``content`` then null when
    there is nothing else)."""
    if names is None:
        return {"role": "assistant", "content": text}, False
    content, calls = parse_tool_calls(text, names)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.as_dict() for c in calls]
    return message, bool(calls)


def finish_reason(finish: str, called: bool) -> str:
    """OpenAI's ``finish_reason``: "tool_calls" for an answer that ended with calls."""
    return "tool_calls" if called and finish == "stop" else finish


class Deltas:
    """A streamed answer's ``delta`` objects: its text as content, or with ``names`` the
    content and ``tool_calls`` items (``index``, ``id``, ``type``, ``function``) that
    ``head.tools.ToolCallParser`` finds, each call whole in one delta."""

    def __init__(self, names: list[str] | None) -> None:
        self.parser = None if names is None else ToolCallParser(names)
        self.called = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.parser is None:
            return [{"content": text}] if text else []
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return [] if self.parser is None else self._deltas(self.parser.finish())

    def _deltas(self, events: list[str | ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, str):
                out.append({"content": e})
            else:
                out.append({"tool_calls": [e.as_dict(self.called)]})
                self.called += 1
        return out
