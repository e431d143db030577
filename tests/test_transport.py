"""Authenticated framed connections over real loopback sockets."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time

import numpy as np
import pytest

from edgespec import wire
from edgespec.wire import (
    FieldTag,
    FrameHeader,
    Kind,
    Message,
    hidden_message,
    seq_matrix,
    tokens_message,
)
from edgespec.wire.auth import AuthError
from edgespec.wire.server import FrameServer
from edgespec.wire.transport import Connection, Frame, RemoteError, TransportError, connect

KEY = bytes(range(32))
WRONG = bytes(range(1, 33))


def health(conn: Connection, frame: Frame) -> Message:
    return Message(Kind.REPLY, {FieldTag.META: {"ok": True, "op": frame.decode().meta["op"]}})


@pytest.fixture
def server():
    srv = FrameServer(KEY, node_id="srv", handshake_timeout=1.0)
    srv.register(Kind.CONTROL, health)

    def boom(conn: Connection, frame: Frame) -> None:
        raise RuntimeError("stage exploded")

    srv.register(Kind.KV_OPS, boom)
    srv.register(Kind.TOKENS, lambda conn, frame: Message(Kind.RESULT, {FieldTag.TARGETS: frame.decode()[FieldTag.TOKENS]}))
    with srv:
        yield srv


def ping(conn: Connection) -> dict:
    return conn.request(wire.control_message("health"), timeout=5).meta


def test_request_reply_and_clean_close(server: FrameServer) -> None:
    c = connect(*server.address, KEY, node_id="cli")
    assert c.peer_node == "srv"
    assert ping(c) == {"ok": True, "op": "health"}
    r = c.request(tokens_message([5, 6], [0, 1], seq_matrix([[0], [0]])), timeout=5)
    assert r.kind == Kind.RESULT and r[FieldTag.TARGETS].tolist() == [5, 6]
    assert c._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    server.close()
    with pytest.raises((TransportError, AuthError)):
        for _ in range(3):
            c.recv(timeout=5)  # CLOSE frame, then EOF
    c.close()


def test_three_stage_ring_forwards_frames_unchanged() -> None:
    """head -> s1 -> s2 -> s3 -> head, each stage forwarding the raw frame to its neighbour."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((4, 896)).astype(np.float32)
    arrived: queue.Queue[Message] = queue.Queue()
    head = FrameServer(KEY, node_id="head")
    head.register(Kind.HIDDEN, lambda conn, frame: arrived.put(frame.decode()))
    stages = [FrameServer(KEY, node_id=f"s{i}") for i in range(3)]
    links: list[Connection] = []
    with head:
        for s in stages:
            s.start()
        try:
            nexts = [stages[1], stages[2], head]
            for s, nxt in zip(stages, nexts, strict=True):
                link = connect(*nxt.address, KEY, node_id=s.node_id)
                links.append(link)
                s.register(Kind.HIDDEN, lambda conn, frame, link=link: link.forward(frame, segment_id=frame.header.segment_id + 1))
            entry = connect(*stages[0].address, KEY, node_id="head")
            links.append(entry)
            for lap in range(3):
                msg = hidden_message(hidden * (lap + 1), [7, 8, 8, 9], seq_matrix([[0, 1], [0], [1], [1]]), encoding="f32", tokens=[1, 2, 3, 4], lap_id=lap)
                entry.send(msg)
            for lap in range(3):
                got = arrived.get(timeout=10)
                assert got.lap_id == lap and got.segment_id == 3
                np.testing.assert_array_equal(got[FieldTag.HIDDEN], hidden * (lap + 1))
                assert wire.seq_lists(got[FieldTag.SEQ_IDS]) == [[0, 1], [0], [1], [1]]
        finally:
            for link in links:
                link.close()
            for s in stages:
                s.close()


def test_wrong_key_is_refused_with_clear_log_and_others_keep_working(server: FrameServer, caplog: pytest.LogCaptureFixture) -> None:
    good = connect(*server.address, KEY, node_id="member")
    with caplog.at_level(logging.WARNING, logger="edgespec.transport"):
        with pytest.raises(AuthError, match="ring key mismatch"):
            connect(*server.address, WRONG, node_id="intruder")
        deadline = time.monotonic() + 5
        while server.refused == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert server.refused == 1
    assert any("refused peer" in r.message and "ring key mismatch" in r.message for r in caplog.records), caplog.text
    assert ping(good) == {"ok": True, "op": "health"}
    good.close()


def test_client_refuses_server_without_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rogue server that waves every HELLO through still cannot produce the proof."""
    with FrameServer(WRONG, node_id="rogue") as rogue:
        import edgespec.wire.auth as auth_mod

        monkeypatch.setattr(auth_mod, "verify_hello_tag", lambda *a: True)
        with pytest.raises(AuthError, match="could not prove"):
            connect(*rogue.address, KEY, node_id="head")


def _raw_send(conn: Connection, header: FrameHeader, payload: bytes) -> None:
    """Send a correctly sealed frame with an arbitrary (possibly invalid) payload."""
    conn._send_chunks(header, [payload])


def test_bad_payload_gets_error_and_connection_lives(server: FrameServer) -> None:
    c = connect(*server.address, KEY, node_id="cli")
    _raw_send(c, FrameHeader(Kind.TOKENS, 0, 77, 0, 0, 0, 4), b"\xff\x00\x00\x00")
    err = c.recv(timeout=5)
    assert err.kind == Kind.ERROR and err.request_id == 77 and err.meta["code"] == "bad_payload"
    assert "unknown field tag" in err.meta["message"]
    assert ping(c)["ok"]
    # Unknown-to-this-node kind and a crashing handler are answered too.
    with pytest.raises(RemoteError, match="unsupported"):
        c.request(Message(Kind.PRUNE, {FieldTag.NODES: [0]}), timeout=5)
    with pytest.raises(RemoteError, match="stage exploded"):
        c.request(Message(Kind.KV_OPS, {FieldTag.KV_OPS: []}), timeout=5)
    assert ping(c)["ok"]
    c.close()


def test_malformed_header_closes_only_that_connection(server: FrameServer) -> None:
    bystander = connect(*server.address, KEY, node_id="bystander")
    c = connect(*server.address, KEY, node_id="cli")
    c._sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 40)
    err = c.recv(timeout=5)
    assert err.kind == Kind.ERROR and err.meta["code"] == "bad_frame" and "magic" in err.meta["message"]
    with pytest.raises(TransportError):
        c.recv(timeout=5)
    assert ping(bystander)["ok"]
    bystander.close()


def test_tampered_and_replayed_frames_are_refused(server: FrameServer) -> None:
    a = connect(*server.address, KEY, node_id="a")
    b = connect(*server.address, KEY, node_id="b")
    # A frame sealed for connection a (same sequence number), injected into b: refused, b dropped.
    header, chunks = wire.encode_frame(wire.control_message("health", request_id=1))
    sealed = b"".join(bytes(x) for x in a._send_seal.seal(header, chunks))
    b._sock.sendall(sealed)
    err = b.recv(timeout=5)
    assert err.meta["code"] == "auth" and "authentication failed" in err.meta["message"]
    with pytest.raises(TransportError):
        b.recv(timeout=5)
    # A correctly sealed frame with an old sequence number (replay) is refused too.
    a._sock.sendall(sealed)  # valid for a
    assert a.recv(timeout=5).kind == Kind.REPLY
    a._sock.sendall(sealed)  # the same bytes again
    err = a.recv(timeout=5)
    assert err.meta["code"] == "auth" and "replayed" in err.meta["message"]
    c = connect(*server.address, KEY, node_id="c")
    assert ping(c)["ok"]
    c.close()


def test_max_frame_size_is_enforced() -> None:
    with FrameServer(KEY, node_id="small", max_payload=1024) as srv:
        srv.register(Kind.CONTROL, health)
        c = connect(*srv.address, KEY, node_id="cli")
        big = hidden_message(np.zeros((4, 896), np.float32), [0, 1, 2, 3], seq_matrix([[0]] * 4))
        c.send(big)  # the client allows it; the server does not
        err = c.recv(timeout=5)
        assert err.meta["code"] == "bad_frame" and "maximum frame size" in err.meta["message"]
        small = connect(*srv.address, KEY, node_id="cli2", max_payload=1024)
        with pytest.raises(wire.WireError, match="maximum frame size"):
            small.send(big)
        assert ping(small)["ok"]
        small.close()
        c.close()


def test_garbage_and_silent_peers_do_not_block_the_server(server: FrameServer) -> None:
    silent = socket.create_connection(server.address)
    garbage = socket.create_connection(server.address)
    garbage.sendall(b"\x16\x03\x01\x02\x00" + b"\xaa" * 300)  # a TLS hello, say
    c = connect(*server.address, KEY, node_id="cli")
    assert ping(c)["ok"]
    garbage.settimeout(5)
    try:  # answered (ERROR) or closed, not left hanging
        garbage.recv(4096)
    except ConnectionResetError:
        pass
    deadline = time.monotonic() + 5
    while server.refused < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.refused == 2  # garbage at once, the silent one after the handshake timeout
    silent.close()
    garbage.close()
    c.close()


def test_close_wakes_a_send_blocked_on_a_peer_that_stopped_reading() -> None:
    """A peer that stops reading (its link down, its process stopped) fills the socket
    buffers, and a send to it blocks. Closing the connection from another thread (a node
    dropping its links to re-plan) fails that send at once instead of waiting for the peer."""
    stalled = threading.Event()
    with FrameServer(KEY, node_id="srv") as srv:
        srv.register(Kind.TOKENS, lambda conn, frame: stalled.wait(60) and None)  # stops reading
        c = connect(*srv.address, KEY, node_id="cli")
        c.send(tokens_message([5], [0], seq_matrix([[0]])))
        sent: list[int] = []
        failed: list[Exception] = []

        def flood() -> None:
            try:
                for _ in range(256):  # 256 MiB: far beyond any socket buffer
                    c.send_payload(Kind.HIDDEN, bytes(1 << 20))
                    sent.append(1)
            except TransportError as e:
                failed.append(e)

        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        before = -1
        while len(sent) != before:  # until a second passes with no send finished
            before = len(sent)
            time.sleep(1.0)
        assert sender.is_alive() and len(sent) < 256
        t0 = time.monotonic()
        closer = threading.Thread(target=c.close, args=("re-linking",), daemon=True)
        closer.start()
        closer.join(10)
        sender.join(10)
        stalled.set()
        assert not closer.is_alive() and not sender.is_alive()
        assert time.monotonic() - t0 < 5
        assert failed and "failed" in str(failed[0])
