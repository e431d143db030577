"""Request bodies of the completion endpoints: every field is checked before the ring sees it
(pydantic models), a caller's mistake is a ``_BadRequest`` naming the field, and so is a field
this server does not implement (unless it holds the value that asks for nothing).

``generation_params`` turns a request into ``GenerationParams``, its grammar included: the
``response_format``'s, or the tool grammar of ``edgespec.head.tools`` (a forced call, one
call at most, calls or an answer of the ``response_format`` schema). A chat's messages and
tools are ``chat_input``'s models."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from edgespec import sampling as fields
from edgespec.errors import RequestError
from edgespec.grammar import Grammar
from edgespec.head.tools import tool_grammar
from edgespec.params import SPEC_MODES, GenerationParams
from edgespec.server.chat_input import (
    Message,
    NamedChoice,
    Tool,
    tool_dicts,
    tool_names,
)


class _BadRequest(Exception):
    """A request refused before it reaches the ring (400, 404, 413; 429 and 503 with their
    ``kind``), answered in the shape of the door it came in by."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status
        self.kind = kind
        self.headers = headers

# ------------------------------------------------------------------------- request models
# Strict types: a number sent as a string, or true for 1, is a client bug worth reporting
# rather than guessing at. A field is either honoured or refused: one this server does not
# implement is a 400 naming it (``_NEUTRAL``), and so is one outside OpenAI's API (extra
# "forbid"), since a setting accepted and then ignored lets the caller believe it took effect.
# The one leniency: an unimplemented field holding the value that asks for nothing
# (``frequency_penalty: 0``, ``n: 1``) is accepted, because clients such as the official
# ``openai`` package and IDE plugins send those defaults with every request.

_Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
_Int = Annotated[int, Field(strict=True)]
_Str = Annotated[str, Field(strict=True)]


def _is(*values: Any) -> Callable[[Any], bool]:
    """Neutral when null or one of ``values`` of the same JSON type (``true`` is not ``1``)."""
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


#: Unimplemented fields: (is the value neutral, the neutral values for the message).
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_is(1), "1"),
    # The legacy form of tools and tool_choice (``tools`` is supported).
    "functions": (_is([]), "[]"),
    "function_call": (_is("none", "auto"), '"none" or "auto"'),
    "modalities": (_is(["text"]), '["text"]'),
    "audio": (_is(), "null"),
    "prediction": (_is(), "null"),
    "reasoning_effort": (_is(), "null"),
    "verbosity": (_is(), "null"),
    "web_search_options": (_is(), "null"),
    "store": (_is(False), "false"),
    # A processing tier: the default ones ask for nothing; flex or priority promise a
    # latency or price this server does not offer.
    "service_tier": (_is("auto", "default"), '"auto" or "default"'),
    # Legacy completions only.
    "best_of": (_is(1), "1"),
    "echo": (_is(False), "false"),
    "suffix": (_is(""), '""'),
}

#: The same for a chat message's own fields (a participant's name the model would be shown,
#: the legacy function call, a refusal or audio of an earlier answer).
_MESSAGE_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "name": (_is(), "null"),
    "function_call": (_is(), "null"),
    "refusal": (_is(), "null"),
    "audio": (_is(), "null"),
}

#: And for ``stream_options``: the stream is never padded, so only false is honoured.
_STREAM_OPTIONS_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "include_obfuscation": (_is(False), "false"),
}


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: Annotated[bool, Field(strict=True)] = False
    include_obfuscation: Any = None


def knob_type(name: str) -> Any:
    """A ``FIELDS`` row as a strict, bounded, optional pydantic type (bounds from the table);
    the other doors take their fields of the same name by it."""
    k = fields.BY_NAME[name]
    bounds = {"gt" if k.low_open else "ge": k.kind(k.low), "le": k.kind(k.high)}
    return Annotated[_Float if k.kind is float else _Int, Field(**bounds)] | None


#: The sampler chain's fields (``edgespec.sampling.FIELDS``), each optional (null: the
#: default), with the table's bounds.
_SamplerFields = create_model("_SamplerFields", __config__=ConfigDict(extra="forbid"),
                              **{k.name: (knob_type(k.name), None) for k in fields.FIELDS})


class _Sampling(_SamplerFields):  # type: ignore[misc, valid-type]
    """The fields both endpoints share. ``None`` means "the default", as OpenAI treats null."""

    model_config = ConfigDict(extra="forbid")
    model: _Str | None = None
    max_tokens: Annotated[_Int, Field(ge=1, le=1 << 20)] | None = None
    # Newer clients send max_completion_tokens (chat); it means the same here.
    max_completion_tokens: Annotated[_Int, Field(ge=1, le=1 << 20)] | None = None
    stop: _Str | Annotated[list[_Str], Field(max_length=4)] | None = None
    stream: Annotated[bool, Field(strict=True)] | None = None
    stream_options: _StreamOptions | None = None
    # edgespec's own: the speculative mode for this request (the web page's control).
    spec: Literal[SPEC_MODES] | None = None  # type: ignore[valid-type]
    # As llama-server and vLLM take it: go on past end-of-generation to max_tokens (benchmarks).
    ignore_eos: Annotated[bool, Field(strict=True)] | None = None
    # An end-user id for the provider's abuse monitoring: it asks nothing of the generation,
    # so any server may take it and do nothing with it.
    user: _Str | None = None
    # What the text must match beyond OpenAI's ``response_format``: a regular expression
    # (vLLM's guided regex) or a GBNF grammar (llama-server's ``grammar``).
    regex: Annotated[str, Field(strict=True, min_length=1)] | None = None
    grammar: Annotated[str, Field(strict=True, min_length=1)] | None = None
    # Unimplemented (``_NEUTRAL``): Any, so any value reaches the refusal naming the field.
    n: Any = None
    # Token ids (decimal strings, as JSON keys are) to values in [-100, 100]; checked by
    # GenerationParams, which names the field.
    logit_bias: dict[_Str, Any] | None = None


class _ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    # Informational, like ``user``: the successor of ``user`` for abuse monitoring, tags for
    # OpenAI's dashboard, and a hint for which cache to route to (this server's cache is the
    # slot's own history, kept without a hint). None of them changes an answer.
    safety_identifier: _Str | None = None
    metadata: dict[_Str, _Str] | None = None
    prompt_cache_key: _Str | None = None
    # Each answer token's log probability, and with ``top_logprobs`` (0..20) the most likely
    # tokens' there (``GenerationParams.logprobs``).
    logprobs: Annotated[bool, Field(strict=True)] | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    # Functions the model may call (``edgespec.head.tools``), whether it must, and whether
    # it may make several calls in one answer.
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: Annotated[bool, Field(strict=True)] | None = None
    # text, json_object or json_schema (``Grammar.from_response_format`` checks it).
    response_format: Any = None
    # Unimplemented (``_NEUTRAL``).
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None


class _CompletionRequest(_Sampling):
    prompt: (Annotated[str, Field(strict=True, min_length=1)]
             | Annotated[list[Annotated[str, Field(strict=True, min_length=1)]],
                         Field(min_length=1, max_length=1)])
    # The log probabilities of each token and of the ``logprobs`` (0..20) most likely ones.
    logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    # Unimplemented (``_NEUTRAL``).
    best_of: Any = None
    echo: Any = None
    suffix: Any = None

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


#: One clear line per field, instead of pydantic's per-branch union messages.
_FIELD_HELP = {
    **{k.name: f"'{k.name}' must be {k.rule()}" for k in fields.FIELDS},
    "max_tokens": "'max_tokens' must be an integer >= 1",
    "top_logprobs": "'top_logprobs' must be an integer from 0 to 20",
    "max_completion_tokens": "'max_completion_tokens' must be an integer >= 1",
    "stop": "'stop' must be a string or a list of up to 4 strings",
    "messages": "'messages' must be a non-empty list of {role, content} with role system, "
                "user, assistant or tool and text content (an assistant's tool_calls as "
                "[{id, type: \"function\", function: {name, arguments}}])",
    "tools": "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", "
             "\"description\", \"parameters\"}} (names of letters, digits, _ and -, at most 64)",
    "tool_choice": "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
                   "\"function\", \"function\": {\"name\": ...}}",
    "parallel_tool_calls": "'parallel_tool_calls' must be true or false",
    "regex": "'regex' must be a non-empty string (a regular expression the answer matches)",
    "grammar": "'grammar' must be a non-empty string (a GBNF grammar the answer follows)",
    "prompt": "'prompt' must be a non-empty string (or a list of one)",
    "stream": "'stream' must be true or false",
    "stream_options": "'stream_options' must be an object like {\"include_usage\": true}",
    "model": "'model' must be a string",
    "spec": f"'spec' must be one of {', '.join(SPEC_MODES)}",
    "ignore_eos": "'ignore_eos' must be true or false",
    "user": "'user' must be a string",
    "safety_identifier": "'safety_identifier' must be a string",
    "metadata": "'metadata' must be an object of string values",
    "prompt_cache_key": "'prompt_cache_key' must be a string",
}


def _path(loc: tuple[int | str, ...]) -> str:
    """A field's place as the caller wrote it (``messages[0].name``), without pydantic's
    union-branch labels (``list[_TextPart]``, ``NamedChoice``: never names of fields)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and not part.startswith("_") and not part[:1].isupper():
            out += f".{part}" if out else part
    return out


def _refuse_unsupported(model: BaseModel, neutral: dict[str, tuple[Callable[[Any], bool], str]],
                        where: str = "", param: str | None = None) -> None:
    """``_BadRequest`` for the first unimplemented field of ``model`` that asks for something."""
    for name, (ok, accepted) in neutral.items():
        if name in type(model).model_fields and not ok(getattr(model, name)):
            fix = "leave it out" if accepted == "null" else f"send {accepted} or leave it out"
            raise _BadRequest(f"'{where}{name}' is not supported by this server: {fix}",
                              param or name, code="unsupported_parameter")


def parse_request(body: bytes | dict[str, Any], chat: bool) -> _ChatRequest | _CompletionRequest:
    """Validate a request body (raw JSON or already parsed); ``_BadRequest`` naming the first
    offending field otherwise: a malformed value, a field outside the API, or one this server
    does not implement sent with a value that asks for something."""
    model = _ChatRequest if chat else _CompletionRequest
    try:
        if isinstance(body, (bytes, bytearray)):
            req = model.model_validate_json(body)
        else:
            req = model.model_validate(body)
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        # An unknown field first: inside a union (a message's content) pydantic lists the
        # other branch's complaint before it, which would not name the field.
        first = next((e for e in errs if e["type"] == "extra_forbidden"), errs[0])
        if first["type"] == "json_invalid":
            raise _BadRequest("request body is not valid JSON") from None
        loc = first["loc"]
        if not loc:
            raise _BadRequest("request body must be a JSON object") from None
        param = str(loc[0])
        if first["type"] == "extra_forbidden":
            raise _BadRequest(f"unknown field '{_path(loc)}': not supported by this server",
                              param, code="unknown_parameter") from None
        if first["type"] == "missing":
            raise _BadRequest(f"'{param}' is required", param) from None
        raise _BadRequest(_FIELD_HELP.get(param, f"'{param}': {first['msg']}"), param) from None
    _refuse_unsupported(req, _NEUTRAL)
    if req.stream_options is not None:
        _refuse_unsupported(req.stream_options, _STREAM_OPTIONS_NEUTRAL, "stream_options.",
                            "stream_options")
    for i, m in enumerate(getattr(req, "messages", ())):
        _refuse_unsupported(m, _MESSAGE_NEUTRAL, f"messages[{i}].", "messages")
    if chat:
        _check_messages(req.messages)
        _check_tools(req)
        if req.top_logprobs and not req.logprobs:
            raise _BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return req


def _check_messages(messages: list[Message]) -> None:
    """What the types leave open: content is null only in an assistant turn with calls,
    calls are an assistant's, and a tool result names its call."""
    for i, m in enumerate(messages):
        where = f"'messages[{i}]"
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise _BadRequest(f"{where}.content' is required (null only in an assistant "
                              "message with tool_calls)", "messages")
        if m.tool_calls and m.role != "assistant":
            raise _BadRequest(f"{where}.tool_calls' belongs to assistant messages", "messages")
        if (m.role == "tool") != (m.tool_call_id is not None):
            raise _BadRequest(f"{where}.tool_call_id' is required in a tool message and "
                              "only there", "messages")


def _check_tools(req: _ChatRequest) -> None:
    tools = req.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise _BadRequest(f"'tools' names function {dup!r} twice", "tools")
    choice = req.tool_choice
    if choice != "required" and not isinstance(choice, NamedChoice):
        return
    if not tools:
        raise _BadRequest("'tool_choice' asks for a call but there are no 'tools'",
                          "tool_choice")
    if isinstance(choice, NamedChoice) and choice.function.name not in names:
        raise _BadRequest(f"'tool_choice' names function {choice.function.name!r}, which is "
                          "not in 'tools'", "tool_choice")


def _grammar(req: _Sampling) -> Grammar | None:
    """The grammar of a request: its ``response_format``'s, or the tool grammar (a forced
    call, one call at most, or calls or an answer of the ``response_format`` schema)."""
    raw = [(k, v) for k, v in (("regex", req.regex), ("grammar", req.grammar)) if v is not None]
    if raw:
        name, source = raw[-1]
        if len(raw) > 1:
            raise RequestError("give one of 'regex' and 'grammar'", name)
        if isinstance(req, _ChatRequest) and (req.response_format is not None
                                              or tool_names(req) is not None):
            raise RequestError(f"'{name}' sets what the answer must match: leave out "
                               "'response_format' and 'tools' with it", name)
        return Grammar.regex(source, name) if name == "regex" else Grammar.gbnf(source, name)
    if not isinstance(req, _ChatRequest):
        return None
    answer = Grammar.from_response_format(req.response_format)
    if tool_names(req) is None:
        return answer
    choice = req.tool_choice
    if isinstance(choice, NamedChoice):
        choice = choice.model_dump()
    tools = tool_grammar(tool_dicts(req), choice or "auto",
                         parallel=req.parallel_tool_calls is not False,
                         answer=None if answer is None else json.loads(answer.source))
    return tools if tools is not None else answer


def _logprobs(req: _Sampling) -> int | None:
    """``GenerationParams.logprobs`` of a request: chat's ``logprobs`` switches them on with
    ``top_logprobs`` alternatives, completions' ``logprobs`` is the number of alternatives."""
    if isinstance(req, _ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return getattr(req, "logprobs", None)


def generation_params(req: _Sampling | dict[str, Any], default_max_tokens: int
                      ) -> GenerationParams:
    """The request's ``GenerationParams`` (``default_max_tokens`` where it gives none; the
    ring fits it to the context). A dict is checked as a completion request first."""
    if isinstance(req, dict):
        req = parse_request({"prompt": "x", **req}, chat=False)
    asked = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    stop = req.stop if req.stop is not None else ()
    try:
        # OpenAI's default temperature is 1; every other field's is the table's.
        knobs = {"temperature": 1.0, **{k.name: v for k in fields.FIELDS
                                        if (v := getattr(req, k.name)) is not None}}
        return GenerationParams(
            grammar=_grammar(req), **knobs,
            max_tokens=default_max_tokens if asked is None else asked,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            spec=req.spec, ignore_eos=bool(req.ignore_eos), logit_bias=req.logit_bias,
            logprobs=_logprobs(req))
    except RequestError as e:
        raise _BadRequest(str(e), e.param) from None


class _Rebalance(BaseModel):
    """``POST /v1/ring/rebalance``: more nodes to take in, and whether to profile them."""

    model_config = ConfigDict(extra="forbid")
    nodes: list[Annotated[str, Field(strict=True, pattern=r"^[^\s:]+:\d{1,5}$")]] = []
    profile: Annotated[bool, Field(strict=True)] = True


def parse_rebalance(body: bytes) -> _Rebalance:
    """The rebalance request (an empty body: the defaults); ``_BadRequest`` naming the field."""
    try:
        return _Rebalance.model_validate_json(body or b"{}")
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise _BadRequest(f"unknown field {param!r}: give 'nodes' (host:port list) "
                              "and/or 'profile'", param) from None
        raise _BadRequest(f"'{param}': {first['msg']}" if param else
                          "request body must be a JSON object", param) from None
