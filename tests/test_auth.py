"""Ring key files, handshake proofs, session keys and sealed frames."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from edgespec.wire import FrameHeader, Kind, auth, decode_header
from edgespec.wire.auth import AuthError, KeyFileError, SessionKeys


def test_keygen_writes_private_key_and_refuses_to_overwrite(tmp_path: Path) -> None:
    old = os.umask(0)  # even with a permissive umask the key must come out 0600
    try:
        p = auth.write_key(tmp_path / "sub" / "ring.key")
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    key = auth.load_key(p)
    assert len(key) == auth.KEY_SIZE
    with pytest.raises(KeyFileError, match="already exists"):
        auth.write_key(p)
    assert auth.load_key(p) == key
    p2 = auth.write_key(p, force=True)
    assert auth.load_key(p2) != key
    assert not list(p.parent.glob("*.tmp*"))


def test_load_key_refuses_open_permissions_and_garbage(tmp_path: Path) -> None:
    p = auth.write_key(tmp_path / "ring.key")
    p.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        auth.load_key(p)
    p.chmod(0o600)
    p.write_text("not hex\n")
    with pytest.raises(KeyFileError, match="hex"):
        auth.load_key(p)
    p.write_text("ab" * 8)
    with pytest.raises(KeyFileError, match="8-byte"):
        auth.load_key(p)
    with pytest.raises(KeyFileError, match="keygen"):
        auth.load_key(tmp_path / "missing.key")


def test_ensure_key_creates_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.KEY_ENV, str(tmp_path / "k" / "ring.key"))
    assert auth.default_key_path() == tmp_path / "k" / "ring.key"
    k1 = auth.ensure_key()
    assert auth.ensure_key() == k1


def test_proofs_are_bound_to_role_nonces_key_and_sealing() -> None:
    k, other = bytes(range(32)), bytes(32)
    nc, ns = auth.new_nonce(), auth.new_nonce()
    p = auth.proof(k, "client", nc, ns)
    assert auth.verify_proof(k, "client", p, nc, ns)
    assert not auth.verify_proof(k, "server", p, nc, ns)  # no reflection
    assert not auth.verify_proof(k, "client", p, nc, auth.new_nonce())  # no replay
    assert not auth.verify_proof(k, "client", p, nc, ns, sealed=False)  # no downgrade
    assert not auth.verify_proof(other, "client", p, nc, ns)
    # Length prefixes: moving a byte between the nonces changes the transcript.
    assert auth.transcript(nc + b"x", ns, True) != auth.transcript(nc, b"x" + ns, True)
    # The HELLO tag shows which key a peer holds, fresh per nonce: no fixed fingerprint.
    t = auth.hello_tag(k, nc)
    assert auth.verify_hello_tag(k, t, nc) and not auth.verify_hello_tag(other, t, nc)
    assert auth.hello_tag(k, ns) != t
    assert auth.key_id(k) != auth.key_id(other)
    assert auth.key_id(k) not in k.hex()


def _seal(direction, payload: bytes) -> tuple[FrameHeader, bytes, bytearray]:
    """Seal a CLOSE frame carrying ``payload``: (header as sent, header bytes, ciphertext+tag)."""
    hb, body = direction.seal(FrameHeader(Kind.CLOSE, 0, 0, 0, 0, 0, len(payload)), [payload[:1], payload[1:]])
    return decode_header(hb), hb, bytearray(body)


def test_sealed_frames_refuse_forgery_replay_and_reordering() -> None:
    keys = SessionKeys.derive(bytes(range(32)), b"c" * 32, b"s" * 32)
    c_send, c_recv = keys.for_role("client")
    s_send, s_recv = keys.for_role("server")
    assert keys.client_to_server != keys.server_to_client
    frames = [_seal(c_send, b"abc") for _ in range(3)]
    assert all(b"abc" not in bytes(body) for _, _, body in frames)  # encrypted
    h, hb, body = frames[0]
    assert bytes(s_recv.open(h, hb, body)) == b"abc"
    with pytest.raises(AuthError, match="sequence"):  # replay of frame 0
        s_recv.open(h, hb, body)
    h2, hb2, body2 = frames[2]
    with pytest.raises(AuthError, match="sequence"):  # frame 1 skipped
        s_recv.open(h2, hb2, body2)
    h1, hb1, body1 = frames[1]
    altered = bytearray(body1)
    altered[1] ^= 1
    with pytest.raises(AuthError, match="authentication failed"):  # altered payload
        s_recv.open(h1, hb1, altered)
    with pytest.raises(AuthError, match="authentication failed"):  # altered header
        s_recv.open(h1, hb1[:8] + b"\1" + hb1[9:], body1)
    with pytest.raises(AuthError, match="authentication failed"):  # reflected back
        c_recv.open(h, hb, body)
    assert bytes(s_recv.open(h1, hb1, body1)) == b"abc"
    assert bytes(s_recv.open(h2, hb2, body2)) == b"abc"
    # A frame sealed with a session key of another connection is refused.
    other = SessionKeys.derive(bytes(range(32)), b"x" * 32, b"s" * 32).for_role("client")[0]
    h3, hb3, body3 = _seal(other, b"abc")
    with pytest.raises(AuthError, match="authentication failed"):
        SessionKeys.derive(bytes(range(32)), b"c" * 32, b"s" * 32).for_role("server")[1].open(h3, hb3, body3)
    # Sealing off: the same sequence checks, no encryption.
    plain_send, _ = SessionKeys.derive(bytes(range(32)), b"c" * 32, b"s" * 32, sealed=False).for_role("client")
    assert b"".join(bytes(x) for x in plain_send.seal(h, [b"abc"])).endswith(b"abc")


def test_bad_key_sizes_are_refused() -> None:
    with pytest.raises(AuthError):
        auth.proof(b"short", "client", b"", b"")
    with pytest.raises(ValueError):
        auth.proof(bytes(32), "admin", b"", b"")
