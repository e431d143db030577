"""Tool calls in the Hermes / Qwen2.5 format, the one the model's own chat template writes:
the template lists the functions in a ``# Tools`` system block inside ``<tools></tools>``, and
asks for a call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(several calls one after another, separated by a newline). Small models often leave the tags
out and answer the call's JSON alone, or in a Markdown code block (Qwen2.5-Coder-0.5B's first
choices are ``{"`` and ```` ``` ````, not the ``<tool_call>`` token), so an answer that is
nothing but such JSON objects is calls too, as llama.cpp's Hermes parser reads it.

- ``template_messages`` / ``template_tools``: OpenAI's messages and tools as the template
  reads them (a call's ``arguments`` as an object, not OpenAI's JSON text; content never null).
- ``parse_tool_calls`` and ``ToolCallParser``: the model's text to (content, calls), at once
  or piece by piece for streaming; a block that is not a well-formed call of a known function
  stays in the content, tags included.
- ``tool_grammar``: the llguidance grammar that forces calls (``tool_choice`` "required" or a
  named function), allows at most one (``parallel_tool_calls: false``), or lets the answer be
  either calls or a JSON value of the ``response_format`` schema.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgespec.errors import RequestError
from edgespec.grammar import Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
#: A Markdown code block around an answer: what it holds.
_FENCED = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)

_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style call id (``call_`` and 24 letters and digits)."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` and reads calls in this module's format."""
    return bool(template) and "tools" in template and OPEN in template


# ------------------------------------------------------------------------- template input

def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as the template writes them (``tojson``): OpenAI sends JSON text,
    which is decoded; text that is not JSON is kept as it is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages (text content already joined) as the chat template reads them:
    content never null (an assistant turn that only called tools has ""), an assistant's
    ``tool_calls`` with their arguments as objects, a tool result's ``tool_call_id`` kept."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        calls = m.get("tool_calls")
        if calls:
            msg["tool_calls"] = [
                {"id": c.get("id"), "type": "function",
                 "function": {"name": c["function"]["name"],
                              "arguments": _arguments_object(c["function"].get("arguments"))}}
                for c in calls]
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def template_tools(tools: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tools as the template lists them (``{"type": "function", "function": {name,
    description, parameters}}``), fields left out rather than written as null."""
    out = []
    for t in tools:
        fn = t["function"]
        out.append({"type": "function", "function": {
            k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}})
    return out


# ------------------------------------------------------------------------------ parsing

@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's id, the function's name and its arguments as JSON
    text (OpenAI's ``function.arguments``)."""

    id: str
    name: str
    arguments: str

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape: a message's ``tool_calls`` item, or with ``index`` a streamed
        ``delta.tool_calls`` item."""
        out: dict[str, Any] = {} if index is None else {"index": index}
        out.update({"id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}})
        return out


def _call_of(block: str, names: set[str] | None, new_id: Callable[[], str]) -> ToolCall | None:
    """The call a block between the tags holds, or None when it is not one."""
    try:
        data = json.loads(block)
    except ValueError:
        return None
    return _call_of_json(data, names, new_id)


def _bare_calls(text: str, names: set[str] | None, new_id: Callable[[], str]
                ) -> list[ToolCall] | None:
    """The calls of an answer that is nothing but calls' JSON objects (whitespace between
    them, in a code block or not), or None."""
    fenced = _FENCED.fullmatch(text)
    if fenced:
        text = fenced.group(1)
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    at = 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):  # ids only once every object is known to be a call
            return [ToolCall(new_id(), c.name, c.arguments) for c in calls] or None
        try:
            data, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call_of_json(data, names, str)
        if call is None:
            return None
        calls.append(call)


def _call_of_json(data: Any, names: set[str] | None, new_id: Callable[[], str]
                  ) -> ToolCall | None:
    """The call a decoded JSON value is, or None when it is not one (no name, other keys
    than name and arguments, arguments that are not an object, a function not offered)."""
    if not isinstance(data, dict) or set(data) - {"name", "arguments"}:
        return None
    name, args = data.get("name"), data.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    if names is not None and name not in names:
        return None
    return ToolCall(new_id(), name, json.dumps(args, ensure_ascii=False))


def _may_be_bare(text: str) -> bool | None:
    """For an answer's start (leading whitespace stripped): True when it opens a call's bare
    JSON (``{"name"``, in a code block or not), None while it still may, False when it
    cannot."""
    if text.startswith(FENCE):
        rest = text[len(FENCE):]
        if "json".startswith(rest):
            return None
        text = rest[len("json"):] if rest.startswith("json") else rest
        text = text.lstrip()
        if not text:
            return None
    elif FENCE.startswith(text):
        return None
    if not text.startswith("{"):
        return False
    rest = text[1:].lstrip()
    if rest.startswith('"name"'):
        return True
    return None if '"name"'.startswith(rest) else False


def _held_from(text: str) -> int:
    """Where the text that may still turn into a call starts: the longest end of ``text``
    that is whitespace followed by a beginning of ``<tool_call>`` (whitespace before a call
    is not content)."""
    start = len(text)
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            start = len(text) - k
            break
    while start > 0 and text[start - 1].isspace():
        start -= 1
    return start


class ToolCallParser:
    """The model's text, fed piece by piece, as content pieces (``str``) and calls
    (``ToolCall``) in order. Text that may be the start of a ``<tool_call>`` tag, or
    whitespace that may precede one, is held back until it is known not to be; whitespace
    around calls is dropped. A block that is not a well-formed call (``names``: the functions
    offered) is given back as content, tags included, and so is an unclosed one at the end.
    An answer that opens with ``{"name"`` (in a code block or not) is held to its end: calls
    if it is nothing but calls' JSON, else content. Whatever the pieces, the outcome is the same as for the whole
    text at once."""

    def __init__(self, names: Iterable[str] | None = None,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.names = None if names is None else set(names)
        self.new_id = new_id
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet given out (outside a block) or the block so far
        self._in_call = False
        self._ws = ""  # whitespace before the open block's tag
        self._after_call = False  # whitespace right after a call is dropped
        # At the answer's start: None until it is known whether it is bare JSON calls.
        self._bare: bool | None = None

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        if self._bare is None and self._buf.strip():
            self._bare = _may_be_bare(self._buf.lstrip())
        if self._bare is not False:
            return out  # held: the answer may be (or is opening as) a call's bare JSON
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                block, self._buf = self._buf[:end], self._buf[end + len(CLOSE):]
                self._in_call = False
                call = _call_of(block, self.names, self.new_id)
                if call is None:
                    self._content(out, self._ws + OPEN + block + CLOSE)
                else:
                    self.calls.append(call)
                    out.append(call)
                    self._after_call = True
                self._ws = ""
                continue
            if self._after_call:
                rest = self._buf.lstrip()
                self._buf = rest
                if not rest:
                    return out
                self._after_call = False
            start = self._buf.find(OPEN)
            if start < 0:
                held = _held_from(self._buf)
                self._content(out, self._buf[:held])
                self._buf = self._buf[held:]
                return out
            before = self._buf[:start]
            text_end = len(before.rstrip())
            self._content(out, before[:text_end])
            self._ws = before[text_end:]
            self._buf = self._buf[start + len(OPEN):]
            self._in_call = True

    def finish(self) -> list[str | ToolCall]:
        """The end of the text: what was held back, as content."""
        out: list[str | ToolCall] = []
        if self._bare is not False:  # the whole answer was held: bare calls, or text
            bare = _bare_calls(self._buf, self.names, self.new_id)
            if bare is not None:
                self.calls += bare
                self._buf = ""
                return list(bare)
            self._bare = False
            out = self.feed("")
        if self._in_call:
            self._content(out, self._ws + OPEN + self._buf)
        elif not self._after_call:
            self._content(out, self._buf)
        self._buf, self._ws, self._in_call = "", "", False
        return out

    def _content(self, out: list[str | ToolCall], text: str) -> None:
        if not text:
            return
        self._after_call = False
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)


def parse_tool_calls(text: str, names: Iterable[str] | None = None,
                     new_id: Callable[[], str] = new_call_id
                     ) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole answer: the text itself when it holds no call; with
    calls, the text around them (None when there is none)."""
    parser = ToolCallParser(names, new_id)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    if not parser.calls:
        return text, []
    return content or None, parser.calls


# ------------------------------------------------------------------------------ grammars

def _call_schema(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON of one call: ``{"name": <a tool's name>, "arguments": <its parameters>}``,
    name first, as the template writes calls."""
    options = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters")
        if params is None:  # a function without parameters takes an empty object
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        options.append({"type": "object",
                        "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_grammar(tools: Sequence[Mapping[str, Any]], tool_choice: Any = "auto", *,
                 parallel: bool = True, answer: Mapping[str, Any] | None = None
                 ) -> Grammar | None:
    """What the answer must match given OpenAI's ``tools`` and ``tool_choice``, or None when
    the model is free (``"none"``; ``"auto"`` with parallel calls and no ``answer``).

    ``"required"``: one call or more (one: ``parallel=False``) of any of the tools;
    ``{"type": "function", "function": {"name": N}}``: calls of N only; ``"auto"`` with
    ``parallel=False``: text, or text and then one call, or one call; ``"auto"`` with
    ``answer`` (the ``response_format`` schema): either calls or a JSON value of that schema.
    A call's JSON is ``{"name": ..., "arguments": <that function's parameters schema>}``, in
    the tags (the vocabulary's special token or the same text in ordinary tokens) or bare.
    RequestError naming ``tools`` (or ``tool_choice``, ``response_format``) when they cannot
    make a grammar."""
    if not tools or tool_choice == "none":
        return None
    offered = list(tools)
    if isinstance(tool_choice, Mapping):
        name = tool_choice.get("function", {}).get("name")
        offered = [t for t in tools if t["function"]["name"] == name]
        if not offered:
            raise RequestError(f"'tool_choice' names function {name!r}, which is not in "
                               "'tools'", "tool_choice")
    elif tool_choice not in ("auto", "required"):
        raise RequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                           '{"type": "function", "function": {"name": ...}}', "tool_choice")
    forced = tool_choice != "auto"
    if forced and answer is not None:
        raise RequestError("'response_format' cannot be combined with a tool_choice that "
                           "forces a call: the answer is then the call", "response_format")
    if not forced and parallel and answer is None:
        return None
    call_json = json.dumps(_call_schema(offered), ensure_ascii=False)
    # A call is tagged (``open`` and ``close`` take the special token or its text in
    # ordinary tokens) or bare JSON, as the parser reads it; several are all of one kind.
    rules = ['open: <tool_call> | "<tool_call>"',
             'close: </tool_call> | "</tool_call>"',
             f"body: %json {call_json}",
             'tagged: open "\\n" body "\\n" close',
             ('calls: tagged ("\\n" tagged)* | body ("\\n" body)*' if parallel
              else "calls: tagged | body")]
    if forced:
        start = "start: calls"
    elif answer is not None:
        start = "start: answer | calls"
        rules.append(f"answer: %json {json.dumps(dict(answer), ensure_ascii=False)}")
    else:  # auto, one call at most: text (not opening with "{", so that a bare call's JSON
        # is a call), text and then a tagged call, or a bare call
        start = "start: TEXT | TEXT? tagged | body"
        rules.append(r"TEXT: /[^{](.|\n)*/")
    return Grammar.lark("\n".join([start, *rules]), param="tools")
