"""What the other APIs' doors (``ollama``, ``anthropic``, ``responses``) share: a body read
as JSON under the size cap, a door's own pydantic model checked with errors naming the field,
and every refusal or failure answered in the door's own error shape. Each door turns its
request into the OpenAI chat request ``requests`` checks, so every door builds the same
``GenerationParams`` and runs through ``runs``."""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from edgespec.api import Generation, Ring
from edgespec.server.replies import _failure, _failure_message
from edgespec.server.requests import _BadRequest, _ChatRequest, _path, parse_request
from edgespec.server.runs import Runs

#: A door's error answer: (status, message, kind, code, headers) -> its response.
Shape = Callable[[int, str, str, "str | None", "dict[str, str] | None"], Response]


def answered_in(shape: Shape) -> Callable[[Callable[..., Awaitable[Any]]],
                                          Callable[..., Awaitable[Any]]]:
    """A door's route whose refusals (``_BadRequest``) and failures (``edgespec.errors``,
    as ``replies`` maps them) are answered by ``shape`` in that API's error shape."""
    def wrap(route: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(route)
        async def guarded(*args: Any, **kw: Any) -> Any:
            try:
                return await route(*args, **kw)
            except _BadRequest as e:
                return shape(e.status, str(e), e.kind, e.code, e.headers)
            except Exception as e:
                status, kind, code, _ = _failure(e)
                return shape(status, _failure_message(e), kind, code, None)
        return guarded
    return wrap


async def read_json(runs: Runs, request: Request) -> Any:
    """The request's body as JSON (413 beyond the size cap)."""
    raw = await runs.read_body(request)
    try:
        return json.loads(raw)
    except ValueError:
        raise _BadRequest("request body is not valid JSON") from None


def check(model: type[BaseModel], body: Any, help: dict[str, str] | None = None,
          at: str = "") -> Any:
    """``body`` as ``model``; a ``_BadRequest`` naming the first offending field otherwise
    (one outside the API too). ``at``: where ``body`` sits in the request (``input[2]``)."""
    if not isinstance(body, dict):
        raise _BadRequest(f"'{at}' must be a JSON object" if at else
                          "request body must be a JSON object", at.split("[")[0] or None)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errs = exc.errors(include_url=False)
        first = next((e for e in errs if e["type"] == "extra_forbidden"), errs[0])
        inner = _path(first["loc"])
        where = (f"{at}.{inner}" if inner else at) if at else (inner or "body")
        param = at.split("[")[0] if at else str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise _BadRequest(f"unknown field '{where}': not supported by this server", param,
                              code="unknown_parameter") from None
        if first["type"] == "missing":
            raise _BadRequest(f"'{where}' is required", param) from None
        hint = (help or {}).get(param or "")
        raise _BadRequest(hint or f"'{where}': {first['msg']}", param) from None


def unsupported(field: str, fix: str = "leave it out") -> _BadRequest:
    return _BadRequest(f"'{field}' is not supported by this server: {fix}", field.split(".")[0],
                       code="unsupported_parameter")


def openai_chat(body: dict[str, Any], renames: dict[str, str] | None = None) -> _ChatRequest:
    """The OpenAI chat request a door's request became, checked as the OpenAI door checks
    it; a refusal names the field as the door's caller wrote it (``renames``: OpenAI's
    name to the door's)."""
    try:
        return parse_request({k: v for k, v in body.items() if v is not None}, chat=True)
    except _BadRequest as e:
        for theirs, ours in (renames or {}).items():
            if e.param == theirs:
                e.param = ours
                e.args = (str(e).replace(f"'{theirs}'", f"'{ours}'"),)
        raise


def json_schema_format(schema: Any, name: str = "answer") -> dict[str, Any]:
    """OpenAI's ``response_format`` for an answer that follows ``schema``."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def call_arguments(arguments: str) -> Any:
    """A parsed call's arguments (JSON text) as the object the door's API sends."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def stop_sequence(ring: Ring, gen: Generation, stops: list[str] | None) -> str | None:
    """The stop sequence that ended ``gen`` (its text leaves it out; its tokens hold it),
    or None when it ended otherwise."""
    if gen.finish_reason != "stop" or not stops:
        return None
    full = ring.tokenizer.decode(gen.tokens)
    rest = full[len(gen.text):] if full.startswith(gen.text) else ""
    return next((s for s in stops if rest.startswith(s)), None)
