"""Ring key, mutual key-proof handshake, and sealed (encrypted, authenticated) frames.

Every member of a ring holds the same 32-byte random *ring key* in a file readable only by its
owner (0600). A connection starts with a handshake in which both sides prove they hold the key
without revealing it, with a fresh nonce from each side::

    client -> HELLO     {proto, nonce_c, tag = HMAC(K, "edgespec/hello" | proto | nonce_c), sealed}
    server -> CHALLENGE {nonce_s, proof_s = HMAC(K, "edgespec/server" | T)}
    client -> AUTH      sealed {proof_c = HMAC(K, "edgespec/client" | T), node}
    server -> WELCOME   sealed {node}              (or a plain ERROR and close, at any step)

``T`` (the transcript) binds the protocol version, the sealing mode and both nonces, so a proof
recorded on one connection is useless on another (replay), the two labels stop a proof from
being reflected back, and a changed sealing flag breaks both proofs.

Nothing that identifies a node leaves it on a connection before the peer proved the key (mDNS
announcements, which name nodes, are another matter). HELLO's tag is fresh per connection: it
lets a listener answer "ring key mismatch" to a peer holding another key without any fixed key
fingerprint on the wire. CHALLENGE carries a nonce and a proof, nothing else. Node ids travel
inside AUTH and WELCOME, which are sealed under keys only holders of the ring key can derive,
and a client checks the server's proof before it sends AUTH, so a fake node (an mDNS record
and a listener) learns nothing about the client either.

Sealing: both sides derive one 32-byte key per direction with HKDF-SHA256 from the ring key
and ``T``. Every frame from AUTH on is encrypted with ChaCha20-Poly1305 under its direction's
key; the nonce is the frame's sequence number (0, 1, 2, ... per direction; never reused, since
keys are fresh per connection and per direction), the 32-byte header is the associated data and
the 16-byte tag follows the ciphertext. A frame that was altered, injected from another
connection, replayed or reordered fails to open: AuthError, and the connection is dropped. A
LAN eavesdropper sees frame sizes and timing, never token ids, activations or weights.
ChaCha20-Poly1305 rather than AES-GCM: no per-key data limit to manage on links that live for
days, and fast without AES instructions (small ARM boards). Measured on loopback with
bench/transport_bench.py (2-CPU AMD EPYC VM, bench/results/transport_bench.json): sealing adds
about 9 us per hop to a one-token frame (1.9 KB; a relay hop took 53 us sealed, 44 us plain)
and about 80 us to a 64-row tree frame (116 KB; 210 us vs 128 us).

``EDGESPEC_INSECURE_PLAINTEXT=1`` on every member turns sealing off, for side-by-side
benchmarks only: frames then cross the network in the clear and are not authenticated at all
(the handshake still proves the key). Both ends must agree; a mismatch is refused in the
handshake, and a transcript with the other flag fails its proofs.

``key_id`` (a hash of the key under its own label) is for local diagnostics only; it is never
sent.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edgespec.wire.header import PROTOCOL_VERSION, TAG_SIZE, FrameHeader

KEY_SIZE = 32
NONCE_SIZE = 32
HELLO_TAG_SIZE = 16
KEY_ENV = "EDGESPEC_KEY_FILE"
#: Set to 1 on every member to send frames in the clear (benchmarks only; see module docstring).
INSECURE_ENV = "EDGESPEC_INSECURE_PLAINTEXT"
_SEQ_LIMIT = 2**64 - 1

log = logging.getLogger("edgespec.auth")


class AuthError(Exception):
    """A peer failed authentication, or a frame failed to open (tag or sequence check)."""


class KeyFileError(Exception):
    """The ring key file is missing, malformed or readable by others."""


def default_key_path() -> Path:
    """``$EDGESPEC_KEY_FILE``, else ``$XDG_CONFIG_HOME/edgespec/ring.key`` (~/.config/...)."""
    env = os.environ.get(KEY_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "edgespec" / "ring.key"


def write_key(path: str | os.PathLike[str] | None = None, *, force: bool = False) -> Path:
    """Create a new random ring key file with mode 0600 and return its path (``edgespec keygen``).

    Refuses to overwrite an existing key unless ``force``: replacing a key silently would lock
    this machine out of its ring.
    """
    p = Path(path).expanduser() if path is not None else default_key_path()
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if p.exists() and not force:
        raise KeyFileError(f"{p} already exists; pass force=True (--force) to replace the ring key")
    key = secrets.token_bytes(KEY_SIZE)
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    # O_EXCL + mode 0600 at creation: the key is never readable by others, not even briefly.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
        os.chmod(tmp, 0o600)  # in case a umask or ACL interfered
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p


def load_key(path: str | os.PathLike[str] | None = None) -> bytes:
    """Read a ring key file, refusing one that group or others can access."""
    p = Path(path).expanduser() if path is not None else default_key_path()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise KeyFileError(f"no ring key at {p}; create one with `edgespec keygen`") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{p} is not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"{p} has permissions {stat.S_IMODE(st.st_mode):04o}; the ring key must be private: chmod 600 {p}"
        )
    text = p.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise KeyFileError(f"{p} does not hold a hex ring key") from None
    if len(key) != KEY_SIZE:
        raise KeyFileError(f"{p} holds a {len(key)}-byte key, expected {KEY_SIZE}")
    return key


def ensure_key(path: str | os.PathLike[str] | None = None) -> bytes:
    """Load the ring key, creating it first if there is none (the first ``ring up``)."""
    p = Path(path).expanduser() if path is not None else default_key_path()
    if not p.exists():
        try:
            write_key(p)
        except KeyFileError:
            pass  # another process created it at the same moment
    return load_key(p)


def key_id(key: bytes) -> str:
    """Short public identifier of a ring key (local diagnostics; never sent on the wire)."""
    return hashlib.sha256(b"edgespec/key-id\0" + key).hexdigest()[:16]


@functools.cache
def _warn_insecure() -> None:
    log.warning("%s is set: ring frames are NOT encrypted or authenticated (benchmarks only)", INSECURE_ENV)


def sealing_enabled() -> bool:
    """False only if ``$EDGESPEC_INSECURE_PLAINTEXT`` is set to 1/true/yes/on (said once in the log)."""
    off = os.environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if off:
        _warn_insecure()
    return not off


def _check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_SIZE:
        raise AuthError(f"ring key must be {KEY_SIZE} bytes")


def transcript(nonce_c: bytes, nonce_s: bytes, sealed: bool) -> bytes:
    """The handshake transcript both proofs and the session keys are bound to."""
    parts = (PROTOCOL_VERSION.to_bytes(2, "little"), b"\1" if sealed else b"\0", nonce_c, nonce_s)
    # Length-prefix every part so no two different transcripts serialise the same.
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def hello_tag(key: bytes, nonce_c: bytes) -> bytes:
    """HELLO's key tag: shows the listener which key the client holds, fresh per nonce."""
    _check_key(key)
    return hmac.new(key, b"edgespec/hello\0" + PROTOCOL_VERSION.to_bytes(2, "little") + nonce_c, hashlib.sha256).digest()[:HELLO_TAG_SIZE]


def verify_hello_tag(key: bytes, got: bytes, nonce_c: bytes) -> bool:
    """Constant-time check of a HELLO's key tag."""
    return hmac.compare_digest(got, hello_tag(key, nonce_c))


def proof(key: bytes, role: str, nonce_c: bytes, nonce_s: bytes, sealed: bool = True) -> bytes:
    """HMAC-SHA256 proof of key possession for ``role`` ("client" or "server")."""
    _check_key(key)
    if role not in ("client", "server"):
        raise ValueError(f"role must be 'client' or 'server', got {role!r}")
    label = f"edgespec/{role}\0".encode()
    return hmac.new(key, label + transcript(nonce_c, nonce_s, sealed), hashlib.sha256).digest()


def verify_proof(key: bytes, role: str, got: bytes, nonce_c: bytes, nonce_s: bytes, sealed: bool = True) -> bool:
    """Constant-time check of a peer's proof."""
    return hmac.compare_digest(got, proof(key, role, nonce_c, nonce_s, sealed))


def new_nonce() -> bytes:
    """A fresh random handshake nonce."""
    return secrets.token_bytes(NONCE_SIZE)


@dataclass(frozen=True)
class SessionKeys:
    """Per-direction frame keys of one connection."""

    client_to_server: bytes
    server_to_client: bytes
    sealed: bool = True

    @classmethod
    def derive(cls, key: bytes, nonce_c: bytes, nonce_s: bytes, sealed: bool = True) -> SessionKeys:
        """Session keys from the ring key and the handshake transcript (HKDF-SHA256)."""
        _check_key(key)
        okm = HKDF(SHA256(), 64, salt=nonce_c + nonce_s, info=b"edgespec/session\0" + transcript(nonce_c, nonce_s, sealed)).derive(bytes(key))
        return cls(okm[:32], okm[32:], sealed)

    def for_role(self, role: str) -> tuple[FrameSeal | ClearFrames, FrameSeal | ClearFrames]:
        """(sending, receiving) direction for the side playing ``role``."""
        if role not in ("client", "server"):
            raise ValueError(f"role must be 'client' or 'server', got {role!r}")
        send, recv = (self.client_to_server, self.server_to_client) if role == "client" else (self.server_to_client, self.client_to_server)
        if not self.sealed:
            return ClearFrames(), ClearFrames()
        return FrameSeal(send), FrameSeal(recv)


def _nonce(seq: int) -> bytes:
    return seq.to_bytes(12, "little")


class FrameSeal:
    """One direction of a sealed connection: ChaCha20-Poly1305, nonce = sequence number.

    The sender calls ``seal(header, payload)`` (it stamps the next sequence number into the
    header); the receiver calls ``open(...)``, which insists on the exact next sequence number
    and on a tag that covers header and payload.
    """

    __slots__ = ("_aead", "_seq")
    overhead = TAG_SIZE

    def __init__(self, session_key: bytes) -> None:
        self._aead = ChaCha20Poly1305(session_key)
        self._seq = 0

    @property
    def seq(self) -> int:
        """The sequence number the next frame will carry / must carry."""
        return self._seq

    def _take_seq(self) -> int:
        if self._seq >= _SEQ_LIMIT:
            raise AuthError("frame sequence numbers exhausted on this connection; reconnect")
        s = self._seq
        self._seq += 1
        return s

    def seal(self, header: FrameHeader, payload: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
        """The buffers to send: packed header, then ciphertext and tag."""
        seq = self._take_seq()
        hb = header._replace(seq=seq).pack()
        data = payload[0] if len(payload) == 1 else b"".join(payload)
        return [hb, self._aead.encrypt(_nonce(seq), data, hb)]

    def open(self, header: FrameHeader, header_bytes: bytes | memoryview, body: bytearray | memoryview) -> memoryview:
        """The payload of a received frame (``body`` = ciphertext and tag); AuthError if forged."""
        if header.seq != self._seq:
            raise AuthError(f"frame sequence {header.seq}, expected {self._seq}: replayed or reordered frame")
        out = bytearray(len(body) - TAG_SIZE)
        try:
            self._aead.decrypt_into(_nonce(self._seq), body, header_bytes, out)
        except InvalidTag:
            raise AuthError(f"frame authentication failed (seq {header.seq}): forged, corrupted or from another connection") from None
        self._seq += 1
        return memoryview(out)


class ClearFrames:
    """One direction of an unsealed connection (``EDGESPEC_INSECURE_PLAINTEXT``): frames go in
    the clear with a sequence number and no tag. Benchmarks only."""

    __slots__ = ("_seq",)
    overhead = 0

    def __init__(self) -> None:
        self._seq = 0

    @property
    def seq(self) -> int:
        """The sequence number the next frame will carry / must carry."""
        return self._seq

    def seal(self, header: FrameHeader, payload: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
        """The buffers to send: packed header, then the payload as it is."""
        seq = self._seq
        self._seq += 1
        return [header._replace(seq=seq).pack(), *payload]

    def open(self, header: FrameHeader, header_bytes: bytes | memoryview, body: bytearray | memoryview) -> memoryview:
        """The payload (``body`` itself) after the sequence check."""
        if header.seq != self._seq:
            raise AuthError(f"frame sequence {header.seq}, expected {self._seq}: replayed or reordered frame")
        self._seq += 1
        return memoryview(body)
