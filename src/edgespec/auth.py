"""Ring key, mutual HMAC-SHA256 handshake and per-frame message authentication.

Every member of a ring holds the same 32-byte random *ring key* in a file readable only by its
owner (0600). A connection starts with a challenge-response handshake in which both sides prove
they hold the key without revealing it, with a fresh nonce from each side::

    client -> HELLO     {proto, node, key_id, nonce_c}
    server -> CHALLENGE {node, nonce_s, proof_s = HMAC(K, "edgespec/server" | transcript)}
    client -> AUTH      {proof_c = HMAC(K, "edgespec/client" | transcript)}
    server -> WELCOME   {}                       (or ERROR + close)

``transcript`` binds both nonces and both node ids, so a proof recorded on one connection is
useless on another (replay) and the two labels stop a proof from being reflected back. Both
sides then derive one session key per direction from the ring key and the nonces; every later
frame carries a 16-byte truncated HMAC-SHA256 over its header and payload, and the header's
sequence number must be exactly the next one expected. A forged, altered, reordered or replayed
frame therefore fails verification and the connection is dropped.

``key_id`` is a hash of the key under its own label: it lets a refused peer be told "you hold a
different ring key" instead of a bare failure, and reveals nothing usable about the key.
Frames are authenticated, not encrypted: a LAN eavesdropper can see activations but cannot join,
load, request or inject anything.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from edgespec.wire import MAC_SIZE, PROTOCOL_VERSION, FrameHeader

KEY_SIZE = 32
NONCE_SIZE = 32
KEY_ENV = "EDGESPEC_KEY_FILE"


class AuthError(Exception):
    """A peer failed authentication, or a frame failed its MAC / sequence check."""


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
    """Short public identifier of a ring key (for "different ring key" diagnostics)."""
    return hashlib.sha256(b"edgespec/key-id\0" + key).hexdigest()[:16]


def _check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_SIZE:
        raise AuthError(f"ring key must be {KEY_SIZE} bytes")


def _transcript(nonce_c: bytes, nonce_s: bytes, node_c: str, node_s: str) -> bytes:
    parts: Iterable[bytes] = (
        PROTOCOL_VERSION.to_bytes(2, "little"),
        nonce_c,
        nonce_s,
        node_c.encode(),
        node_s.encode(),
    )
    # Length-prefix every part so no two different transcripts serialise the same.
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def proof(key: bytes, role: str, nonce_c: bytes, nonce_s: bytes, node_c: str, node_s: str) -> bytes:
    """HMAC-SHA256 proof of key possession for ``role`` ("client" or "server")."""
    _check_key(key)
    if role not in ("client", "server"):
        raise ValueError(f"role must be 'client' or 'server', got {role!r}")
    label = f"edgespec/{role}\0".encode()
    return hmac.new(key, label + _transcript(nonce_c, nonce_s, node_c, node_s), hashlib.sha256).digest()


def verify_proof(key: bytes, role: str, got: bytes, nonce_c: bytes, nonce_s: bytes, node_c: str, node_s: str) -> bool:
    """Constant-time check of a peer's proof."""
    return hmac.compare_digest(got, proof(key, role, nonce_c, nonce_s, node_c, node_s))


def new_nonce() -> bytes:
    """A fresh random handshake nonce."""
    return secrets.token_bytes(NONCE_SIZE)


@dataclass(frozen=True)
class SessionKeys:
    """Per-direction MAC keys of one connection."""

    client_to_server: bytes
    server_to_client: bytes

    @classmethod
    def derive(cls, key: bytes, nonce_c: bytes, nonce_s: bytes) -> SessionKeys:
        """Session keys from the ring key and both handshake nonces."""
        _check_key(key)
        base = _transcript(nonce_c, nonce_s, "", "")
        c2s = hmac.new(key, b"edgespec/session/c2s\0" + base, hashlib.sha256).digest()
        s2c = hmac.new(key, b"edgespec/session/s2c\0" + base, hashlib.sha256).digest()
        return cls(c2s, s2c)

    def for_role(self, role: str) -> tuple[FrameMac, FrameMac]:
        """(sending MAC, receiving MAC) for the side playing ``role``."""
        if role == "client":
            return FrameMac(self.client_to_server), FrameMac(self.server_to_client)
        if role == "server":
            return FrameMac(self.server_to_client), FrameMac(self.client_to_server)
        raise ValueError(f"role must be 'client' or 'server', got {role!r}")


class FrameMac:
    """MAC and sequence numbering of one direction of one connection.

    The sender stamps ``next_seq()`` into each header and appends ``sign(...)``; the receiver
    calls ``verify(...)``, which also insists on the exact next sequence number.
    """

    __slots__ = ("_key", "_seq", "_base")

    def __init__(self, session_key: bytes) -> None:
        self._key = session_key
        self._seq = 0
        # HMAC object keyed once; copy() per frame avoids re-hashing the key pads each time.
        self._base = hmac.new(session_key, digestmod=hashlib.sha256)

    @property
    def seq(self) -> int:
        """The sequence number the next frame will carry / must carry."""
        return self._seq

    def next_seq(self) -> int:
        """Reserve the next sequence number (sender side)."""
        s = self._seq
        self._seq += 1
        return s

    def sign(self, header: bytes | memoryview, payload: Iterable[bytes | memoryview]) -> bytes:
        """16-byte MAC over a packed header and the payload chunks."""
        h = self._base.copy()
        h.update(header)
        for chunk in payload:
            h.update(chunk)
        return h.digest()[:MAC_SIZE]

    def verify(self, header: FrameHeader, header_bytes: bytes | memoryview, payload: bytes | memoryview, mac: bytes | memoryview) -> None:
        """Check a received frame's MAC and sequence number; raise AuthError if wrong."""
        want = self.sign(header_bytes, (payload,))
        if not hmac.compare_digest(want, bytes(mac)):
            raise AuthError(f"frame MAC mismatch (seq {header.seq}): forged or corrupted frame")
        if header.seq != self._seq:
            raise AuthError(f"frame sequence {header.seq}, expected {self._seq}: replayed or reordered frame")
        self._seq += 1
