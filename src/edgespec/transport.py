"""Authenticated, framed TCP connections between ring members, and a frame-dispatching server.

Blocking sockets with one thread per connection, not asyncio, on purpose:

- A hop's latency is the product here. A blocking ``recv_into``/``sendmsg`` pair adds only the
  system calls; an event loop adds a selector round and task switches per frame.
- The work a frame triggers is a llama.cpp decode, which releases the GIL (ctypes calls), so a
  reader thread per link overlaps network and compute without an event loop.
- A ring has few links (one inbound, one outbound per stage, plus control), so a thread each is
  cheap.

Minimal copies: a received payload lands once in a ``bytearray`` (``recv_into``), numeric fields
decode as numpy views of it, and ``Connection.forward`` re-sends the same buffer to the next
ring member with a new header and MAC (``sendmsg`` scatter/gather, no concatenation). Only the
MAC must be recomputed per link, because each connection has its own session key.

Error policy of ``FrameServer``: a frame that cannot be parsed (bad magic/version/size) or fails
its MAC/sequence check loses the stream's framing or trust, so the server answers ERROR and
closes that connection; a well-framed frame with a bad payload, an unknown kind or a failing
handler gets an ERROR reply and the connection goes on. Other connections are never affected.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from edgespec import auth
from edgespec.auth import AuthError, FrameMac, SessionKeys
from edgespec.wire import (
    DEFAULT_MAX_PAYLOAD,
    HANDSHAKE_MAX_PAYLOAD,
    HEADER_SIZE,
    MAC_SIZE,
    PROTOCOL_VERSION,
    FieldTag,
    Flag,
    FrameHeader,
    Kind,
    Message,
    WireError,
    decode_header,
    decode_payload,
    encode_frame,
    error_message,
)

log = logging.getLogger("edgespec.transport")

DEFAULT_HANDSHAKE_TIMEOUT = 5.0


class TransportError(ConnectionError):
    """The peer closed the connection, or it broke."""


class RemoteError(Exception):
    """The peer answered a request with an ERROR frame."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _set_nodelay(sock: socket.socket) -> None:
    # Small frames (a token, a commit) must leave at once, not wait for Nagle's coalescing.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransportError("connection closed by peer" if got == 0 else "connection closed mid-frame")
        got += k


def _sendmsg_all(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """``sendall`` for a list of buffers (scatter/gather, no joining)."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


@dataclass
class Frame:
    """An authenticated frame as received: header and the raw payload buffer.

    ``decode()`` parses the payload on demand (and caches it), so a node that only forwards a
    frame never decodes its hidden states.
    """

    header: FrameHeader
    payload: memoryview
    _message: Message | None = field(default=None, repr=False)

    @property
    def kind(self) -> Kind:
        return self.header.kind

    def decode(self) -> Message:
        """The payload as a validated ``Message`` (raises WireError if malformed)."""
        if self._message is None:
            self._message = decode_payload(self.header, self.payload)
        return self._message


class Connection:
    """One authenticated connection. Sends are thread-safe; keep a single reader."""

    def __init__(
        self,
        sock: socket.socket,
        send_mac: FrameMac,
        recv_mac: FrameMac,
        *,
        local_node: str,
        peer_node: str,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self._sock = sock
        self._send_mac = send_mac
        self._recv_mac = recv_mac
        self._send_lock = threading.Lock()
        self._hdr = bytearray(HEADER_SIZE)
        self._closed = False
        self._request_ids = itertools.count(1)
        self.local_node = local_node
        self.peer_node = peer_node
        self.max_payload = max_payload
        try:
            self.peer_address: tuple[str, int] = sock.getpeername()[:2]
        except OSError:
            self.peer_address = ("?", 0)

    def __repr__(self) -> str:
        return f"Connection({self.local_node!r} <-> {self.peer_node!r} at {self.peer_address[0]}:{self.peer_address[1]})"

    @property
    def closed(self) -> bool:
        return self._closed

    def next_request_id(self) -> int:
        """A fresh request id for this connection (1, 2, ...)."""
        return next(self._request_ids) & 0xFFFFFFFF or next(self._request_ids)

    # -- sending -----------------------------------------------------------------------

    def _send_chunks(self, header: FrameHeader, chunks: Iterable[bytes | memoryview]) -> None:
        chunks = list(chunks)
        if header.payload_len > self.max_payload:
            raise WireError(f"payload of {header.payload_len} bytes exceeds the maximum frame size ({self.max_payload})")
        with self._send_lock:
            if self._closed:
                raise TransportError(f"{self!r} is closed")
            hb = header._replace(seq=self._send_mac.next_seq()).pack()
            mac = self._send_mac.sign(hb, chunks)
            try:
                _sendmsg_all(self._sock, [hb, *chunks, mac])
            except OSError as e:
                raise TransportError(f"send to {self.peer_node} failed: {e}") from e

    def send(self, msg: Message) -> None:
        """Encode, authenticate and send a message."""
        header, chunks = encode_frame(msg)
        self._send_chunks(header, chunks)

    def forward(
        self,
        frame: Frame,
        *,
        kind: Kind | None = None,
        request_id: int | None = None,
        lap_id: int | None = None,
        segment_id: int | None = None,
        flags: int | None = None,
    ) -> None:
        """Send a received frame on, unchanged except for the given header fields.

        The payload buffer is reused as it is (no decode, no copy); only the header and the
        MAC are made anew for this connection.
        """
        h = frame.header
        header = FrameHeader(
            h.kind if kind is None else Kind(kind),
            h.flags if flags is None else flags,
            h.request_id if request_id is None else request_id,
            h.lap_id if lap_id is None else lap_id,
            h.segment_id if segment_id is None else segment_id,
            0,
            frame.payload.nbytes,
        )
        if header.kind != h.kind:
            decode_payload(header, frame.payload)  # the payload must fit the new kind's schema
        self._send_chunks(header, (frame.payload,))

    def reply_error(self, code: str, message: str, request_id: int = 0) -> None:
        """Send an ERROR frame, ignoring a connection that is already gone."""
        with contextlib.suppress(TransportError, OSError):
            self.send(error_message(code, message, request_id=request_id))

    # -- receiving ---------------------------------------------------------------------

    def recv_frame(self, timeout: float | None = None) -> Frame:
        """Read one frame and check its MAC and sequence number.

        Raises WireError for an unparseable header, AuthError for a bad MAC or sequence,
        TransportError when the peer is gone, TimeoutError after ``timeout`` seconds.
        """
        self._sock.settimeout(timeout)
        try:
            hv = memoryview(self._hdr)
            _recv_exact_into(self._sock, hv)
            header = decode_header(hv, self.max_payload)
            # Payload and MAC in one read: one system call fewer for small frames.
            buf = bytearray(header.payload_len + MAC_SIZE)
            bv = memoryview(buf)
            _recv_exact_into(self._sock, bv)
        except TimeoutError:
            raise TimeoutError(f"no frame from {self.peer_node} within {timeout} s") from None
        except OSError as e:
            if isinstance(e, TransportError):
                raise
            raise TransportError(f"receive from {self.peer_node} failed: {e}") from e
        payload = bv[: header.payload_len]
        self._recv_mac.verify(header, hv, payload, bv[header.payload_len :])
        return Frame(header, payload)

    def recv(self, timeout: float | None = None) -> Message:
        """Read and decode one message."""
        return self.recv_frame(timeout).decode()

    def request(self, msg: Message, timeout: float | None = 30.0) -> Message:
        """Send ``msg`` (given a fresh request id if it has none) and wait for its answer.

        Only for connections where the caller is the sole reader. Frames with other request
        ids are dropped with a log line. An ERROR answer raises RemoteError.
        """
        if msg.request_id == 0:
            msg.request_id = self.next_request_id()
        msg.flags |= int(Flag.NEEDS_REPLY)
        self.send(msg)
        while True:
            reply = self.recv(timeout)
            if reply.request_id != msg.request_id:
                log.warning("%r: dropping unexpected %s (request %d) while waiting for %d", self, reply.kind.name, reply.request_id, msg.request_id)
                continue
            if reply.kind == Kind.ERROR:
                raise RemoteError(str(reply.meta.get("code", "error")), str(reply.meta.get("message", "")))
            return reply

    def close(self, reason: str | None = None) -> None:
        """Say goodbye (best effort) and close the socket. Idempotent."""
        if self._closed:
            return
        if reason is not None:
            with contextlib.suppress(Exception):
                self.send(Message(Kind.CLOSE, {FieldTag.META: {"reason": reason}}))
        with self._send_lock:
            self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close("done")


# --------------------------------------------------------------------------- handshake


def _send_plain(sock: socket.socket, msg: Message) -> None:
    header, chunks = encode_frame(msg)
    _sendmsg_all(sock, [header.pack(), *chunks])


def _recv_plain(sock: socket.socket, expect: Kind) -> Message:
    hb = bytearray(HEADER_SIZE)
    _recv_exact_into(sock, memoryview(hb))
    header = decode_header(hb, HANDSHAKE_MAX_PAYLOAD)
    payload = bytearray(header.payload_len)
    _recv_exact_into(sock, memoryview(payload))
    msg = decode_payload(header, payload)
    if msg.kind == Kind.ERROR and expect != Kind.ERROR:
        raise AuthError(f"peer refused: {msg.meta.get('message', msg.meta)}")
    if msg.kind != expect:
        raise AuthError(f"handshake expected {expect.name}, got {msg.kind.name}")
    return msg


def _hex_field(meta: dict, name: str, size: int) -> bytes:
    try:
        raw = bytes.fromhex(str(meta[name]))
    except (KeyError, ValueError):
        raise AuthError(f"handshake field {name!r} missing or not hex") from None
    if len(raw) != size:
        raise AuthError(f"handshake field {name!r} must be {size} bytes")
    return raw


def connect(
    host: str,
    port: int,
    key: bytes,
    *,
    node_id: str,
    timeout: float = 10.0,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> Connection:
    """Open an authenticated connection to a ring member (client side of the handshake).

    Raises AuthError if the server refuses us or cannot prove it holds the ring key.
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _set_nodelay(sock)
        nonce_c = auth.new_nonce()
        _send_plain(
            sock,
            Message(Kind.HELLO, {FieldTag.META: {"proto": PROTOCOL_VERSION, "node": node_id, "key_id": auth.key_id(key), "nonce": nonce_c.hex()}}),
        )
        ch = _recv_plain(sock, Kind.CHALLENGE).meta
        nonce_s = _hex_field(ch, "nonce", auth.NONCE_SIZE)
        server_node = str(ch.get("node", ""))
        proof_s = _hex_field(ch, "proof", 32)
        if not auth.verify_proof(key, "server", proof_s, nonce_c, nonce_s, node_id, server_node):
            raise AuthError(f"{host}:{port} ({server_node or '?'}) could not prove it holds our ring key; not joining")
        _send_plain(
            sock,
            Message(Kind.AUTH, {FieldTag.META: {"proof": auth.proof(key, "client", nonce_c, nonce_s, node_id, server_node).hex()}}),
        )
        _recv_plain(sock, Kind.WELCOME)
        sock.settimeout(None)
        send_mac, recv_mac = SessionKeys.derive(key, nonce_c, nonce_s).for_role("client")
        return Connection(sock, send_mac, recv_mac, local_node=node_id, peer_node=server_node, max_payload=max_payload)
    except TimeoutError:
        sock.close()
        raise AuthError(f"handshake with {host}:{port} timed out") from None
    except (WireError, TransportError) as e:
        sock.close()
        raise AuthError(f"handshake with {host}:{port} failed: {e}") from e
    except BaseException:
        sock.close()
        raise


def accept_handshake(
    sock: socket.socket,
    key: bytes,
    *,
    node_id: str,
    timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> Connection:
    """Server side of the handshake on an accepted socket; raises AuthError on refusal
    (after telling the peer why)."""
    sock.settimeout(timeout)
    _set_nodelay(sock)
    try:
        hello = _recv_plain(sock, Kind.HELLO).meta
        client_node = str(hello.get("node", ""))
        if hello.get("proto") != PROTOCOL_VERSION:
            raise AuthError(f"peer speaks protocol {hello.get('proto')!r}, we speak {PROTOCOL_VERSION}")
        nonce_c = _hex_field(hello, "nonce", auth.NONCE_SIZE)
        ours = auth.key_id(key)
        if hello.get("key_id") != ours:
            raise AuthError(f"ring key mismatch: peer key id {hello.get('key_id')!r}, ours {ours!r}")
        nonce_s = auth.new_nonce()
        _send_plain(
            sock,
            Message(
                Kind.CHALLENGE,
                {FieldTag.META: {"node": node_id, "nonce": nonce_s.hex(), "proof": auth.proof(key, "server", nonce_c, nonce_s, client_node, node_id).hex()}},
            ),
        )
        proof_c = _hex_field(_recv_plain(sock, Kind.AUTH).meta, "proof", 32)
        if not auth.verify_proof(key, "client", proof_c, nonce_c, nonce_s, client_node, node_id):
            raise AuthError("bad key proof (peer does not hold the ring key)")
        _send_plain(sock, Message(Kind.WELCOME, {FieldTag.META: {"node": node_id}}))
    except AuthError as e:
        with contextlib.suppress(OSError, WireError):
            _send_plain(sock, error_message("auth", f"refused by {node_id}: {e}"))
        raise
    except TimeoutError:
        raise AuthError(f"handshake timed out after {timeout} s") from None
    except (WireError, TransportError, OSError) as e:
        with contextlib.suppress(OSError, WireError):
            _send_plain(sock, error_message("bad_frame", f"malformed handshake: {e}"))
        raise AuthError(f"malformed handshake: {e}") from e
    sock.settimeout(None)
    send_mac, recv_mac = SessionKeys.derive(key, nonce_c, nonce_s).for_role("server")
    return Connection(sock, send_mac, recv_mac, local_node=node_id, peer_node=client_node, max_payload=max_payload)


# --------------------------------------------------------------------------- server

#: A handler gets the connection and the frame; it may return a message to send back
#: (its request id defaults to the frame's) or None.
Handler = Callable[[Connection, Frame], "Message | None"]


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
        max_connections: int = 64,
        on_disconnect: Callable[[Connection], None] | None = None,
    ) -> None:
        auth._check_key(key)
        self._key = key
        self.node_id = node_id
        self.max_payload = max_payload
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.on_disconnect = on_disconnect
        self._handlers: dict[Kind, Handler] = {}
        for k, h in (handlers or {}).items():
            self.register(k, h)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(16)
        self._lock = threading.Lock()
        self._conns: set[Connection] = set()
        self._threads: set[threading.Thread] = set()
        self._accept_thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.refused = 0  # peers refused at the handshake
        self.errors = 0  # ERROR replies sent for bad frames / failed handlers

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) the server listens on."""
        return self._listener.getsockname()[:2]

    @property
    def connections(self) -> list[Connection]:
        """The live authenticated connections."""
        with self._lock:
            return list(self._conns)

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
        for c in self.connections:
            c.close("server shutting down")
        threads = [self._accept_thread] if self._accept_thread else []
        with self._lock:
            threads += list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout)

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError:
                break  # listener closed
            with self._lock:
                busy = len(self._threads) >= self.max_connections
            if busy:
                log.warning("%s: refusing %s:%d: %d connections already open", self.node_id, addr[0], addr[1], self.max_connections)
                sock.close()
                continue
            t = threading.Thread(target=self._serve_socket, args=(sock, addr), name=f"edgespec-conn-{addr[0]}:{addr[1]}", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _serve_socket(self, sock: socket.socket, addr: tuple) -> None:
        try:
            try:
                conn = accept_handshake(sock, self._key, node_id=self.node_id, timeout=self.handshake_timeout, max_payload=self.max_payload)
            except AuthError as e:
                log.warning("%s: refused peer %s:%d: %s", self.node_id, addr[0], addr[1], e)
                self.refused += 1
                sock.close()
                return
            log.info("%s: authenticated peer %s at %s:%d", self.node_id, conn.peer_node, addr[0], addr[1])
            with self._lock:
                self._conns.add(conn)
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


def _safe_meta(frame: Frame) -> object:
    try:
        return frame.decode().meta
    except WireError as e:
        return f"<undecodable: {e}>"
