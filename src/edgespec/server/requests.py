"""Request bodies of the completion endpoints: every field is checked before the ring sees it
(pydantic models), a caller's mistake is a ``_BadRequest`` naming the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgespec.errors import RequestError
from edgespec.params import SPEC_MODES, GenerationParams


class _BadRequest(Exception):
    """A client error, answered as OpenAI does (400, 404, 413)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status

# ------------------------------------------------------------------------- request models
# Strict types: a number sent as a string, or true for 1, is a client bug worth reporting
# rather than guessing at. Unknown fields are ignored, as OpenAI-compatible servers do, since
# clients send fields such as "user" or "frequency_penalty" with neutral values.

_Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
_Int = Annotated[int, Field(strict=True)]


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Annotated[str, Field(strict=True)]


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(strict=True)] | list[_TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Annotated[bool, Field(strict=True)] = False


class _Sampling(BaseModel):
    """The fields both endpoints share. ``None`` means "the default", as OpenAI treats null."""

    model_config = ConfigDict(extra="ignore")
    model: Annotated[str, Field(strict=True)] | None = None
    max_tokens: Annotated[_Int, Field(ge=1, le=1 << 20)] | None = None
    # Newer clients send max_completion_tokens (chat); it means the same here.
    max_completion_tokens: Annotated[_Int, Field(ge=1, le=1 << 20)] | None = None
    temperature: Annotated[_Float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[_Float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[_Int, Field(ge=0, le=(1 << 31) - 1)] | None = None
    # Any 64-bit seed, signed or not; the sampler takes it modulo 2**64.
    seed: Annotated[_Int, Field(ge=-(1 << 63), le=(1 << 64) - 1)] | None = None
    n: Literal[1] | None = None
    stop: (Annotated[str, Field(strict=True)]
           | Annotated[list[Annotated[str, Field(strict=True)]], Field(max_length=4)]
           | None) = None
    stream: Annotated[bool, Field(strict=True)] | None = None
    stream_options: _StreamOptions | None = None
    # edgespec's own: the speculative mode for this request (the web page's control).
    spec: Literal[SPEC_MODES] | None = None  # type: ignore[valid-type]
    # As llama-server and vLLM take it: go on past end-of-generation to max_tokens (benchmarks).
    ignore_eos: Annotated[bool, Field(strict=True)] | None = None


class _ChatRequest(_Sampling):
    messages: Annotated[list[_Message], Field(min_length=1)]


class _CompletionRequest(_Sampling):
    prompt: (Annotated[str, Field(strict=True, min_length=1)]
             | Annotated[list[Annotated[str, Field(strict=True, min_length=1)]],
                         Field(min_length=1, max_length=1)])

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


#: One clear line per field, instead of pydantic's per-branch union messages.
_FIELD_HELP = {
    "temperature": "'temperature' must be a number between 0 and 2",
    "top_p": "'top_p' must be a number greater than 0 and at most 1",
    "top_k": "'top_k' must be an integer >= 0 (0 = off)",
    "seed": "'seed' must be a 64-bit integer",
    "max_tokens": "'max_tokens' must be an integer >= 1",
    "max_completion_tokens": "'max_completion_tokens' must be an integer >= 1",
    "n": "only n=1 is supported",
    "stop": "'stop' must be a string or a list of up to 4 strings",
    "messages": "'messages' must be a non-empty list of {role, content} with role system, "
                "user or assistant and text content",
    "prompt": "'prompt' must be a non-empty string (or a list of one)",
    "stream": "'stream' must be true or false",
    "stream_options": "'stream_options' must be an object like {\"include_usage\": true}",
    "model": "'model' must be a string",
    "spec": f"'spec' must be one of {', '.join(SPEC_MODES)}",
    "ignore_eos": "'ignore_eos' must be true or false",
}


def parse_request(body: bytes | dict[str, Any], chat: bool) -> _ChatRequest | _CompletionRequest:
    """Validate a request body (raw JSON or already parsed); ``_BadRequest`` naming the first
    offending field otherwise."""
    model = _ChatRequest if chat else _CompletionRequest
    try:
        if isinstance(body, (bytes, bytearray)):
            return model.model_validate_json(body)
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise _BadRequest("request body is not valid JSON") from None
        loc = first["loc"]
        if not loc:
            raise _BadRequest("request body must be a JSON object") from None
        param = str(loc[0])
        if first["type"] == "missing":
            raise _BadRequest(f"'{param}' is required", param) from None
        raise _BadRequest(_FIELD_HELP.get(param, f"'{param}': {first['msg']}"), param) from None


def generation_params(req: _Sampling | dict[str, Any], default_max_tokens: int
                      ) -> GenerationParams:
    """The request's ``GenerationParams`` (``default_max_tokens`` where it gives none; the
    ring fits it to the context). A dict is checked as a completion request first."""
    if isinstance(req, dict):
        req = parse_request({"prompt": "x", **req}, chat=False)
    asked = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    stop = req.stop if req.stop is not None else ()
    try:
        return GenerationParams(
            max_tokens=default_max_tokens if asked is None else asked,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=0 if req.seed is None else req.seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            spec=req.spec, ignore_eos=bool(req.ignore_eos))
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
