"""OpenAI-compatible HTTP server over a ring (`edgespec serve`), with the Ollama API,
Anthropic Messages and OpenAI Responses on the same port (``ollama``, ``anthropic``,
``responses``: each turns its request into the chat request below and runs it the same way).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, with
``stream: true`` as server-sent events (``stream_options.include_usage`` adds a final usage
chunk), usage counts, stop sequences and errors in OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``) for every status, including 404s.

Every request field is checked before the ring sees it (pydantic models in ``requests``): a value
the ring would refuse (``top_p: 0``, ``temperature: 3``) is a 400 naming the field, so a
caller's mistake never reaches a stage. A field is honoured or refused, never ignored: an
OpenAI field this server does not implement (``functions``, ``store: true``, ``n: 2``) is a
400 naming it unless it holds the value that asks for nothing (``n: 1``, ``store: false``),
and a field outside the API is a 400 too. ``response_format`` and a forced tool call become
the request's grammar, and with ``tools`` the answer's text is parsed for calls
(``chat_input``). An OpenAI endpoint it does not implement (``/v1/embeddings``, images,
audio) is a 404 in the same shape naming the endpoint. Failures during a generation map to statuses by what they mean
(``edgespec.errors``): ``RequestError`` 400, ``StageFailure`` 500 with the stage's message,
``RingBusy`` 503 naming the head that holds the ring, ``NodeLost``/``RingError`` (a recovery
that did not succeed) 503. The ring keeps serving after each. A body over ``max_body`` bytes
(4 MiB by default) is refused with 413 from its ``Content-Length`` before it is read;
tokenization runs off the event loop, so a huge prompt never stalls ``/health``.

Model names: the served name, the ring's model (the GGUF file's stem), and the ``aliases``
(e.g. the registry name given to ``--model``, and a path's file name and stem) are all this
model. Since one model is served, any other name is served too, with a warning in the log
(as llama-server does), so clients configured with another model id keep working.

``GET /health`` answers at once, whatever the ring is doing, from the verdict of a
background probe (``health.Monitor``): ``status`` "ok" (200), "degraded" (200) or "down"
(503), with a ``message`` unless ok::

    {"status": "ok", "model": <served name>, "serving": 0..S, "queued": <waiting requests>,
     "max_queue": N, "parallel": S, "slots": [{"slot", "state", "tokens", "tokens_per_s",
     "prompt_tokens", "history_tokens", "kv_parked"}, ...], "completed": N, "abandoned": N,
     "rejected": N, "recoveries": N, "viewers": N}

``serving``/``queued``: the requests on the ring and those waiting for a slot; ``parallel``
and ``slots``: the ring's slots (``Ring.slots()``: busy/free, tokens of the current or last
request, its decode speed, its prompt, the committed tokens the slot holds and whether
their KV is parked in the stages' host memory); ``completed``,
``abandoned`` (the client left before its generation ended), ``rejected`` (429: queue full)
count requests since start; ``recoveries`` counts ring rebuilds after a node was lost;
``viewers``: web pages following the live view now. ``GET /metrics``: Prometheus' text
format (``health.Metrics``). ``POST /v1/ring/rebalance``: re-plan the ring this server holds
(`edgespec ring rebalance` comes here while the server holds the ring). The listener's
defences (read deadline, host check, JSON only, the page's CSP) are ``listener``'s.

``GET /`` serves a single page (files shipped in the package under ``edgespec/web``: no build
step, nothing from a CDN): a chat over the endpoints above, the ring drawn live, the token
tree of the current step as verification decides it, and charts over the session. Its live
data comes from ``GET /v1/ring`` (JSON: ``Ring.describe()`` plus per-stage compute time per
batch, the queue, and a record per finished generation) and ``GET /v1/ring/events``
(server-sent events: ``ring`` snapshots every 3 s, ``tree`` events batched every 0.5 s,
``gen`` records). The engine builds tree events only while a page is subscribed.

With ``api_key`` every endpoint (the page, its files and its stream included) needs
``Authorization: Bearer <key>`` or the page's same-site ``edgespec_key`` cookie (the page
asks for the key); without it, 401.

A ring serves ``Ring.parallel`` requests at once (``edgespec serve --parallel S``), one per
slot, each slot with its own sequences and committed history in the stages' KV caches, so
nothing from one request can reach another's attention; with S=1 (the default) requests run
one at a time. Requests beyond the free slots wait in arrival order (the ring's one queue,
``edgespec.head.scheduler``), and the queue is bounded: besides the requests being served, at most ``max_queue`` wait; one beyond
that gets 429 at once instead of waiting without end. A client that disconnects stops its
generation at the next step (or leaves the queue at once, if it was still waiting), so
abandoned requests hold neither a slot nor a place in the queue. SIGTERM
or SIGINT stops every generation at its next step (a stream then ends with an error event
``shutting_down`` and no ``[DONE]``, a plain request gets 503: a cut answer never passes for a
whole one), so the server exits promptly even mid-answer and the caller closes the ring.
FastAPI/uvicorn are used because they are the standard ASGI stack for this kind of API.

This module builds the app (routes) and runs it, over HTTPS with ``tls`` files (``tls``
makes a self-signed pair); the parts live beside it: ``requests`` (request models),
``chat_input`` (a chat's messages and tools, and tool calls in the answer), ``replies``
(errors and their statuses), ``inflight`` (cancel events for a shutdown), ``runs`` (every
door's one path through the ring's queue), ``streaming`` (OpenAI's completion answers),
the doors, ``live`` (the page's live view), ``access`` (the API key), ``health`` and
``listener``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgespec import errors
from edgespec.api import Ring
from edgespec.server.access import LOGIN_SCRIPT_HASH, _KeyCheck
from edgespec.server.anthropic import AnthropicDoor
from edgespec.server.health import Metrics, Monitor
from edgespec.server.inflight import Inflight
from edgespec.server.listener import (
    MAX_READING,
    READ_TIMEOUT_S,
    HostCheck,
    ReadGuard,
    allowed_hosts,
    guarded_protocol,
)
from edgespec.server.live import _Live, live_events
from edgespec.server.ollama import OllamaDoor
from edgespec.server.ollama import _error as ollama_error
from edgespec.server.replies import _error, _failure, _failure_message
from edgespec.server.requests import _BadRequest, parse_rebalance
from edgespec.server.responses import ResponsesDoor
from edgespec.server.runs import Runs
from edgespec.server.streaming import Completions
from edgespec.server.tls import exposure_warnings, fingerprint

log = logging.getLogger("edgespec.server")

#: Request bodies beyond this are refused (413) before they are read: a 4 MiB prompt is
#: already far beyond any context this server runs.
MAX_BODY_BYTES = 4 << 20


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

def _slots(ring: Ring) -> list[dict[str, Any]]:
    """``Ring.slots()``: one dict per slot (busy/free, tokens, speed)."""
    return [dict(s) for s in ring.slots()]


#: What a request for an endpoint this server does not have is told it serves instead.
SERVED_ENDPOINTS = ("POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, "
                    "POST /v1/messages, GET /v1/models and the Ollama API under /api")

#: The endpoints whose POST bodies are JSON (anything else is 415).
JSON_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/ring/rebalance",
                  "/v1/responses", "/v1/messages", "/api/chat", "/api/generate", "/api/show")


def create_app(ring: Ring, model_name: str, max_queue: int = 16,
               aliases: Sequence[str] = (), max_body: int = MAX_BODY_BYTES,
               api_key: str | None = None, hosts: set[str] | None = None) -> FastAPI:
    """The ASGI app serving ``ring`` under ``model_name`` (``aliases``: other names clients
    may use for it, e.g. the registry name). ``app.state.shutdown()`` stops every generation
    at its next step and refuses new requests (``serve`` calls it on SIGTERM/SIGINT).
    ``api_key``: every endpoint, the page and its live stream included, then needs it.
    ``hosts``: the names a request's Host may carry (``listener.allowed_hosts``); None: any."""
    live = _Live(ring)
    monitor = Monitor(ring, live.snapshot)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        monitor.start()  # /health's verdict stays current while the server runs
        try:
            yield
        finally:
            monitor.stop()

    app = FastAPI(title="edgespec", version="1", docs_url=None, redoc_url=None,
                  openapi_url=None, lifespan=lifespan)
    if api_key:
        app.add_middleware(_KeyCheck, key=api_key)
    # Outermost: a request for another site's host is refused before anything else.
    app.add_middleware(HostCheck, hosts=hosts, json_paths=JSON_ENDPOINTS,
                       login_script_hash=LOGIN_SCRIPT_HASH)
    # The server's queue bound is the ring's: one admission queue for every way in.
    ring.scheduler.set_max_queue(max_queue)
    queue = ring.scheduler
    inflight = Inflight()
    web = _web_files()
    app.state.live = live
    app.state.scheduler = queue
    app.state.monitor = monitor
    known_names = _model_names(model_name, ring.model_name, aliases)

    def shutdown() -> None:
        inflight.close()
        monitor.stop()

    app.state.shutdown = shutdown

    @app.exception_handler(_BadRequest)
    async def _bad_request(_: Request, exc: _BadRequest) -> JSONResponse:
        return _error(exc.status, str(exc), exc.kind, code=exc.code, param=exc.param,
                      headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods answer in OpenAI's shape too, so clients can parse it.
        if request.url.path.startswith("/api/"):  # the Ollama door's shape
            return ollama_error(exc.status_code, f"{request.method} {request.url.path}: "
                                f"{exc.detail}")
        if exc.status_code == 404 and "endpoint" not in request.scope:
            # No route matched: an OpenAI endpoint this server lacks (/v1/embeddings, images,
            # audio, ...) is named as unsupported. 404, not 501: OpenAI clients retry a 5xx,
            # and this answer never changes.
            return _error(404, f"{request.method} {request.url.path} is not supported by this "
                          f"server; it serves {SERVED_ENDPOINTS}", "invalid_request_error",
                          code="unsupported_endpoint")
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

    def gauges() -> dict[str, float]:
        return {**queue.state(), "parallel": ring.parallel}

    metrics = Metrics(ring, gauges, lambda: monitor.verdict)
    app.state.metrics = metrics

    @app.get("/health")
    async def health() -> JSONResponse:
        status, why = monitor.verdict
        with counts_lock:
            done = dict(counts)
        body = {"status": status, "model": model_name, **queue.state(),
                "parallel": ring.parallel, "slots": _slots(ring), **done,
                "recoveries": len(ring.recovery_log), "viewers": live.subscribers}
        if why:
            body["message"] = why
        return JSONResponse(body, status_code=503 if status == "down" else 200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

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
        snap.update(queue.state())
        snap["parallel"], snap["slots"] = ring.parallel, _slots(ring)
        snap["history"] = list(live.history)
        snap["health"], snap["health_message"] = monitor.verdict
        return snap

    @app.get("/v1/ring")
    async def ring_state() -> dict[str, Any]:
        """The ring as ``Ring.describe`` sees it, with live per-stage compute times, the
        queue, and this server's per-generation records."""
        return await asyncio.to_thread(_ring_json)

    @app.post("/v1/ring/rebalance")
    async def ring_rebalance(request: Request) -> dict[str, Any]:
        """Re-plan the ring this server holds over every node that answers (and ``nodes``,
        more ``host:port`` to take in), profiling them unless ``profile`` is false.
        Requests in flight finish first; new ones wait until the new ring is up
        (`edgespec ring rebalance` goes through here while this server holds the ring)."""
        body = parse_rebalance(await request.body())
        try:
            await asyncio.to_thread(ring.rebalance, nodes=body.nodes, profile=body.profile)
        except errors.RingError as e:  # the nodes' doing, not a bug here: no traceback
            log.warning("rebalance failed: %s", e)
            raise _BadRequest(f"the rebalance failed: {e}", code="rebalance_failed",
                              status=503, kind="ring_unavailable") from None
        monitor.replanned()
        live.invalidate()
        return await asyncio.to_thread(_ring_json)

    @app.get("/v1/ring/events")
    async def ring_events(request: Request) -> Response:
        """Server-sent events for the page: ``ring`` (the /v1/ring snapshot, at once and
        every few seconds), ``tree`` (the token tree's events, batched a few times a second)
        and ``gen`` (a finished generation's record). At most ``MAX_VIEWERS`` at once: the
        place is taken here, before the stream starts, so a burst of pages cannot pass."""
        ticket = live.reserve()
        if ticket is None:
            return _error(503, f"{live.MAX_VIEWERS} pages already follow the live view; close "
                          "one", "server_error", code="too_many_viewers")
        return StreamingResponse(live_events(request, live, inflight, _ring_json, ticket),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    runs = Runs(ring, model_name, inflight=inflight, live=live, count=count,
                max_body=max_body, known_names=known_names, metrics=metrics)
    gens = Completions(runs)
    app.post("/v1/completions")(gens.completions)
    app.post("/v1/chat/completions")(gens.chat_completions)
    # The other APIs' doors, each turning its request into the same chat request.
    ResponsesDoor(runs).routes(app)
    AnthropicDoor(runs).routes(app)
    OllamaDoor(runs).routes(app)
    return app


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def ready_lines(ring: Ring, model_name: str, url: str, api_key: str | None,
                cert: str | None = None) -> list[str]:
    """What `serve` prints once it listens: the model, the ring, and where to go."""
    try:
        view = ring.describe(probe=False)
        stages = view.get("stages") or []
    except Exception:
        stages = []
    nodes = sorted({str(s.get("node")) for s in stages if s.get("node")})
    where = ("local node processes" if getattr(ring, "local_nodes", None) is not None
             else ", ".join(nodes) or "this process")
    plan = " ".join(f"{a}:{b}" for a, b in (s.get("layers", (0, 0)) for s in stages))
    lines = [f"edgespec serve: model {model_name} ({ring.model_name}.gguf)",
             f"  ring: {len(stages)} stage(s) [{plan}] on {where}; {ring.parallel} slot(s)",
             f"  page: {url}/   API: {url}/v1   health: {url}/health   metrics: {url}/metrics"]
    lines.append(f"  also: OpenAI Responses {url}/v1/responses, Anthropic Messages "
                 f"{url}/v1/messages, Ollama {url}/api")
    if cert:
        lines.append(f"  TLS certificate {cert}, SHA-256 {fingerprint(cert)}")
    if api_key:
        lines.append("  every endpoint needs the API key (Authorization: Bearer <key>)")
    return lines


def server_config(app: FastAPI, host: str, port: int, *, read_timeout: float = READ_TIMEOUT_S,
                  log_level: str = "info", tls: tuple[str, str] | None = None) -> Any:
    """uvicorn's settings for ``app`` (made by ``create_app``): the listener's deadlines and
    caps (``listener``), idle keep-alive connections closed after 5 s, open connections
    capped (beyond: 503) above what the reading cap, the slots, the queue and the page's
    viewers use, and a shutdown that waits at most 5 s for responses still being written.
    ``tls``: (certificate, key) PEM files to answer HTTPS with."""
    import uvicorn

    guard = ReadGuard(read_timeout=read_timeout)
    app.state.read_guard = guard
    queue = app.state.scheduler
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=guarded_protocol(guard), timeout_keep_alive=5,
                          timeout_graceful_shutdown=5,
                          limit_concurrency=MAX_READING + 2 * (queue.max_queue + queue.parallel)
                          + 2 * _Live.MAX_VIEWERS + 32,
                          ssl_certfile=tls[0] if tls else None,
                          ssl_keyfile=tls[1] if tls else None)


def serve(ring: Ring, model_name: str, host: str = "127.0.0.1", port: int = 8080,
          max_queue: int = 16, aliases: Sequence[str] = (), api_key: str | None = None,
          allow_hosts: Sequence[str] = (), read_timeout: float = READ_TIMEOUT_S,
          on_ready: Callable[[str], None] | None = None,
          tls: tuple[str, str] | None = None) -> None:
    """Run the server until SIGINT or SIGTERM, then return (so the caller closes the ring).

    A signal first stops every generation at its next step, so in-flight answers end at
    once (each says it was cut off: streams with an error event, others 503) instead of
    holding the shutdown until they complete; uvicorn's graceful shutdown is bounded as a
    backstop. ``on_ready(url)`` is called once the server listens. ``tls``: (certificate,
    key) files: HTTPS instead of plain HTTP."""
    import uvicorn

    app = create_app(ring, model_name, max_queue, aliases=aliases, api_key=api_key,
                     hosts=allowed_hosts(host, allow_hosts))
    for warning in exposure_warnings(host, api_key, tls):
        log.warning("%s", warning)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.shutdown()
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit or not self.servers:
                return
            bound = self.servers[0].sockets[0].getsockname()[1]
            url = f"{'https' if tls else 'http'}://{_url_host(host)}:{bound}"
            for line in ready_lines(ring, model_name, url, api_key, tls[0] if tls else None):
                print(line, flush=True)
            if on_ready is not None:
                on_ready(url)

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
        _Server(server_config(app, host, port, read_timeout=read_timeout, tls=tls)).run()
    finally:
        app.state.shutdown()
        # The generation threads stop at their next step; let them leave the ring before the
        # caller closes it.
        app.state.scheduler.wait_idle(30)
        for sig, handler in saved.items():
            signal.signal(sig, handler)
