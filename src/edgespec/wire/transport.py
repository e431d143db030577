"""Authenticated, sealed, framed TCP connections between ring members: the handshake and
``Connection`` (docs/design.md 5.1).

Over 450 lines: the handshake and ``Connection`` share the deadline, framing and sealing
helpers (``_recv_exact_into``, ``_sendmsg_all``, ``_send_sealed``...) that make a link safe.

Blocking sockets with one thread per connection, not asyncio, on purpose:

- A hop's latency is the product here. A blocking ``recv_into``/``sendmsg`` pair adds only the
  system calls; an event loop adds a selector round and task switches per frame.
- The work a frame triggers is a llama.cpp decode, which releases the GIL (ctypes calls), so a
  reader thread per link overlaps network and compute without an event loop.
- A ring has few links (one inbound, one outbound per stage, plus control), so a thread each is
  cheap.

Copies: one ``recv_into`` reads whatever has arrived into the connection's receive buffer (a
small frame's header and body together: one system call per frame), and a sealed frame is
decrypted from there once into its payload buffer; numeric fields decode as numpy views of it. ``Connection.forward``
re-seals that buffer for the next ring member without decoding it (each link has its own
session keys). Sends go out with ``sendmsg`` scatter/gather: header and ciphertext, or, with
sealing off, header and the payload chunks as they are.

The listener side (``FrameServer``: its limits and error policy) is ``edgespec.wire.server``'s.

(About 520 lines, over the usual 450: a connection and the handshake that creates it share
the socket helpers and the session keys, and read best together.)
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

from edgespec.wire import auth
from edgespec.wire.auth import AuthError, ClearFrames, FrameSeal, SessionKeys
from edgespec.wire.codec import FieldTag, Message, decode_payload, encode_frame
from edgespec.wire.header import (
    DEFAULT_MAX_PAYLOAD,
    HANDSHAKE_MAX_PAYLOAD,
    HEADER_SIZE,
    PROTOCOL_VERSION,
    Flag,
    FrameHeader,
    Kind,
    WireError,
    decode_header,
)
from edgespec.wire.messages import error_message

log = logging.getLogger("edgespec.transport")

#: Seconds a peer has to complete the whole handshake, server side (one deadline, not per read).
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
#: Connections still in their handshake: at most this many in total and per source address.
DEFAULT_MAX_PENDING = 16
DEFAULT_MAX_PENDING_PER_SOURCE = 4
#: Authenticated connections a server keeps at once.
DEFAULT_MAX_CONNECTIONS = 64
_MAX_NODE_ID = 256
#: Seconds ``close`` gives its goodbye frame (the send lock, room in the socket buffer);
#: past it the connection closes without one.
GOODBYE_WAIT_S = 0.5
#: Bytes one receive call may take: a decode lap's frame (a few KiB) in one read.
_RECV_BUFFER = 1 << 16


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
        # Receive buffer: [_rpos, _rend) holds bytes read but not yet taken by a frame.
        self._rbuf = bytearray(_RECV_BUFFER)
        self._rview = memoryview(self._rbuf)
        self._rpos = self._rend = 0
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

    def send_payload(self, kind: Kind, payload: bytes, *, lap_id: int = 0, segment_id: int = 0,
                     request_id: int = 0, flags: int = 0) -> None:
        """Seal and send a payload already encoded (``edgespec.wire.frames.send_batch``)."""
        self._send_chunks(FrameHeader(kind, flags, request_id, lap_id, segment_id, 0,
                                      len(payload)), (payload,))

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
            self._fill(HEADER_SIZE, deadline)
            start = self._rpos
            hv = memoryview(self._hdr)
            hv[:] = self._rview[start:start + HEADER_SIZE]
            header = decode_header(hv, self.max_payload)
            self._rpos = start = start + HEADER_SIZE
            size = header.payload_len + self._recv_seal.overhead
            have = self._rend - start
            if size <= have and self.sealed:
                # The common case: the whole frame came with the header's read. Decryption
                # reads the ciphertext where it lies and writes the payload's own buffer.
                body: bytearray | memoryview = self._rview[start:start + size]
                self._rpos = start + size
                return Frame(header, self._recv_seal.open(header, hv, body))
            body = bytearray(size)
            take = min(have, size)
            body[:take] = self._rview[start:start + take]
            self._rpos = start + take
            if take < size:
                _recv_exact_into(self._sock, memoryview(body)[take:], deadline)
        except TimeoutError:
            raise TimeoutError(f"no frame from {self.peer_node} within {timeout} s") from None
        except OSError as e:
            if isinstance(e, TransportError):
                raise
            raise TransportError(f"receive from {self.peer_node} failed: {e}") from e
        return Frame(header, self._recv_seal.open(header, hv, body))

    def has_unread(self) -> bool:
        """Whether more has arrived on this connection than was taken (buffered, or waiting
        in the socket): a reader can tell it is not idle."""
        if self._rend > self._rpos:
            return True
        p = select.poll()
        p.register(self._sock, select.POLLIN)
        return bool(p.poll(0))

    def _fill(self, need: int, deadline: float | None) -> None:
        """Have at least ``need`` unread bytes in the receive buffer. One ``recv_into`` takes
        whatever has arrived (a small frame's header and body come in one read: a system call
        fewer per hop, docs/design.md 8.3); bytes past this frame stay for the next one."""
        if self._rend - self._rpos >= need:
            return
        if self._rpos:  # move the unread tail to the front
            left = self._rend - self._rpos
            self._rview[:left] = self._rview[self._rpos:self._rend]
            self._rpos, self._rend = 0, left
        while self._rend < need:
            if deadline is not None:
                _wait_readable(self._sock, deadline)
            k = self._sock.recv_into(self._rview[self._rend:])
            if k == 0:
                raise TransportError("connection closed by peer" if self._rend == 0
                                     else "connection closed mid-frame")
            self._rend += k

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
        """Say goodbye (best effort) and close the socket. Idempotent.

        Never waits on the peer: a send blocked in another thread (a peer that stopped
        reading, a link that went down) is woken by the shutdown and fails, and the goodbye
        is skipped where it could not leave at once.
        """
        if self._closed:
            return
        if reason is not None and self._send_lock.acquire(timeout=GOODBYE_WAIT_S):
            try:
                with contextlib.suppress(Exception):  # none on a socket broken or closed
                    p = select.poll()
                    p.register(self._sock, select.POLLOUT)
                    if p.poll(GOODBYE_WAIT_S * 1000):
                        header, chunks = encode_frame(Message(Kind.CLOSE, {FieldTag.META: {"reason": reason}}))
                        _sendmsg_all(self._sock, self._send_seal.seal(header, list(chunks)))
            finally:
                self._send_lock.release()
        self._closed = True  # before the shutdown: its readers see a close, not a failure
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with self._send_lock:  # the fd outlives every send that used it
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
    on_keyed: Callable[[bytes], None] | None = None,
) -> Connection:
    """Server side of the handshake on an accepted socket, all within ``timeout`` seconds.

    Raises AuthError on refusal, after telling the peer why in words that name nothing about
    this node. ``on_keyed(nonce_c)`` is called once the client's HELLO shows our key's tag; it
    may refuse the handshake by raising AuthError.
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
            on_keyed(nonce_c)  # may refuse it (AuthError): e.g. a HELLO seen before
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
