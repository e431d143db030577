"""Hostile peers against real listeners on loopback: slow and flooding unauthenticated
sockets, descriptor exhaustion, eavesdropping and tampering relays, malformed handshakes,
probers and fake servers."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from edgespec import wire
from edgespec.wire import FieldTag, Kind, Message, auth, seq_matrix, tokens_message
from edgespec.wire.auth import AuthError
from edgespec.wire.server import FrameServer
from edgespec.wire.transport import Connection, Frame, TransportError, connect

KEY = bytes(range(32))
WRONG = bytes(range(1, 33))
NODE = "node-7f3a9c51"  # long enough that it cannot show up in ciphertext by chance
HEAD = "head-51d2e0b4"
#: Distinctive token ids (int32, each byte pattern unlikely in random bytes).
PATTERN = np.array([0x1A2B3C4D, 0x5E6F7081, 0x12345678, 0x7ABCDEF0], dtype=np.int32)


def health(conn: Connection, frame: Frame) -> Message:
    return Message(Kind.REPLY, {FieldTag.META: {"ok": True}})


def echo_tokens(conn: Connection, frame: Frame) -> Message:
    return Message(Kind.RESULT, {FieldTag.TARGETS: frame.decode()[FieldTag.TOKENS]})


def make_server(**kw) -> FrameServer:
    srv = FrameServer(KEY, node_id=NODE, **kw)
    srv.register(Kind.CONTROL, health)
    srv.register(Kind.TOKENS, echo_tokens)
    return srv


def ping(conn: Connection, timeout: float = 5.0) -> bool:
    return bool(conn.request(wire.control_message("health"), timeout=timeout).meta["ok"])


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


def frames_in(data: bytes) -> list[Message]:
    """Plain frames in ``data`` (what a peer without the key can read)."""
    out = []
    while len(data) >= wire.HEADER_SIZE:
        h = wire.decode_header(data[: wire.HEADER_SIZE])
        end = wire.HEADER_SIZE + h.payload_len
        out.append(wire.decode_payload(h, data[wire.HEADER_SIZE : end]))
        data = data[end:]
    return out


class Relay:
    """A TCP relay between clients and one server: records both directions, and flips the
    last byte of the next chunk in a direction on request."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.to_server = bytearray()
        self.to_client = bytearray()
        self.flip_to_server = threading.Event()
        self.flip_to_client = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(down, up, self.to_server, self.flip_to_server), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, self.to_client, self.flip_to_client), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray, flip: threading.Event) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            record += data
            if flip.is_set():
                flip.clear()
                data = data[:-1] + bytes([data[-1] ^ 0x01])
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()


# ----------------------------------------------------------------------------- lockout


@pytest.mark.parametrize("attackers_from, reconnect", [("127.0.0.1", False), ("127.0.0.2", True)])
def test_slow_unauthenticated_sockets_never_lock_out_a_member(attackers_from: str, reconnect: bool) -> None:
    """64 sockets trickling one byte every 2 s (from the member's own address, or from another
    host that reconnects whenever it is dropped): a keyed peer still connects and is answered
    within 2 s, again and again, for longer than one handshake deadline."""
    stop = threading.Event()
    with make_server(handshake_timeout=3.0) as srv:

        def trickle() -> None:
            while not stop.is_set():
                try:
                    s = socket.create_connection(srv.address, timeout=5, source_address=(attackers_from, 0))
                except OSError:
                    stop.wait(0.2)
                    continue
                with s:
                    for b in b"eS\x02\x01" * 100:  # the start of a HELLO header, forever
                        if stop.wait(2.0):
                            return
                        try:
                            s.send(bytes([b]))
                        except OSError:
                            break
                if not reconnect:
                    return

        threads = [threading.Thread(target=trickle, daemon=True) for _ in range(64)]
        for t in threads:
            t.start()
        try:
            time.sleep(1.0)  # every trickler connected
            for i in range(4):
                t0 = time.monotonic()
                c = connect(*srv.address, KEY, node_id=f"{HEAD}-{i}", timeout=2.0)
                assert ping(c, timeout=2.0)
                elapsed = time.monotonic() - t0
                c.close()
                assert elapsed < 2.0, f"member {i} needed {elapsed:.2f} s"
                time.sleep(1.0)
            assert srv.evicted > 0  # the tricklers really hit the pending cap
            assert srv.pending <= srv.max_pending
        finally:
            stop.set()
            for t in threads:
                t.join(5)


def _hello(nonce: bytes) -> bytes:
    """A genuine HELLO for KEY with ``nonce``: what crosses the LAN in the clear."""
    from edgespec.wire.codec import encode_frame
    from edgespec.wire.header import PROTOCOL_VERSION

    meta = {"proto": PROTOCOL_VERSION, "nonce": nonce.hex(),
            "tag": auth.hello_tag(KEY, nonce).hex(), "sealed": auth.sealing_enabled()}
    header, chunks = encode_frame(Message(Kind.HELLO, {FieldTag.META: meta}))
    return header.pack() + b"".join(bytes(c) for c in chunks)


def _hold_hellos(address: tuple[str, int], hellos: list[bytes]) -> list[socket.socket]:
    """Send each HELLO on a socket of its own, 4 per source address (127.0.0.2...), and
    keep the sockets open without answering the CHALLENGE."""
    held = []
    for i, hello in enumerate(hellos):
        s = socket.create_connection(address, timeout=5, source_address=(f"127.0.0.{2 + i // 4}", 0))
        s.sendall(hello)
        held.append(s)
    return held


def _members_get_in(srv: FrameServer, n: int, every: float) -> int:
    got = 0
    for i in range(n):
        try:
            with connect(*srv.address, KEY, node_id=f"{HEAD}-{i}", timeout=2.0) as c:
                got += ping(c, timeout=2.0)
        except AuthError:
            pass
        time.sleep(every)
    return got


@pytest.mark.parametrize("fresh", [False, True], ids=["one-captured-hello", "collected-hellos"])
def test_held_open_hellos_never_lock_out_a_member(fresh: bool) -> None:
    """20 sockets, 4 from each of 5 addresses, each sends a HELLO with a valid tag and then
    holds still: the same captured HELLO 20 times (a LAN eavesdropper), or 20 different ones
    (collected by a fake node advertised over mDNS). Members keep getting in."""
    hellos = [_hello(auth.new_nonce()) for _ in range(20)] if fresh else [_hello(auth.new_nonce())] * 20
    with make_server(handshake_timeout=5.0) as srv:
        held = _hold_hellos(srv.address, hellos)
        try:
            time.sleep(1.5 if fresh else 0.5)  # the keyed ones are past their grace
            assert _members_get_in(srv, 20, 0.25) == 20
            if not fresh:
                assert srv.refused >= 19  # every copy after the first: a replay
        finally:
            for s in held:
                s.close()


def test_refusals_are_logged_with_a_throttle(caplog: pytest.LogCaptureFixture) -> None:
    with make_server() as srv, caplog.at_level(logging.WARNING, logger="edgespec.transport"):
        for i in range(300):
            with pytest.raises(AuthError):
                connect(*srv.address, WRONG, node_id=f"stranger-{i}", timeout=2.0)
        with connect(*srv.address, KEY, node_id=HEAD, timeout=2.0) as c:
            assert ping(c)
        deadline = time.monotonic() + 5
        while srv.refused < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert srv.refused >= 300
    refusals = [r for r in caplog.records if "refused peer" in r.getMessage()]
    assert 1 <= len(refusals) <= 3, [r.getMessage() for r in refusals]
    assert "ring key mismatch" in refusals[0].getMessage()


def test_refusals_throttled_whatever_the_stranger_writes(caplog: pytest.LogCaptureFixture) -> None:
    """Reasons that quote the peer (its protocol value, its frame's bad magic) still share one
    throttle per kind: 200 different ones give one line each kind, not one per connection."""
    from edgespec.wire.codec import encode_frame

    def hello_speaking(proto: str) -> bytes:
        header, chunks = encode_frame(Message(Kind.HELLO, {FieldTag.META: {"proto": proto}}))
        return header.pack() + b"".join(bytes(c) for c in chunks)

    sends = [hello_speaking(f"v{i}") for i in range(100)] + [bytes([0x80 | i, i]) * 16 for i in range(100)]
    with make_server() as srv, caplog.at_level(logging.WARNING, logger="edgespec.transport"):
        for data in sends:
            with socket.create_connection(srv.address, timeout=5) as s:
                s.sendall(data)
                read_until_closed(s)
        deadline = time.monotonic() + 5
        while srv.refused < len(sends) and time.monotonic() < deadline:
            time.sleep(0.05)
        with connect(*srv.address, KEY, node_id=HEAD, timeout=2.0) as c:
            assert ping(c)
    assert srv.refused >= len(sends)
    refusals = [r.getMessage() for r in caplog.records if "refused peer" in r.getMessage()]
    assert len(refusals) == 2, refusals
    assert "peer speaks protocol v0" in refusals[0] and "bad magic" in refusals[1]


CHILD = textwrap.dedent(
    """
    import logging, os, resource, sys, time
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
    from edgespec.wire.server import FrameServer
    from edgespec.wire.transport import connect
    from edgespec.wire import FieldTag, Kind, Message, control_message
    key = bytes(range(32))
    srv = FrameServer(key, node_id="low-fd", handshake_timeout=2.0)
    srv.register(Kind.CONTROL, lambda c, f: Message(Kind.REPLY, {FieldTag.META: {"ok": True}}))
    srv.start()
    with connect(*srv.address, key, node_id="warm-up") as c:  # load everything a handshake needs
        c.request(control_message("health"), timeout=10)
    time.sleep(0.5)
    used = len(os.listdir("/proc/self/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 2, hard))  # room for about two sockets
    print(srv.address[1], flush=True)
    sys.stdin.read()
    srv.close()
    """
)


def test_accept_loop_survives_running_out_of_descriptors() -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        burst = []
        for _ in range(30):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            burst.append(s)
        time.sleep(1.5)  # the node accepts until EMFILE, then keeps failing
        for s in burst:
            s.close()
        c = connect("127.0.0.1", port, KEY, node_id=HEAD, timeout=10)
        assert ping(c)
        c.close()
    finally:
        try:
            _, err = proc.communicate(timeout=20)  # closes stdin: the child stops
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert "accept failed" in err and "Too many open files" in err, err
    assert "Traceback" not in err, err
    assert f"authenticated peer {HEAD}" in err, err


# ----------------------------------------------------------------------------- sealing


def test_sealed_link_hides_token_ids_and_refuses_flipped_bytes(caplog: pytest.LogCaptureFixture) -> None:
    with make_server() as srv:
        relay = Relay(srv.address)
        try:
            c = connect(*relay.address, KEY, node_id=HEAD)
            assert c.sealed and c.peer_node == NODE
            r = c.request(tokens_message(PATTERN, np.arange(4), seq_matrix([[0]] * 4)), timeout=5)
            assert r[FieldTag.TARGETS].tolist() == PATTERN.tolist()
            captured = bytes(relay.to_server) + bytes(relay.to_client)
            assert len(relay.to_server) > 4 * 4 and len(relay.to_client) > 4 * 4
            for needle in [PATTERN.tobytes(), *(int(t).to_bytes(4, "little") for t in PATTERN)]:
                assert needle not in captured
            assert NODE.encode() not in captured and HEAD.encode() not in captured

            # A byte flipped on the way to the server: refused, that connection dropped.
            with caplog.at_level(logging.WARNING, logger="edgespec.transport"):
                relay.flip_to_server.set()
                c.send(wire.control_message("health", request_id=5))
                err = c.recv(timeout=5)
                assert err.kind == Kind.ERROR and err.meta["code"] == "auth"
                with pytest.raises(TransportError):
                    c.recv(timeout=5)
            assert any("rejected frame" in r.message and "authentication failed" in r.message for r in caplog.records), caplog.text
            c.close()

            # A byte flipped on the way back: the client refuses the frame.
            c2 = connect(*relay.address, KEY, node_id=HEAD)
            relay.flip_to_client.set()
            with pytest.raises(AuthError, match="authentication failed"):
                ping(c2)
            c2.close()

            # The server keeps serving everyone else.
            other = connect(*srv.address, KEY, node_id="bystander")
            assert ping(other)
            other.close()
        finally:
            relay.close()


def test_sealing_off_must_be_agreed_and_is_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmark-only switch: both ends must set it, and then frames really are plain
    (which also shows the capture test above can see token ids when they are there)."""
    monkeypatch.setenv(auth.INSECURE_ENV, "1")
    with make_server() as plain_srv:
        assert plain_srv.sealed is False
        with pytest.raises(AuthError, match="sealing mismatch"):
            connect(*plain_srv.address, KEY, node_id=HEAD, seal=True)
        relay = Relay(plain_srv.address)
        try:
            c = connect(*relay.address, KEY, node_id=HEAD)
            assert not c.sealed
            c.request(tokens_message(PATTERN, np.arange(4), seq_matrix([[0]] * 4)), timeout=5)
            assert PATTERN.tobytes() in bytes(relay.to_server) and PATTERN.tobytes() in bytes(relay.to_client)
            c.close()
        finally:
            relay.close()
    monkeypatch.delenv(auth.INSECURE_ENV)
    with make_server() as srv, pytest.raises(AuthError, match="sealing mismatch"):
        connect(*srv.address, KEY, node_id=HEAD, seal=False)


# ----------------------------------------------------------------------------- probers


def _hello_frame(meta_json: bytes) -> bytes:
    """A HELLO frame whose META field holds ``meta_json`` verbatim."""
    n = len(meta_json)
    field = bytes([FieldTag.META, wire.Encoding.JSON, 1, 0]) + n.to_bytes(4, "little") + meta_json + b"\0" * (-n % 4)
    return wire.FrameHeader(Kind.HELLO, 0, 0, 0, 0, 0, len(field)).pack() + field


def test_nested_hello_is_refused_in_one_line_and_probers_learn_nothing(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture) -> None:
    secrets_ = [NODE.encode(), auth.key_id(KEY).encode()]
    with caplog.at_level(logging.INFO, logger="edgespec.transport"), make_server() as srv:
        # 4 KB of nested "[" before authentication.
        s = socket.create_connection(srv.address)
        s.sendall(_hello_frame(b"[" * 4000))
        got = read_until_closed(s)
        s.close()
        (reply,) = frames_in(got)
        assert reply.kind == Kind.ERROR and reply.meta["code"] == "bad_frame" and "nested deeper" in reply.meta["message"]

        # A well-formed HELLO with a made-up key tag, and a client holding another key.
        s = socket.create_connection(srv.address)
        s.sendall(_hello_frame(b'{"proto":%d,"nonce":"%s","tag":"%s","sealed":true}' % (wire.PROTOCOL_VERSION, os.urandom(32).hex().encode(), os.urandom(16).hex().encode())))
        got += read_until_closed(s)
        s.close()
        with pytest.raises(AuthError, match="ring key mismatch") as refused:
            connect(*srv.address, WRONG, node_id="intruder")
        # A HELLO recorded from a real member, replayed: refused at once as a replay (the
        # listener remembers the nonces it saw), with nothing about the node.
        relay = Relay(srv.address)
        member = connect(*relay.address, KEY, node_id=HEAD)
        assert ping(member)
        member.close()
        relay.close()
        recorded = bytes(relay.to_server)
        hello_len = wire.HEADER_SIZE + wire.decode_header(recorded[: wire.HEADER_SIZE]).payload_len
        s = socket.create_connection(srv.address)
        s.sendall(recorded[:hello_len])
        challenge = read_until_closed(s, timeout=srv.handshake_timeout + 2)
        s.close()
        (answer,) = frames_in(challenge)
        assert answer.kind == Kind.ERROR and "replayed" in answer.meta["message"]
        for secret in secrets_:
            assert secret not in got and secret not in challenge
            assert secret.decode() not in str(refused.value)

        assert ping(connect(*srv.address, KEY, node_id="member"))
        assert srv.refused == 4
    refusals = [r.message for r in caplog.records if "refused peer" in r.message]
    assert any("nested deeper" in m for m in refusals), refusals
    assert all("\n" not in m for m in refusals)
    assert "Traceback" not in caplog.text and "Traceback" not in capfd.readouterr().err


def test_trickling_fake_server_fails_connect_within_its_deadline() -> None:
    """A fake node that answers one byte at a time cannot hold a head past connect()'s timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            head = wire.FrameHeader(Kind.CHALLENGE, 0, 0, 0, 0, 0, 4000).pack()
            for b in (head + b"\0" * 4000)[:40]:  # 8 s of trickling, then the fake node hangs up
                if stop.wait(0.2):
                    return
                try:
                    conn.send(bytes([b]))
                except OSError:
                    return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(AuthError, match=f"127.0.0.1:{port}.*timed out"):
            connect("127.0.0.1", port, KEY, node_id=HEAD, timeout=1.0)
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        listener.close()
        t.join(5)
    assert elapsed < 2.0, f"connect() gave up after {elapsed:.1f} s, its deadline was 1 s"


def test_a_reader_timeout_does_not_fail_a_concurrent_sender() -> None:
    """A thread waiting for frames with a timeout must not put that deadline on another
    thread's sends on the same connection (a head reads results while it sends batches)."""
    first = threading.Event()

    def slow(conn: Connection, frame: Frame) -> None:
        if not first.is_set():
            first.set()
            time.sleep(1.5)  # stop reading: the sender's socket buffers fill up

    with make_server() as srv:
        srv.register(Kind.HIDDEN, slow)
        c = connect(*srv.address, KEY, node_id=HEAD)
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                try:
                    c.recv(timeout=0.1)
                except TimeoutError:
                    continue
                except (TransportError, AuthError):
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            big = wire.hidden_message(np.zeros((512, 1024), np.float32), np.arange(512), seq_matrix([[0]] * 512), encoding="f32")
            for _ in range(24):  # 2 MB each: far more than the socket buffers hold
                c.send(big)
            assert ping(connect(*srv.address, KEY, node_id="other"))
        finally:
            stop.set()
            reader.join(5)
            c.close()
