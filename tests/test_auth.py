"""Ring key files, handshake proofs, session keys and per-frame MACs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from edgespec import auth
from edgespec.auth import AuthError, FrameMac, KeyFileError, SessionKeys
from edgespec.wire import FrameHeader, Kind


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


def test_proofs_are_bound_to_role_nonces_and_key() -> None:
    k, other = bytes(range(32)), bytes(32)
    nc, ns = auth.new_nonce(), auth.new_nonce()
    p = auth.proof(k, "client", nc, ns, "a", "b")
    assert auth.verify_proof(k, "client", p, nc, ns, "a", "b")
    assert not auth.verify_proof(k, "server", p, nc, ns, "a", "b")  # no reflection
    assert not auth.verify_proof(k, "client", p, nc, auth.new_nonce(), "a", "b")  # no replay
    assert not auth.verify_proof(k, "client", p, nc, ns, "a", "c")
    assert not auth.verify_proof(other, "client", p, nc, ns, "a", "b")
    # Length prefixes: moving a byte between node ids changes the transcript.
    assert auth.proof(k, "client", nc, ns, "ab", "c") != auth.proof(k, "client", nc, ns, "a", "bc")
    assert auth.key_id(k) != auth.key_id(other)
    assert auth.key_id(k) not in k.hex()


def _frame(seq: int) -> tuple[FrameHeader, bytes]:
    h = FrameHeader(Kind.CLOSE, 0, 0, 0, 0, seq, 3)
    return h, h.pack()


def test_frame_mac_refuses_forgery_replay_and_reordering() -> None:
    keys = SessionKeys.derive(bytes(range(32)), b"c" * 32, b"s" * 32)
    c_send, c_recv = keys.for_role("client")
    s_send, s_recv = keys.for_role("server")
    assert keys.client_to_server != keys.server_to_client
    frames = []
    for _ in range(3):
        h, hb = _frame(c_send.next_seq())
        frames.append((h, hb, b"abc", c_send.sign(hb, [b"a", b"bc"])))
    h, hb, payload, mac = frames[0]
    s_recv.verify(h, hb, payload, mac)
    with pytest.raises(AuthError, match="sequence"):  # replay of frame 0
        s_recv.verify(h, hb, payload, mac)
    h2, hb2, p2, mac2 = frames[2]
    with pytest.raises(AuthError, match="sequence"):  # frame 1 skipped
        s_recv.verify(h2, hb2, p2, mac2)
    h1, hb1, p1, mac1 = frames[1]
    with pytest.raises(AuthError, match="MAC"):  # altered payload
        s_recv.verify(h1, hb1, b"abd", mac1)
    with pytest.raises(AuthError, match="MAC"):  # reflected back in the other direction
        c_recv.verify(h, hb, payload, mac)
    s_recv.verify(h1, hb1, p1, mac1)
    s_recv.verify(h2, hb2, p2, mac2)
    # A frame signed with a session key of another connection is refused.
    other = SessionKeys.derive(bytes(range(32)), b"x" * 32, b"s" * 32).for_role("client")[0]
    h3, hb3 = _frame(other.next_seq())
    with pytest.raises(AuthError, match="MAC"):
        FrameMac(keys.client_to_server).verify(h3, hb3, b"abc", other.sign(hb3, [b"abc"]))


def test_bad_key_sizes_are_refused() -> None:
    with pytest.raises(AuthError):
        auth.proof(b"short", "client", b"", b"", "", "")
    with pytest.raises(ValueError):
        auth.proof(bytes(32), "admin", b"", b"", "", "")
