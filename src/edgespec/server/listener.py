"""The HTTP listener's defences against strangers on the LAN (docs/design.md 5.9).

- **One deadline for reading a request** (``ReadGuard``): from a connection's first byte (or
  its opening) to the last byte of the request's body, ``read_timeout`` seconds. A connection
  that dribbles its header lines or its body (slowloris) is answered 408 or dropped when the
  deadline passes; the time the app then takes to answer is not counted.
- **Connections still reading have a cap of their own**, in total and per source address,
  apart from the requests being served: when it is reached, the oldest connection still
  reading (of that source, when one source is at its cap) is dropped for the newcomer. A
  genuine client sends its request within milliseconds of connecting, so a crowd of slow
  connections can never keep it out, and never fills the server's connection limit.
- **Host check** (``HostCheck``): a browser page on another site can make a browser send
  requests to this server (and DNS rebinding can make it read the answers). Every request
  must name a host this server is bound for: localhost names, the bound address, this
  machine's addresses and names when bound to all interfaces, and names given with
  ``--allow-host``; else 400.
- **JSON bodies only** on JSON endpoints: a cross-site form or ``text/plain`` POST (which a
  browser sends without asking the server first) is 415.
- **Headers for the page**: a Content-Security-Policy that only allows the page's own files
  and connections, ``frame-ancestors 'none'`` (no framing: no clickjacking), no MIME sniffing.

Written against uvicorn's h11 protocol (the one uvicorn runs without optional extras): the
guard needs to know when a request's headers and body are complete, which only the protocol
sees. Starlette's TrustedHostMiddleware answers in plain text; the host check answers in
OpenAI's error shape like every other refusal here, naming the flag that fixes it.
"""

from __future__ import annotations

import socket
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from edgespec.server.replies import _error

#: Seconds from a request's first byte to the end of its body. A 4 MiB body (the largest
#: accepted) crosses even a slow Wi-Fi link well within it.
READ_TIMEOUT_S = 15.0
#: Connections still reading a request, in all and from one source address.
MAX_READING = 64
MAX_READING_PER_SOURCE = 16

_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: 95\r\n\r\n"
                    b'{"error":{"message":"request not received in time","type":"invalid_request_error",'
                    b'"param":null}}')


class ReadGuard:
    """The connections of one server that are still reading a request: their deadlines and
    the caps that keep strangers from holding the listener. Runs on the event loop only."""

    def __init__(self, read_timeout: float = READ_TIMEOUT_S, max_reading: int = MAX_READING,
                 max_reading_per_source: int = MAX_READING_PER_SOURCE) -> None:
        self.read_timeout = read_timeout
        self.max_reading = max(1, max_reading)
        self.max_per_source = max(1, min(max_reading_per_source, self.max_reading))
        self.reading: OrderedDict[Any, str] = OrderedDict()  # protocol -> source, oldest first
        self.timed_out = 0  # connections dropped at their read deadline
        self.evicted = 0  # connections dropped to make room for a newcomer

    def start(self, proto: _GuardedH11) -> None:
        """``proto`` begins reading a request: make room for it, then start its deadline."""
        source = proto.client[0] if proto.client else "?"
        mine = [p for p, s in self.reading.items() if s == source]
        crowd = mine if len(mine) >= self.max_per_source else (
            list(self.reading) if len(self.reading) >= self.max_reading else [])
        if crowd:
            victim = crowd[0]  # the oldest still reading
            self.evicted += 1
            self.done(victim)
            victim.drop(timed_out=False)
        self.reading[proto] = source
        self.reading.move_to_end(proto)

    def done(self, proto: _GuardedH11) -> None:
        self.reading.pop(proto, None)


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with ``ReadGuard``'s deadline and caps."""

    guard: ReadGuard  # set on the subclass that ``guarded_protocol`` makes

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_timer: Any = None
        self._begin_read()

    def _begin_read(self) -> None:
        self.guard.start(self)
        self._read_timer = self.loop.call_later(self.guard.read_timeout, self._read_deadline)

    def _end_read(self) -> None:
        self.guard.done(self)
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self._between_requests():
            self._begin_read()  # the next request on a kept-alive connection
        super().data_received(data)
        cycle = self.cycle
        if (self._read_timer is not None and cycle is not None and not cycle.more_body
                and not cycle.response_complete):
            self._end_read()  # headers and body are in: the app's time is not counted

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_read()
        super().connection_lost(exc)

    def _read_deadline(self) -> None:
        self._read_timer = None
        self.guard.done(self)
        self.guard.timed_out += 1
        self.drop(timed_out=True)

    def drop(self, timed_out: bool) -> None:
        """Close this connection; a request whose headers never completed gets 408 first."""
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if self.transport.is_closing():
            return
        if timed_out and self._between_requests():
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()


def guarded_protocol(guard: ReadGuard) -> type[H11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``, bound to ``guard``."""
    return type("GuardedH11Protocol", (_GuardedH11,), {"guard": guard})


# ------------------------------------------------------------------------------ host check

_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1", "localhost.localdomain")
_WILDCARDS = ("0.0.0.0", "::", "")


def allowed_hosts(bound: str, extra: Iterable[str] = ()) -> set[str]:
    """The names a request's Host may carry: localhost names, the bound address, and when
    bound to every interface this machine's addresses and names; plus ``extra``."""
    hosts = {h.lower() for h in _LOCAL_NAMES}
    hosts.add(bound.lower().strip("[]"))
    if bound in _WILDCARDS:
        name = socket.gethostname().lower()
        hosts.update({name, name + ".local", socket.getfqdn().lower()})
        try:
            import ifaddr  # installed with zeroconf

            for adapter in ifaddr.get_adapters():
                for ip in adapter.ips:
                    hosts.add(ip.ip.lower() if isinstance(ip.ip, str) else str(ip.ip[0]).lower())
        except Exception:  # interfaces unknown: the names above and --allow-host still work
            pass
    hosts.update(h.lower().strip("[]") for h in extra if h)
    hosts.discard("")
    return hosts


def _host_name(value: bytes) -> str:
    """The name in a Host header, without port and IPv6 brackets."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text[1:]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class HostCheck:
    """ASGI middleware: refuse a request whose Host this server is not bound for (400), a
    JSON endpoint's POST whose body is not JSON (415), and add the page's security headers
    to every answer."""

    #: Only the page's own files and its own server; no framing, no plugins.
    CSP = ("default-src 'self'; script-src 'self' 'sha256-{login}'; style-src 'self' "
           "'unsafe-inline'; img-src 'self' data:; connect-src 'self'; object-src 'none'; "
           "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")

    def __init__(self, app: Any, hosts: set[str] | None, json_paths: Iterable[str],
                 login_script_hash: str) -> None:
        self.app = app
        self.hosts = hosts
        self.json_paths = frozenset(json_paths)
        self.headers = [
            (b"content-security-policy", self.CSP.format(login=login_script_hash).encode()),
            (b"x-frame-options", b"DENY"), (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"no-referrer")]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", []), *self.headers]
            await send(message)

        host = headers.get(b"host")
        if self.hosts is not None and host is not None and _host_name(host) not in self.hosts:
            name = _host_name(host)
            response = _error(400, f"host {name!r} is not served here (a request that names "
                              "another site's host is refused: DNS rebinding); to reach this "
                              f"server under that name, start it with --allow-host {name}",
                              "invalid_request_error", code="host_not_allowed")
            await response(scope, receive, send_with_headers)
            return
        if scope.get("method") == "POST" and scope.get("path") in self.json_paths:
            kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if kind != b"application/json":
                response = _error(415, "the body must be JSON: send 'Content-Type: "
                                  f"application/json' (got {kind.decode('latin-1') or 'none'!r})",
                                  "invalid_request_error", code="unsupported_media_type")
                await response(scope, receive, send_with_headers)
                return
        await self.app(scope, receive, send_with_headers)
