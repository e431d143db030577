"""The ring's handshake: key proofs, then session keys for sealed frames (docs/design.md 5.1).

The client sends HELLO (protocol, nonce, a tag that shows it holds the ring key, sealing on/off),
the server answers CHALLENGE (its nonce and proof), the client AUTH (its proof and node id, the
first sealed frame), the server WELCOME (its node id). Both ends then hold per-direction session
keys (``edgespec.wire.auth``). Refusals name nothing about the refusing node.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable

from edgespec.wire import auth
from edgespec.wire.auth import AuthError, ClearFrames, FrameSeal, SessionKeys
from edgespec.wire.codec import FieldTag, Message, decode_payload, encode_frame
from edgespec.wire.header import (
    DEFAULT_MAX_PAYLOAD,
    HANDSHAKE_MAX_PAYLOAD,
    HEADER_SIZE,
    PROTOCOL_VERSION,
    FrameHeader,
    Kind,
    WireError,
    decode_header,
)
from edgespec.wire.messages import error_message
from edgespec.wire.transport import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    Connection,
    TransportError,
    _recv_exact_into,
    _sendmsg_all,
    _set_nodelay,
)

_MAX_NODE_ID = 256



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


def client_handshake(sock: socket.socket, key: bytes, *, node_id: str, sealed: bool,
                     deadline: float) -> tuple[FrameSeal | ClearFrames, FrameSeal | ClearFrames, str]:
    """Client side of the handshake on a connected socket: (send seal, receive seal, the
    server's node id). Raises AuthError, WireError, TransportError, OSError or TimeoutError;
    ``edgespec.wire.transport.connect`` turns each into one line naming the peer."""
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
    return send, recv, server_node


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
