"""Authenticated, sealed, framed TCP connections between ring members, and a frame server.

Blocking sockets with one thread per connection, not asyncio, on purpose:

- A hop's latency is the product here. A blocking ``recv_into``/``sendmsg`` pair adds only the
  system calls; an event loop adds a selector round and task switches per frame.
- The work a frame triggers is a llama.cpp decode, which releases the GIL (ctypes calls), so a
  reader thread per link overlaps network and compute without an event loop.
- A ring has few links (one inbound, one outbound per stage, plus control), so a thread each is
  cheap.

Copies: a received frame lands once in a ``bytearray`` (``recv_into``) and is decrypted once
into the payload buffer; numeric fields decode as numpy views of it. ``Connection.forward``
re-seals that buffer for the next ring member without decoding it (each link has its own
session keys). Sends go out with ``sendmsg`` scatter/gather: header and ciphertext, or, with
sealing off, header and the payload chunks as they are.

Listener limits (``FrameServer``): the whole server side of a handshake has one deadline;
connections that have not yet proved the ring key have their own small cap, in total and per
source address, apart from the cap on members, so unauthenticated sockets can never crowd a
member out: when the cap is reached, the oldest connection that has not even shown a valid key
tag is dropped for the newcomer. Accepting survives transient errors (out of file descriptors,
memory, buffers) with a logged back-off and ends only when the server closes.

Error policy of ``FrameServer``: a frame that cannot be parsed (bad magic/version/size) or fails
to open (tag/sequence check) loses the stream's framing or trust, so the server answers ERROR
and closes that connection; a well-framed frame with a bad payload, an unknown kind or a
failing handler gets an ERROR reply and the connection goes on. Other connections are never
affected.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from edgespec import auth
from edgespec.auth import AuthError, ClearFrames, FrameSeal, SessionKeys
from edgespec.wire import (
    DEFAULT_MAX_PAYLOAD,
    HANDSHAKE_MAX_PAYLOAD,
    HEADER_SIZE,
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

#: Seconds a peer has to complete the whole handshake, server side (one deadline, not per read).
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
#: Connections still in their handshake: at most this many in total and per source address.
DEFAULT_MAX_PENDING = 16
DEFAULT_MAX_PENDING_PER_SOURCE = 4
#: Authenticated connections a server keeps at once.
DEFAULT_MAX_CONNECTIONS = 64
_MAX_NODE_ID = 256
_ACCEPT_BACKOFF_MAX = 1.0


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


def _until(deadline: float | None, sock: socket.socket) -> None:
    """Let the next socket call wait at most until ``deadline`` (a ``time.monotonic`` value)."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)


def _wait_readable(sock: socket.socket, deadline: float) -> None:
    """Block until ``sock`` has data (or EOF) or ``deadline`` passes (TimeoutError).

    Polling, not ``settimeout``: a socket timeout would also apply to another thread's
    concurrent ``sendmsg`` on the same connection, and fail it for no reason.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    p = select.poll()
    p.register(sock, select.POLLIN)
    if not p.poll(left * 1000):
        raise TimeoutError("deadline passed")


def _recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    got = 0
    n = view.nbytes
    while got < n:
        if deadline is not None:
            _wait_readable(sock, deadline)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransportError("connection closed by peer" if got == 0 else "connection closed mid-frame")
        got += k


def _sendmsg_all(sock: socket.socket, buffers: Sequence[bytes | memoryview], deadline: float | None = None) -> None:
    """``sendall`` for a list of buffers (scatter/gather, no joining)."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    while views:
        _until(deadline, sock)
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
    """An authenticated frame as received: header and the decrypted payload buffer.

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
        send_seal: FrameSeal | ClearFrames,
        recv_seal: FrameSeal | ClearFrames,
        *,
        local_node: str,
        peer_node: str,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self._sock = sock
        self._send_seal = send_seal
        self._recv_seal = recv_seal
        self.sealed = isinstance(send_seal, FrameSeal)
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
            buffers = self._send_seal.seal(header, chunks)
            try:
                _sendmsg_all(self._sock, buffers)
            except OSError as e:
                raise TransportError(f"send to {self.peer_node} failed: {e}") from e

    def send(self, msg: Message) -> None:
        """Encode, seal and send a message."""
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

        The payload is not decoded; it is sealed anew under this connection's key (each link
        has its own session keys), or, unsealed, sent from the same buffer without a copy.
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
        """Read one frame, check its sequence number and tag, and decrypt it.

        Raises WireError for an unparseable header, AuthError for a frame that fails to open
        (forged, altered, replayed, reordered), TransportError when the peer is gone,
        TimeoutError after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            hv = memoryview(self._hdr)
            _recv_exact_into(self._sock, hv, deadline)
            header = decode_header(hv, self.max_payload)
            # Payload and tag in one read: one system call fewer for small frames.
            body = bytearray(header.payload_len + self._recv_seal.overhead)
            _recv_exact_into(self._sock, memoryview(body), deadline)
        except TimeoutError:
            raise TimeoutError(f"no frame from {self.peer_node} within {timeout} s") from None
        except OSError as e:
            if isinstance(e, TransportError):
                raise
            raise TransportError(f"receive from {self.peer_node} failed: {e}") from e
        return Frame(header, self._recv_seal.open(header, hv, body))

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


def _send_plain(sock: socket.socket, msg: Message, deadline: float | None = None) -> None:
    header, chunks = encode_frame(msg)
    _sendmsg_all(sock, [header.pack(), *chunks], deadline)


def _send_sealed(sock: socket.socket, seal: FrameSeal | ClearFrames, msg: Message, deadline: float) -> None:
    header, chunks = encode_frame(msg)
    _sendmsg_all(sock, seal.seal(header, chunks), deadline)


def _flat_meta(msg: Message) -> dict:
    """A handshake body: a JSON object of plain values only."""
    meta = msg.meta
    for k, v in meta.items():
        if isinstance(v, (dict, list)):
            raise WireError(f"handshake field {_clip(k, 40)!r} must be a plain value")
    return meta


def _clip(value: object, limit: int = 200) -> str:
    """Peer-supplied text for one log line: printable characters only, bounded length."""
    text = "".join(c if c.isprintable() else "?" for c in str(value)[: limit + 1])
    return text if len(text) <= limit else text[:limit] + "..."


def _refusal(header: FrameHeader, payload: bytes | bytearray | memoryview) -> str:
    """The reason in a plain ERROR frame received during the handshake."""
    return _clip(decode_payload(header, payload).meta.get("message", "no reason given"), 300)


def _recv_plain(sock: socket.socket, expect: Kind, deadline: float) -> dict:
    """A handshake frame sent before the key proofs: size-capped, flat JSON body."""
    hb = bytearray(HEADER_SIZE)
    _recv_exact_into(sock, memoryview(hb), deadline)
    header = decode_header(hb, HANDSHAKE_MAX_PAYLOAD)
    payload = bytearray(header.payload_len)
    _recv_exact_into(sock, memoryview(payload), deadline)
    if header.kind == Kind.ERROR:
        raise AuthError(f"refused: {_refusal(header, payload)}")
    if header.kind != expect:
        raise AuthError(f"handshake expected {expect.name}, got {header.kind.name}")
    return _flat_meta(decode_payload(header, payload))


def _recv_sealed(sock: socket.socket, seal: FrameSeal | ClearFrames, expect: Kind, deadline: float, forged: str) -> dict:
    """The first sealed frame of one direction (AUTH or WELCOME); a refusal comes plain.

    A frame that fails to open raises AuthError(``forged``).
    """
    hb = bytearray(HEADER_SIZE)
    hv = memoryview(hb)
    _recv_exact_into(sock, hv, deadline)
    header = decode_header(hb, HANDSHAKE_MAX_PAYLOAD)
    if header.kind == Kind.ERROR:
        payload = bytearray(header.payload_len)
        _recv_exact_into(sock, memoryview(payload), deadline)
        raise AuthError(f"refused: {_refusal(header, payload)}")
    body = bytearray(header.payload_len + seal.overhead)
    _recv_exact_into(sock, memoryview(body), deadline)
    try:
        payload = seal.open(header, hv, body)
    except AuthError:
        raise AuthError(forged) from None
    if header.kind != expect:
        raise AuthError(f"handshake expected {expect.name}, got {header.kind.name}")
    return _flat_meta(decode_payload(header, payload))


def _hex_field(meta: dict, name: str, size: int) -> bytes:
    try:
        raw = bytes.fromhex(str(meta[name]))
    except (KeyError, ValueError):
        raise AuthError(f"handshake field {name!r} missing or not hex") from None
    if len(raw) != size:
        raise AuthError(f"handshake field {name!r} must be {size} bytes")
    return raw


def _node_field(meta: dict) -> str:
    node = meta.get("node")
    if not isinstance(node, str) or not node or len(node) > _MAX_NODE_ID:
        raise AuthError(f"handshake field 'node' must be a string of 1..{_MAX_NODE_ID} characters")
    return node


def _sealing_word(on: bool) -> str:
    return "on" if on else f"off ({auth.INSECURE_ENV})"


def connect(
    host: str,
    port: int,
    key: bytes,
    *,
    node_id: str,
    timeout: float = 10.0,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    seal: bool | None = None,
) -> Connection:
    """Open an authenticated, sealed connection to a ring member (client side).

    ``timeout`` is one deadline for the TCP connect and the whole handshake together: a peer
    that answers slowly, byte by byte, still fails in time. Raises AuthError (naming
    ``host:port``) if the server refuses us, cannot prove it holds the ring key, or does not
    finish the handshake in time; OSError if it cannot be reached. ``seal`` defaults to on
    unless ``$EDGESPEC_INSECURE_PLAINTEXT`` is set; both ends must agree.
    """
    auth._check_key(key)
    sealed = auth.sealing_enabled() if seal is None else seal
    where = f"{host}:{port}"
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise TimeoutError(f"connecting to {where} timed out after {timeout:g} s") from None
    try:
        _set_nodelay(sock)
        nonce_c = auth.new_nonce()
        hello = {"proto": PROTOCOL_VERSION, "nonce": nonce_c.hex(), "tag": auth.hello_tag(key, nonce_c).hex(), "sealed": sealed}
        _send_plain(sock, Message(Kind.HELLO, {FieldTag.META: hello}), deadline)
        ch = _recv_plain(sock, Kind.CHALLENGE, deadline)
        nonce_s = _hex_field(ch, "nonce", auth.NONCE_SIZE)
        if not auth.verify_proof(key, "server", _hex_field(ch, "proof", 32), nonce_c, nonce_s, sealed):
            raise AuthError("could not prove it holds our ring key; not joining")
        send, recv = SessionKeys.derive(key, nonce_c, nonce_s, sealed).for_role("client")
        proof_c = auth.proof(key, "client", nonce_c, nonce_s, sealed).hex()
        _send_sealed(sock, send, Message(Kind.AUTH, {FieldTag.META: {"proof": proof_c, "node": node_id}}), deadline)
        welcome = _recv_sealed(sock, recv, Kind.WELCOME, deadline, "its WELCOME failed to open (not sealed under our ring key)")
        server_node = _node_field(welcome)
        sock.settimeout(None)
        return Connection(sock, send, recv, local_node=node_id, peer_node=server_node, max_payload=max_payload)
    except TimeoutError:
        sock.close()
        raise AuthError(f"{where}: handshake timed out after {timeout:g} s") from None
    except AuthError as e:
        sock.close()
        raise AuthError(f"{where}: {e}") from None
    except (WireError, TransportError, OSError) as e:
        sock.close()
        raise AuthError(f"{where}: handshake failed: {e}") from e
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
    seal: bool | None = None,
    on_keyed: Callable[[], None] | None = None,
) -> Connection:
    """Server side of the handshake on an accepted socket, all within ``timeout`` seconds.

    Raises AuthError on refusal, after telling the peer why in words that name nothing about
    this node. ``on_keyed`` is called once the client's HELLO shows it holds our key.
    """
    sealed = auth.sealing_enabled() if seal is None else seal
    deadline = time.monotonic() + timeout
    _set_nodelay(sock)
    try:
        hello = _recv_plain(sock, Kind.HELLO, deadline)
        if hello.get("proto") != PROTOCOL_VERSION:
            raise AuthError(f"peer speaks protocol {_clip(hello.get('proto'), 20)}, this node {PROTOCOL_VERSION}")
        nonce_c = _hex_field(hello, "nonce", auth.NONCE_SIZE)
        if not auth.verify_hello_tag(key, _hex_field(hello, "tag", auth.HELLO_TAG_SIZE), nonce_c):
            raise AuthError("ring key mismatch (the two ends hold different ring keys)")
        if on_keyed is not None:
            on_keyed()
        theirs = hello.get("sealed")
        if theirs is not sealed:
            raise AuthError(f"sealing mismatch: peer {_sealing_word(bool(theirs))}, this node {_sealing_word(sealed)}; set it alike on every member")
        nonce_s = auth.new_nonce()
        challenge = {"nonce": nonce_s.hex(), "proof": auth.proof(key, "server", nonce_c, nonce_s, sealed).hex()}
        _send_plain(sock, Message(Kind.CHALLENGE, {FieldTag.META: challenge}), deadline)
        send, recv = SessionKeys.derive(key, nonce_c, nonce_s, sealed).for_role("server")
        bad_proof = "bad key proof (peer does not hold the ring key)"
        auth_meta = _recv_sealed(sock, recv, Kind.AUTH, deadline, bad_proof)
        if not auth.verify_proof(key, "client", _hex_field(auth_meta, "proof", 32), nonce_c, nonce_s, sealed):
            raise AuthError(bad_proof)
        client_node = _node_field(auth_meta)
        _send_sealed(sock, send, Message(Kind.WELCOME, {FieldTag.META: {"node": node_id}}), deadline)
    except AuthError as e:
        with contextlib.suppress(OSError, WireError, TimeoutError):
            _send_plain(sock, error_message("auth", str(e)), time.monotonic() + 0.5)
        raise
    except TimeoutError:
        raise AuthError(f"handshake timed out after {timeout:g} s") from None
    except (WireError, TransportError, OSError) as e:
        with contextlib.suppress(OSError, WireError, TimeoutError):
            _send_plain(sock, error_message("bad_frame", f"malformed handshake: {e}"), time.monotonic() + 0.5)
        raise AuthError(f"malformed handshake: {e}") from e
    sock.settimeout(None)
    return Connection(sock, send, recv, local_node=node_id, peer_node=client_node, max_payload=max_payload)


# --------------------------------------------------------------------------- server

#: A handler gets the connection and the frame; it may return a message to send back
#: (its request id defaults to the frame's) or None.
Handler = Callable[[Connection, Frame], "Message | None"]


class _Pending:
    """A connection in its handshake: where from, since when, whether its HELLO showed our key."""

    __slots__ = ("sock", "source", "since", "keyed", "evicted")

    def __init__(self, sock: socket.socket, source: str) -> None:
        self.sock = sock
        self.source = source
        self.since = time.monotonic()
        self.keyed = False
        self.evicted = False


class _Throttled:
    """At most one log line per ``interval`` seconds per topic, with a count of those held back."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, topic: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
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
                # key tag; if every one has, the newcomer waits its turn (it is refused).
                idle = [p for p in crowd if not p.keyed]
                victim = min(idle, key=lambda p: p.since) if idle else None
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

    def _keyed(self, entry: _Pending) -> None:
        with self._lock:
            entry.keyed = True

    def _serve_socket(self, entry: _Pending, addr: tuple) -> None:
        sock = entry.sock
        try:
            try:
                conn = accept_handshake(sock, self._key, node_id=self.node_id, timeout=self.handshake_timeout, max_payload=self.max_payload, seal=self.sealed, on_keyed=lambda: self._keyed(entry))
            except Exception as e:  # AuthError, or anything unforeseen: one line, no traceback
                with self._lock:
                    self._pending.discard(entry)
                    if not entry.evicted:
                        self.refused += 1
                if entry.evicted:
                    log.debug("%s: dropped unfinished handshake of %s:%d", self.node_id, addr[0], addr[1])
                else:
                    why = str(e) if isinstance(e, AuthError) else f"{type(e).__name__}: {e}"
                    log.warning("%s: refused peer %s:%d: %s", self.node_id, addr[0], addr[1], why)
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


def _safe_meta(frame: Frame) -> object:
    try:
        return frame.decode().meta
    except WireError as e:
        return f"<undecodable: {e}>"
