"""OpenAI-compatible HTTP server over a ring (`edgespec serve`).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, with
``stream: true`` as server-sent events (``stream_options.include_usage`` adds a final usage
chunk), usage counts, stop sequences and errors in OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``) for every status, including 404s.

Every request field is checked before the ring sees it (pydantic models below): a value the
ring would refuse (``top_p: 0``, ``temperature: 3``, ``n: 2``) is a 400 naming the field, so a
caller's mistake never reaches a stage. Failures during a generation map to statuses by what
they mean (``edgespec.errors``): ``RequestError`` 400, ``StageFailure`` 500 with the stage's
message, ``RingBusy`` 503 naming the head that holds the ring, ``NodeLost``/``RingError`` (a
recovery that did not succeed) 503. The ring keeps serving after each. A body over
``max_body`` bytes (4 MiB by default) is refused with 413 from its ``Content-Length`` before it
is read; tokenization runs off the event loop, so a huge prompt never stalls ``/health``.

Model names: the served name, the ring's model (the GGUF file's stem), and the ``aliases``
(e.g. the registry name given to ``--model``, and a path's file name and stem) are all this
model. Since one model is served, any other name is served too, with a warning in the log
(as llama-server does), so clients configured with another model id keep working.

``GET /health`` answers at once, whatever the ring is doing::

    {"status": "ok", "model": <served name>, "serving": 0|1, "queued": <waiting requests>,
     "max_queue": N, "completed": N, "abandoned": N, "rejected": N, "recoveries": N,
     "viewers": N}

``serving``/``queued``: the request on the ring and those waiting for it; ``completed``,
``abandoned`` (the client left before its generation ended), ``rejected`` (429: queue full)
count requests since start; ``recoveries`` counts ring rebuilds after a node was lost;
``viewers``: web pages following the live view now.

``GET /`` serves a single page (files shipped in the package under ``edgespec/web``: no build
step, nothing from a CDN): a chat over the endpoints above, the ring drawn live, the token
tree of the current round as verification decides it, and charts over the session. Its live
data comes from ``GET /v1/ring`` (JSON: ``Ring.describe()`` plus per-stage compute time per
batch, the queue, and a record per finished generation) and ``GET /v1/ring/events``
(server-sent events: ``ring`` snapshots every 3 s, ``tree`` events batched every 0.5 s,
``gen`` records). The engine builds tree events only while a page is subscribed.

With ``api_key`` every endpoint (the page, its files and its stream included) needs
``Authorization: Bearer <key>`` or the page's same-site ``edgespec_key`` cookie (the page
asks for the key); without it, 401.

One ring holds one KV cache, so requests run one at a time in arrival order (a FIFO gate):
nothing from one request can leak into another's context. The queue is bounded: besides the
request being served, at most ``max_queue`` wait; one beyond that gets 429 at once instead of
waiting without end. A client that disconnects stops its generation at the next round (or
before it starts, if it was still queued), so abandoned requests do not hold the ring. SIGTERM
or SIGINT stops every generation at its next round (streams end with ``finish_reason:
"stop"``), so the server exits promptly even mid-answer and the caller closes the ring.
FastAPI/uvicorn are used because they are the standard ASGI stack for this kind of API.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from http.cookies import SimpleCookie
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import unquote

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgespec import errors
from edgespec.api import Generation, Ring, TextStream

log = logging.getLogger("edgespec.server")

#: Legacy completions stop after 16 tokens when max_tokens is omitted (OpenAI's default);
#: chat completions may use the rest of the context, as OpenAI's do.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: Request bodies beyond this are refused (413) before they are read: a 4 MiB prompt is
#: already far beyond any context this server runs.
MAX_BODY_BYTES = 4 << 20

# Ring failures that end a request with 503 (the ring is unusable right now).
_RING_ERRORS: tuple[type[BaseException], ...] = (errors.RingError,)


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

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is served or queued; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._admitted == 0, timeout)

    def state(self) -> dict[str, int]:
        with self._cond:
            return {"serving": min(self._admitted, 1), "queued": max(self._admitted - 1, 0),
                    "max_queue": self.max_queue}


def _error(status: int, message: str, err_type: str, code: str | None = None,
           param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers, content={
        "error": {"message": message, "type": err_type, "param": param, "code": code}})


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
    spec: Literal["auto", "none", "sync", "flow"] | None = None


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
    "spec": "'spec' must be one of auto, none, sync, flow",
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


def _sampling_args(req: _Sampling | dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``Ring.stream_tokens`` (``max_tokens`` None: the endpoint's
    default, decided once the prompt's length is known)."""
    if isinstance(req, dict):
        req = parse_request({"prompt": "x", **req}, chat=False)
    stop = req.stop if req.stop is not None else []
    return {
        "max_tokens": req.max_tokens if req.max_tokens is not None else req.max_completion_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "seed": 0 if req.seed is None else req.seed % (1 << 64),
        "stop": [stop] if isinstance(stop, str) else list(stop),
    }


def _failure(exc: BaseException) -> tuple[int, str, str | None, str | None]:
    """(status, type, code, param) for an exception raised while serving a request."""
    if isinstance(exc, errors.RequestError):
        return 400, "invalid_request_error", None, exc.param
    if isinstance(exc, errors.RingBusy):
        return 503, "ring_busy", "ring_busy", None
    if isinstance(exc, errors.StageFailure):
        return 500, "server_error", exc.code, None
    if isinstance(exc, _RING_ERRORS):
        return 503, "ring_unavailable", "ring_unavailable", None
    return 500, "server_error", None, None


def _failure_message(exc: BaseException) -> str:
    if isinstance(exc, errors.RequestError):
        return str(exc)
    if isinstance(exc, errors.RingBusy):
        return f"the ring is busy: {exc}"
    if isinstance(exc, errors.StageFailure):
        return f"a stage failed: {exc}"
    if isinstance(exc, _RING_ERRORS):
        return f"the ring is unavailable: {exc}"
    return f"generation failed: {type(exc).__name__}: {exc}"


def _model_names(served: str, ring_model: str, aliases: Iterable[str]) -> set[str]:
    """Every name that means the served model: names as given, and for paths their file
    name and stem."""
    names = {served, ring_model, ring_model + ".gguf"}  # the ring's name is the file's stem
    for a in aliases:
        if not a:
            continue
        names.add(a)
        p = Path(a)
        names.update({p.name, p.stem})
    return names


class _Inflight:
    """The cancel events of every admitted request, so a shutdown can stop them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: set[threading.Event] = set()
        self.closing = False

    def add(self, ev: threading.Event) -> bool:
        with self._lock:
            if self.closing:
                return False
            self._events.add(ev)
            return True

    def discard(self, ev: threading.Event) -> None:
        with self._lock:
            self._events.discard(ev)

    def close(self) -> None:
        """Stop every admitted generation at its next round and refuse new ones."""
        with self._lock:
            self.closing = True
            events = list(self._events)
        for ev in events:
            ev.set()


class _Live:
    """What the web page's live view shows: tree events from the engine (only while a page
    is subscribed: with none, the engine has no listener and builds no event), a record per
    finished generation, and ring snapshots (``Ring.describe``) with per-stage compute
    times derived from two successive snapshots."""

    #: How often a subscriber is sent the tree events gathered meanwhile, and at most how
    #: many per flush (the page draws the latest round only).
    FLUSH_S = 0.5
    MAX_EVENTS = 400
    #: Ring snapshots (one health round trip per node) at most this often, for all pages.
    SNAPSHOT_S = 3.0
    #: Pages following the live view at once (each holds a connection).
    MAX_VIEWERS = 8

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self._lock = threading.Lock()
        self._events: collections.deque[tuple[int, dict]] = collections.deque(maxlen=4096)
        self._seq = 0
        self._subscribers = 0
        self.history: collections.deque[dict] = collections.deque(maxlen=500)
        self._snap: dict | None = None
        self._snap_at = 0.0
        self._snap_lock = threading.Lock()
        self._prev: dict[int, tuple[float, int, float]] = {}  # stage -> (time, batches, busy)
        self._texts: dict[int, str] = {}

    def _on_event(self, event: dict) -> None:
        """Engine thread: O(1), no formatting (that happens on the way to the page)."""
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, event))

    def subscribe(self) -> int:
        with self._lock:
            self._subscribers += 1
            if self._subscribers == 1:
                self.ring.add_listener(self._on_event)
            return self._seq

    def unsubscribe(self) -> None:
        with self._lock:
            self._subscribers -= 1
            if self._subscribers == 0:
                self.ring.remove_listener(self._on_event)

    @property
    def subscribers(self) -> int:
        with self._lock:
            return self._subscribers

    def since(self, seq: int) -> tuple[int, list[dict]]:
        """Events after ``seq`` (newest last). Scans from the newest end only, so the
        engine thread never waits on a long copy."""
        out: list[dict] = []
        with self._lock:
            for s, e in reversed(self._events):
                if s <= seq:
                    break
                out.append(e)
            last = self._seq
        out.reverse()
        return last, out

    def add_generation(self, record: dict) -> None:
        self.history.append(record)
        self._on_event({"e": "gen", **record})

    def text(self, token: int) -> str:
        t = self._texts.get(token)
        if t is None:
            t = self.ring.tokenizer.piece(token, special=True).decode("utf-8", "replace")
            if len(self._texts) < 200_000:
                self._texts[token] = t
        return t

    def readable(self, events: list[dict]) -> list[dict]:
        """Tree events with token texts added, the latest ``MAX_EVENTS`` only."""
        out = []
        for ev in events[-self.MAX_EVENTS:]:
            ev = dict(ev)
            if ev["e"] == "rows":
                ev["rows"] = [[n, p, t, self.text(t)] for n, p, t in ev["rows"]]
            elif ev["e"] == "decide":
                ev["bonus_text"] = self.text(ev["bonus"])
            elif ev["e"] == "plain":
                ev["text"], ev["root_text"] = self.text(ev["token"]), self.text(ev["root"])
            out.append(ev)
        return out

    def snapshot(self, max_age: float = SNAPSHOT_S) -> dict:
        """``Ring.describe()`` plus live per-stage compute time per batch (blocking: call
        from a worker thread), reused for ``max_age`` seconds."""
        with self._snap_lock:
            now = time.monotonic()
            if self._snap is not None and now - self._snap_at < max_age:
                return self._snap
            try:
                snap = self.ring.describe()
            except Exception as exc:  # the page must show a broken ring, not fail with it
                snap = {"status": "down", "message": f"{type(exc).__name__}: {exc}",
                        "hint": "restart `edgespec serve` (or `edgespec ring up`)",
                        "stages": [], "model": self.ring.model_name}
            for st in snap.get("stages", []):
                st["ms_per_batch"] = None
                if st.get("batches") is None:
                    continue
                prev = self._prev.get(st["stage"])
                if prev is not None and st["batches"] > prev[1]:
                    st["ms_per_batch"] = round(
                        (st["busy_s"] - prev[2]) * 1e3 / (st["batches"] - prev[1]), 2)
                elif prev is not None and self._snap is not None:
                    old = next((o for o in self._snap.get("stages", [])
                                if o["stage"] == st["stage"]), None)
                    st["ms_per_batch"] = old and old.get("ms_per_batch")  # idle: keep last
                if prev is None or st["batches"] != prev[1]:
                    self._prev[st["stage"]] = (now, st["batches"], st["busy_s"])
            self._snap, self._snap_at = snap, now
            return snap


#: The page served at ``/`` to a browser without the key when ``--api-key`` is set: it asks
#: for the key and keeps it in a same-site cookie, which the page's requests then carry.
_LOGIN_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>edgespec: API key</title></head><body style="font: 15px system-ui; margin: 3em">
<h1>edgespec</h1><p>This server needs its API key (<code>edgespec serve --api-key</code>).</p>
<form id="f"><input id="k" type="password" autofocus placeholder="API key" size="40">
<button>Open</button></form><script>
document.getElementById("f").onsubmit = (e) => { e.preventDefault();
  document.cookie = "edgespec_key=" + encodeURIComponent(document.getElementById("k").value) +
    "; path=/; SameSite=Strict"; location.reload(); };
</script></body></html>"""


class _KeyCheck:
    """ASGI middleware: every request must carry the API key, as ``Authorization: Bearer
    <key>`` (API clients) or the page's ``edgespec_key`` cookie (browsers: a same-site
    cookie, so other sites cannot use it). Compared in constant time."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key = key.encode()

    def _supplied(self, scope: dict) -> bytes:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            return auth[7:].strip()
        cookie = headers.get(b"cookie")
        if cookie:
            jar: SimpleCookie = SimpleCookie()
            with contextlib.suppress(Exception):
                jar.load(cookie.decode("latin-1"))
            if "edgespec_key" in jar:
                return unquote(jar["edgespec_key"].value).encode()
        return b""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or hmac.compare_digest(self._supplied(scope), self.key):
            await self.app(scope, receive, send)
            return
        headers = {"WWW-Authenticate": "Bearer"}
        if scope.get("path") == "/" and scope.get("method") == "GET":
            response: Response = HTMLResponse(_LOGIN_PAGE, status_code=401, headers=headers)
        else:
            response = _error(401, "missing or wrong API key: send 'Authorization: Bearer "
                              "<key>'", "invalid_request_error", code="invalid_api_key",
                              headers=headers)
        await response(scope, receive, send)


def _web_files() -> dict[str, tuple[bytes, str]]:
    """The page's files, shipped in the package (no build step, nothing from a CDN)."""
    kinds = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
             ".css": "text/css; charset=utf-8"}
    out = {}
    for f in resources.files("edgespec").joinpath("web").iterdir():
        kind = kinds.get(Path(f.name).suffix)
        if kind is not None:
            out[f.name] = (f.read_bytes(), kind)
    return out


def create_app(ring: Ring, model_name: str, max_queue: int = 16,
               aliases: Sequence[str] = (), max_body: int = MAX_BODY_BYTES,
               api_key: str | None = None) -> FastAPI:
    """The ASGI app serving ``ring`` under ``model_name`` (``aliases``: other names clients
    may use for it, e.g. the registry name). ``app.state.shutdown()`` stops every generation
    at its next round and refuses new requests (``serve`` calls it on SIGTERM/SIGINT).
    ``api_key``: every endpoint, the page and its live stream included, then needs it."""
    app = FastAPI(title="edgespec", version="1", docs_url=None, redoc_url=None,
                  openapi_url=None)
    if api_key:
        app.add_middleware(_KeyCheck, key=api_key)
    gate = _Gate(max_queue)
    inflight = _Inflight()
    live = _Live(ring)
    web = _web_files()
    app.state.live = live
    app.state.shutdown = inflight.close
    app.state.gate = gate
    known_names = _model_names(model_name, ring.model_name, aliases)
    warned_names: set[str] = set()

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
        status, kind, code, param = _failure(exc)
        return _error(status, _failure_message(exc), kind, code=code, param=param)

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
        return {"status": "ok", "model": model_name, **gate.state(), **done,
                "recoveries": len(ring.recovery_log), "viewers": live.subscribers}

    @app.get("/")
    async def page() -> Response:
        body, kind = web["index.html"]
        return Response(body, media_type=kind, headers={"Cache-Control": "no-cache"})

    @app.get("/web/{name}")
    async def web_file(name: str) -> Response:
        if name not in web:
            raise StarletteHTTPException(404, f"no such file: {name}")
        body, kind = web[name]
        return Response(body, media_type=kind, headers={"Cache-Control": "no-cache"})

    def _ring_json() -> dict[str, Any]:
        snap = dict(live.snapshot())
        snap.update(gate.state())
        snap["history"] = list(live.history)
        return snap

    @app.get("/v1/ring")
    async def ring_state() -> dict[str, Any]:
        """The ring as ``Ring.describe`` sees it, with live per-stage compute times, the
        queue, and this server's per-generation records."""
        return await asyncio.to_thread(_ring_json)

    @app.get("/v1/ring/events")
    async def ring_events(request: Request) -> Response:
        """Server-sent events for the page: ``ring`` (the /v1/ring snapshot, at once and
        every few seconds), ``tree`` (the token tree's events, batched a few times a second)
        and ``gen`` (a finished generation's record). At most ``MAX_VIEWERS`` at once."""
        if live.subscribers >= live.MAX_VIEWERS:
            return _error(503, f"{live.MAX_VIEWERS} pages already follow the live view; close "
                          "one", "server_error", code="too_many_viewers")
        return StreamingResponse(_live_events(request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _live_events(request: Request) -> AsyncIterator[bytes]:
        def sse(event: str, payload: Any) -> bytes:
            return f"event: {event}\ndata: {json.dumps(payload)}\n\n".encode()

        seq = live.subscribe()
        try:
            yield sse("ring", await asyncio.to_thread(_ring_json))
            next_ring = time.monotonic() + live.SNAPSHOT_S
            while not inflight.closing:
                await asyncio.sleep(live.FLUSH_S)
                if await request.is_disconnected():
                    break
                seq, events = live.since(seq)
                tree = [e for e in events if e["e"] != "gen"]
                if tree:
                    yield sse("tree", live.readable(tree))
                for e in events:
                    if e["e"] == "gen":
                        yield sse("gen", {k: v for k, v in e.items() if k != "e"})
                if time.monotonic() >= next_ring:
                    next_ring = time.monotonic() + live.SNAPSHOT_S
                    snap = await asyncio.to_thread(_ring_json)
                    snap.pop("history")  # the page keeps its own from the gen events
                    yield sse("ring", snap)
        finally:
            live.unsubscribe()

    async def _read_body(request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed ``max_body``: from
        its Content-Length before reading anything, or while reading a chunked one."""
        too_big = _BadRequest(f"request body exceeds {max_body} bytes",
                              code="request_too_large", status=413)
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise _BadRequest("invalid Content-Length header")
            if int(length) > max_body:
                raise too_big
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_model(name: str | None) -> None:
        if name is None or name in known_names or name in warned_names:
            return
        warned_names.add(name)
        log.warning("request for model %r: serving %r (the only model here) under that name",
                    name, model_name)

    def _prompt_tokens(req: _ChatRequest | _CompletionRequest) -> list[int]:
        tok = ring.tokenizer
        if isinstance(req, _ChatRequest):
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            return tok.chat_tokens(msgs, add_generation_prompt=True)
        return tok.encode(req.text(), add_special=True, parse_special=False)

    def _usage(gen: Generation) -> dict[str, int]:
        return {"prompt_tokens": gen.stats.prompt_tokens,
                "completion_tokens": gen.stats.tokens,
                "total_tokens": gen.stats.prompt_tokens + gen.stats.tokens}

    def _record(gen: Generation, ttft: float | None, kind: str) -> None:
        st = gen.stats
        live.add_generation({
            "time": time.time(), "kind": kind, "mode": st.mode, "tokens": st.tokens,
            "prompt_tokens": st.prompt_tokens, "tokens_per_s": round(st.tokens_per_s, 3),
            "laps": st.laps, "rounds": st.rounds,
            "tokens_per_lap": round(st.tokens / st.laps, 3) if st.laps else 0.0,
            "accepted_hist": {str(k): v for k, v in sorted(st.accepted_hist.items())},
            "ttft_ms": None if ttft is None else round(ttft * 1e3, 1),
            "finish": gen.finish_reason, "recoveries": st.recoveries})

    def _launch(ticket: int, make_stream: Callable[[], TextStream], cancel: threading.Event,
                max_tokens: int, kind: str = "chat") -> asyncio.Queue:
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
                t0 = time.perf_counter()
                ttft = None
                stream = make_stream()
                for piece in stream:
                    if ttft is None:
                        ttft = time.perf_counter() - t0  # prefill + first round
                    put(piece)
                gen = stream.result
                if gen is not None:
                    _record(gen, ttft, kind)
                # Abandoned: the client hung up and the generation stopped short for it.
                left = cancel.is_set() and gen is not None and gen.stats.tokens < max_tokens
                count("abandoned" if left else "completed")
                put(gen)
            except Exception as exc:  # reported to the client (error body or SSE event)
                if not isinstance(exc, errors.RequestError):
                    log.warning("request failed: %s: %s", type(exc).__name__, exc)
                put(exc)
            finally:
                inflight.discard(cancel)
                gate.leave()
                put(None)

        threading.Thread(target=produce, name=f"edgespec-serve-{ticket}", daemon=True).start()
        return queue

    def _prepare(raw: bytes, chat: bool) -> tuple[Any, dict[str, Any], list[int]]:
        """Validation and tokenization: run in a worker thread, since a large prompt takes
        a while to tokenize and must not hold up the event loop."""
        req = parse_request(raw, chat)
        args = _sampling_args(req)
        if req.spec is not None:
            try:  # e.g. "flow" on a ring without a drafter: the caller's choice, not a fault
                ring.engine.resolve_mode(req.spec)
            except ValueError as exc:
                raise _BadRequest(str(exc), "spec") from None
            args["spec"] = req.spec
        tokens = _prompt_tokens(req)
        room = ring.n_ctx - len(tokens)
        if args["max_tokens"] is None:
            args["max_tokens"] = room if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
        if room < 1 or args["max_tokens"] > room:
            raise _BadRequest(
                f"this model's context is {ring.n_ctx} tokens; the prompt has {len(tokens)} "
                f"and max_tokens asks for {args['max_tokens']} more",
                "messages" if chat else "prompt", code="context_length_exceeded")
        return req, args, tokens

    async def _run(request: Request, chat: bool) -> Any:
        raw = await _read_body(request)
        req, args, tokens = await asyncio.to_thread(_prepare, raw, chat)
        _check_model(req.model)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        cancel = threading.Event()
        if not inflight.add(cancel):
            return _error(503, "the server is shutting down", "server_error",
                          code="shutting_down")
        ticket = gate.try_enter()
        if ticket is None:
            inflight.discard(cancel)
            count("rejected")
            # Retry-After: OpenAI clients wait this long before their automatic retries.
            return _error(429, f"server busy: {max_queue} requests already queued; retry later",
                          "rate_limit_exceeded", code="rate_limit_exceeded",
                          headers={"Retry-After": "1"})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        queue = _launch(ticket, lambda: ring.stream_tokens(tokens, cancel=cancel, **args),
                        cancel, args["max_tokens"], "chat" if chat else "completion")

        if req.stream:
            return StreamingResponse(
                _sse(queue, cancel, chat, rid, created, include_usage),
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
        if failure is not None:
            status, kind, code, param = _failure(failure)
            return _error(status, _failure_message(failure), kind, code=code, param=param)
        if gen is None:
            return _error(503, "the request was cancelled", "server_error", code="cancelled")
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
                    _, kind, code, param = _failure(item)
                    yield event({"error": {"message": _failure_message(item), "type": kind,
                                           "param": param, "code": code}})
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
          max_queue: int = 16, aliases: Sequence[str] = (), api_key: str | None = None
          ) -> None:
    """Run the server until SIGINT or SIGTERM, then return (so the caller closes the ring).

    A signal first stops every generation at its next round, so in-flight answers end at
    once (streams with ``finish_reason: "stop"``) instead of holding the shutdown until they
    complete; uvicorn's graceful shutdown is bounded as a backstop."""
    import uvicorn

    app = create_app(ring, model_name, max_queue, aliases=aliases, api_key=api_key)
    if not api_key and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without --api-key: anyone who can reach this port can use "
                    "the ring", host)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.shutdown()
            super().handle_exit(sig, frame)

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
        # Deadlines and caps for the listener: idle keep-alive connections close after 5 s,
        # open connections are capped (beyond: 503), and a shutdown waits at most 5 s for
        # responses still being written.
        config = uvicorn.Config(app, host=host, port=port, log_level="info",
                                timeout_keep_alive=5, timeout_graceful_shutdown=5,
                                limit_concurrency=max(64, 2 * max_queue + 32))
        _Server(config).run()
    finally:
        app.state.shutdown()
        # The generation threads stop at their next round; let them leave the ring before the
        # caller closes it.
        app.state.gate.wait_idle(30)
        for sig, handler in saved.items():
            signal.signal(sig, handler)
