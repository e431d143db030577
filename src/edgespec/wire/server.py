"""The ring's frame server: accepts authenticated connections and dispatches frames by kind
(docs/design.md 5.1).

Listener limits (``FrameServer``): the whole server side of a handshake has one deadline;
connections that have not yet proved the ring key have their own small cap, in total and per
source address, apart from the cap on members, so unauthenticated sockets can never crowd a
member out: when the cap is reached, the oldest connection that has not even shown a valid key
tag is dropped for the newcomer, else the oldest whose tag checked more than ``KEYED_GRACE_S``
ago and that still has not finished. HELLO's tag crosses the LAN in the clear, so a stranger
can capture one and replay it: the listener remembers the nonces of the last
``SEEN_NONCES`` HELLOs whose tag checked and refuses one it saw before at once, and a captured
HELLO it has not seen (one a fake listener collected) holds a place for at most the grace.
Accepting survives transient errors (out of file descriptors, memory, buffers) with a logged
back-off and ends only when the server closes. Refusals a stranger can cause at will are
logged at most once per 10 s per kind, with a count of those held back.

Error policy of ``FrameServer``: a frame that cannot be parsed (bad magic/version/size) or fails
to open (tag/sequence check) loses the stream's framing or trust, so the server answers ERROR
and closes that connection; a well-framed frame with a bad payload, an unknown kind or a
failing handler gets an ERROR reply and the connection goes on. Other connections are never
affected.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from edgespec.wire import auth
from edgespec.wire.auth import AuthError
from edgespec.wire.codec import Message
from edgespec.wire.header import DEFAULT_MAX_PAYLOAD, Kind, WireError
from edgespec.wire.transport import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PENDING,
    DEFAULT_MAX_PENDING_PER_SOURCE,
    Connection,
    Frame,
    RemoteError,
    TransportError,
    accept_handshake,
)

# The same logger as the client side: one name for the transport in logs.
log = logging.getLogger("edgespec.transport")

_ACCEPT_BACKOFF_MAX = 1.0
#: A genuine client answers CHALLENGE within one round trip of its HELLO (milliseconds on a
#: LAN, well under a second on a loaded Wi-Fi link); a handshake still unfinished this long
#: after its tag checked gives its place to a newcomer when the pending caps are reached.
KEYED_GRACE_S = 1.0
#: HELLO nonces remembered to refuse replays: far more than handshakes a real ring makes in a
#: handshake deadline, and only HELLOs whose tag checked go in, so strangers cannot flush it.
SEEN_NONCES = 4096


#: A handler gets the connection and the frame; it may return a message to send back
#: (its request id defaults to the frame's) or None.
Handler = Callable[[Connection, Frame], "Message | None"]


class _Pending:
    """A connection in its handshake: where from, since when, whether its HELLO showed our key."""

    __slots__ = ("sock", "source", "since", "keyed", "keyed_at", "evicted")

    def __init__(self, sock: socket.socket, source: str) -> None:
        self.sock = sock
        self.source = source
        self.since = time.monotonic()
        self.keyed = False
        self.keyed_at = 0.0
        self.evicted = False

    def evictable(self, now: float) -> bool:
        """Not even keyed, or keyed and stalled past the grace a real client needs."""
        return not self.keyed or now - self.keyed_at > KEYED_GRACE_S


class _Throttled:
    """At most one log line per ``interval`` seconds per topic, with a count of those held back.

    Topics beyond ``max_topics`` share one, so the table stays small whatever the topics are.
    """

    def __init__(self, interval: float = 10.0, max_topics: int = 64) -> None:
        self.interval = interval
        self.max_topics = max_topics
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, topic: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if topic not in self._last and len(self._last) >= self.max_topics:
                topic = "(other)"
            if now - self._last.get(topic, -1e9) < self.interval:
                self._held[topic] = self._held.get(topic, 0) + 1
                return
            self._last[topic] = now
            held = self._held.pop(topic, 0)
        log.warning(msg + (f" ({held} more like this since the last report)" if held else ""), *args)


class FrameServer:
    """Accepts authenticated connections and dispatches their frames to handlers by kind.

    >>> srv = FrameServer(key, node_id="n1", host="127.0.0.1")   # doctest: +SKIP
    >>> srv.register(Kind.HIDDEN, lambda conn, frame: next_hop.forward(frame))
    >>> srv.start(); host, port = srv.address
    """

    def __init__(
        self,
        key: bytes,
        *,
        node_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        handlers: dict[Kind, Handler] | None = None,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_pending_per_source: int = DEFAULT_MAX_PENDING_PER_SOURCE,
        seal: bool | None = None,
        on_disconnect: Callable[[Connection], None] | None = None,
    ) -> None:
        auth._check_key(key)
        self._key = key
        self.node_id = node_id
        self.max_payload = max_payload
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.max_pending = max(1, max_pending)
        self.max_pending_per_source = max(1, min(max_pending_per_source, self.max_pending))
        self.sealed = auth.sealing_enabled() if seal is None else seal
        self.on_disconnect = on_disconnect
        self._handlers: dict[Kind, Handler] = {}
        for k, h in (handlers or {}).items():
            self.register(k, h)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self._lock = threading.Lock()
        self._conns: set[Connection] = set()
        self._pending: set[_Pending] = set()
        self._threads: set[threading.Thread] = set()
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._throttled = _Throttled()
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # recent HELLO nonces, oldest first
        self.refused = 0  # peers refused at the handshake
        self.evicted = 0  # handshakes dropped to make room under the pending caps
        self.errors = 0  # ERROR replies sent for bad frames / failed handlers
        self.accept_errors = 0  # failed accept() calls (out of descriptors, memory, ...)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on."""
        return self._listener.getsockname()[:2]

    @property
    def connections(self) -> list[Connection]:
        """The live authenticated connections."""
        with self._lock:
            return list(self._conns)

    @property
    def pending(self) -> int:
        """Connections still in their handshake."""
        with self._lock:
            return len(self._pending)

    def register(self, kind: Kind, handler: Handler) -> None:
        """Handle frames of ``kind`` with ``handler`` (replacing any previous one)."""
        kind = Kind(kind)
        if kind in (Kind.HELLO, Kind.CHALLENGE, Kind.AUTH, Kind.WELCOME, Kind.CLOSE):
            raise ValueError(f"{kind.name} frames are handled by the transport itself")
        self._handlers[kind] = handler

    def start(self) -> FrameServer:
        """Start accepting in a background thread."""
        if self._accept_thread is None:
            self._accept_thread = threading.Thread(target=self._accept_loop, name=f"edgespec-accept-{self.node_id}", daemon=True)
            self._accept_thread.start()
        return self

    def __enter__(self) -> FrameServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection and wait for the threads."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            pending = list(self._pending)
        for p in pending:
            with contextlib.suppress(OSError):
                p.sock.shutdown(socket.SHUT_RDWR)
        for c in self.connections:
            c.close("server shutting down")
        threads = [self._accept_thread] if self._accept_thread else []
        with self._lock:
            threads += list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout)

    # -- accepting ---------------------------------------------------------------------

    def _accept_loop(self) -> None:
        backoff = 0.0
        while not self._stopping.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._stopping.is_set():
                    break  # the listener was closed
                # EMFILE/ENFILE (out of descriptors), ENOBUFS/ENOMEM, ECONNABORTED...: the
                # condition passes once connections close; back off instead of spinning.
                self.accept_errors += 1
                backoff = min(max(2 * backoff, 0.01), _ACCEPT_BACKOFF_MAX)
                self._throttled.warning("accept", "%s: accept failed: %s; retrying (back-off %.2f s)", self.node_id, e, backoff)
                self._stopping.wait(backoff)
                continue
            backoff = 0.0
            try:
                self._admit(sock, addr)
            except Exception as e:  # e.g. no thread could be started: drop this one, keep going
                self._throttled.warning("admit", "%s: could not take connection from %s: %s", self.node_id, addr[0], e)
                sock.close()

    def _admit(self, sock: socket.socket, addr: tuple) -> None:
        """Start the handshake of a new connection within the pending caps."""
        source = addr[0]
        with self._lock:
            mine = [p for p in self._pending if p.source == source]
            crowd = mine if len(mine) >= self.max_pending_per_source else list(self._pending) if len(self._pending) >= self.max_pending else []
            if crowd:
                # Make room by dropping the oldest connection that has not even shown a valid
                # key tag, else the oldest keyed one stalled past the grace; if every one is
                # a keyed handshake under way, the newcomer waits its turn (it is refused).
                now = time.monotonic()
                pool = [p for p in crowd if p.evictable(now)]
                victim = min(pool, key=lambda p: (p.keyed, p.since)) if pool else None
                if victim is None:
                    self.refused += 1
                    sock.close()
                    self._throttled.warning("pending", "%s: refusing %s: %d handshakes already under way", self.node_id, source, len(crowd))
                    return
                victim.evicted = True
                self._pending.discard(victim)  # its slot is free now, whenever its thread ends
                self.evicted += 1
                with contextlib.suppress(OSError):
                    victim.sock.shutdown(socket.SHUT_RDWR)
                self._throttled.warning("evict", "%s: dropped an unfinished handshake from %s to make room (cap %d per source, %d in total)", self.node_id, victim.source, self.max_pending_per_source, self.max_pending)
            entry = _Pending(sock, source)
            self._pending.add(entry)
            t = threading.Thread(target=self._serve_socket, args=(entry, addr), name=f"edgespec-conn-{addr[0]}:{addr[1]}", daemon=True)
            self._threads.add(t)
        try:
            t.start()
        except BaseException:
            with self._lock:
                self._pending.discard(entry)
                self._threads.discard(t)
            raise

    def _keyed(self, entry: _Pending, nonce: bytes) -> None:
        """A HELLO's tag checked: refuse a nonce seen before (a replayed HELLO), else
        remember it and mark the handshake keyed."""
        with self._lock:
            if nonce in self._seen:
                self._seen.move_to_end(nonce)
                raise AuthError("replayed handshake (this HELLO was seen before)")
            self._seen[nonce] = None
            if len(self._seen) > SEEN_NONCES:
                self._seen.popitem(last=False)
            entry.keyed = True
            entry.keyed_at = time.monotonic()

    def _serve_socket(self, entry: _Pending, addr: tuple) -> None:
        sock = entry.sock
        try:
            try:
                conn = accept_handshake(sock, self._key, node_id=self.node_id, timeout=self.handshake_timeout, max_payload=self.max_payload, seal=self.sealed, on_keyed=lambda nonce: self._keyed(entry, nonce))
            except Exception as e:  # AuthError, or anything unforeseen: one line, no traceback
                with self._lock:
                    self._pending.discard(entry)
                    if not entry.evicted:
                        self.refused += 1
                if entry.evicted:
                    log.debug("%s: dropped unfinished handshake of %s:%d", self.node_id, addr[0], addr[1])
                else:
                    why = str(e) if isinstance(e, AuthError) else f"{type(e).__name__}: {e}"
                    # Throttled per kind of refusal: a stranger can cause these at will.
                    self._throttled.warning(_refusal_topic(e), "%s: refused peer %s:%d: %s",
                                            self.node_id, addr[0], addr[1], why)
                sock.close()
                return
            with self._lock:
                self._pending.discard(entry)
                full = entry.evicted or len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                if not entry.evicted:
                    log.warning("%s: refusing %s at %s:%d: %d connections already open", self.node_id, conn.peer_node, addr[0], addr[1], self.max_connections)
                    conn.reply_error("busy", f"the node already serves {self.max_connections} connections")
                conn.close()
                return
            log.info("%s: authenticated peer %s at %s:%d", self.node_id, conn.peer_node, addr[0], addr[1])
            try:
                self._serve(conn)
            finally:
                with self._lock:
                    self._conns.discard(conn)
                conn.close()
                if self.on_disconnect is not None:
                    with contextlib.suppress(Exception):
                        self.on_disconnect(conn)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _serve(self, conn: Connection) -> None:
        while not self._stopping.is_set():
            try:
                frame = conn.recv_frame()
            except TransportError as e:
                if not self._stopping.is_set() and not conn.closed:
                    log.info("%s: %s left: %s", self.node_id, conn.peer_node, e)
                return
            except WireError as e:
                # Framing is lost: say why, then drop this connection only.
                self.errors += 1
                log.warning("%s: malformed frame from %s %s: %s; closing that connection", self.node_id, conn.peer_node, conn.peer_address, e)
                conn.reply_error("bad_frame", str(e))
                return
            except AuthError as e:
                self.errors += 1
                log.warning("%s: rejected frame from %s %s: %s; closing that connection", self.node_id, conn.peer_node, conn.peer_address, e)
                conn.reply_error("auth", str(e))
                return
            except OSError:
                return
            kind = frame.kind
            if kind == Kind.CLOSE:
                return
            rid = frame.header.request_id
            handler = self._handlers.get(kind)
            if handler is None:
                if kind == Kind.ERROR:
                    log.warning("%s: error from %s: %s", self.node_id, conn.peer_node, _safe_meta(frame))
                    continue
                self.errors += 1
                conn.reply_error("unsupported", f"{self.node_id} does not handle {kind.name} frames", rid)
                continue
            try:
                reply = handler(conn, frame)
            except WireError as e:
                self.errors += 1
                log.warning("%s: bad %s payload from %s: %s", self.node_id, kind.name, conn.peer_node, e)
                conn.reply_error("bad_payload", str(e), rid)
                continue
            except (TransportError, RemoteError) as e:
                self.errors += 1
                log.warning("%s: %s handler could not pass the frame on: %s", self.node_id, kind.name, e)
                conn.reply_error("unavailable", str(e), rid)
                continue
            except Exception as e:
                self.errors += 1
                log.exception("%s: %s handler failed", self.node_id, kind.name)
                conn.reply_error("handler_failed", f"{type(e).__name__}: {e}", rid)
                continue
            if reply is not None:
                if reply.request_id == 0:
                    reply.request_id = rid
                try:
                    conn.send(reply)
                except (TransportError, WireError) as e:
                    log.warning("%s: reply to %s failed: %s", self.node_id, conn.peer_node, e)
                    if isinstance(e, TransportError):
                        return


def _refusal_topic(e: BaseException) -> str:
    """The kind of a refused handshake, for the log throttle: the first words of the reason
    before any ':' or '(' (``ring key mismatch``, ``malformed handshake``, ``peer speaks
    protocol``...), letters only, so text the peer chose (a protocol value, a frame's bad
    magic) never makes a topic of its own; the exception type for anything unforeseen."""
    if not isinstance(e, AuthError):
        return f"refused:{type(e).__name__}"
    head = re.split(r"[:(]", str(e), maxsplit=1)[0]
    return "refused:" + " ".join(re.findall(r"[A-Za-z]+", head)[:3])


def _safe_meta(frame: Frame) -> object:
    try:
        return frame.decode().meta
    except WireError as e:
        return f"<undecodable: {e}>"
