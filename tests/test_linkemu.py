"""The link emulator forwards bytes intact and in order (functional; timing lives in bench/)."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is not an installed package

from bench.linkemu import LinkEmulatorThread, LinkSpec, emulated_links  # noqa: E402
from edgespec.wire import FieldTag, Kind, Message, hidden_message, seq_matrix  # noqa: E402
from edgespec.wire.server import FrameServer  # noqa: E402
from edgespec.wire.transport import connect  # noqa: E402

KEY = bytes(range(32))


class Sink:
    """Accepts one connection, hashes everything it receives, echoes a digest at EOF."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]
        self.received = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        c, _ = self.sock.accept()
        with c:
            while data := c.recv(65536):
                self.received += data
            c.sendall(hashlib.sha256(self.received).digest())  # after the half-close arrived

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("spec", [LinkSpec(), LinkSpec(delay_ms=2, jitter_ms=3, seed=1), LinkSpec(delay_ms=1, bandwidth_mbps=200)])
def test_bytes_arrive_intact_in_order_and_eof_is_passed_on(spec: LinkSpec) -> None:
    sink = Sink()
    payload = os.urandom(3 * 1024 * 1024 + 17)
    with LinkEmulatorThread() as emu:
        proxy = emu.add(sink.address, spec)
        with socket.create_connection(proxy, timeout=30) as s:
            view = memoryview(payload)
            for i in range(0, len(payload), 70001):  # odd-sized writes
                s.sendall(view[i : i + 70001])
            s.shutdown(socket.SHUT_WR)
            digest = b""
            while len(digest) < 32:
                chunk = s.recv(64)
                assert chunk, "proxy closed before the reply came back"
                digest += chunk
    sink.thread.join(10)
    sink.close()
    assert bytes(sink.received) == payload
    assert digest == hashlib.sha256(payload).digest()


def test_authenticated_frames_cross_a_ring_of_proxies() -> None:
    """head -> s1 -> head with a proxy on each link; frames stay valid (MACs, order)."""
    got: list[Message] = []
    done = threading.Event()
    head = FrameServer(KEY, node_id="head")
    stage = FrameServer(KEY, node_id="s1")

    def at_head(conn, frame):
        got.append(frame.decode())
        if len(got) == 20:
            done.set()

    head.register(Kind.HIDDEN, at_head)
    with head, stage, emulated_links([stage.address, head.address], LinkSpec(delay_ms=1, jitter_ms=1, seed=3)) as (to_stage, to_head):
        back = connect(*to_head, KEY, node_id="s1")
        stage.register(Kind.HIDDEN, lambda conn, frame: back.forward(frame))
        entry = connect(*to_stage, KEY, node_id="head")
        rng = np.random.default_rng(0)
        sent = [rng.standard_normal((2, 896)).astype(np.float32) for _ in range(20)]
        for lap, h in enumerate(sent):
            entry.send(hidden_message(h, [lap, lap], seq_matrix([[0], [0]]), encoding="f32", lap_id=lap))
        assert done.wait(20)
        assert [m.lap_id for m in got] == list(range(20))
        for m, h in zip(got, sent, strict=True):
            np.testing.assert_array_equal(m[FieldTag.HIDDEN], h)
        entry.close()
        back.close()


def test_closing_the_emulator_cuts_connections() -> None:
    sink = Sink()
    emu = LinkEmulatorThread()
    proxy = emu.add(sink.address, LinkSpec(delay_ms=1))
    s = socket.create_connection(proxy, timeout=10)
    s.sendall(b"hello")
    for _ in range(500):  # the proxied connection is up once bytes came through
        if bytes(sink.received) == b"hello":
            break
        threading.Event().wait(0.01)
    assert bytes(sink.received) == b"hello"
    emu.close()
    try:
        assert s.recv(10) == b""
    except ConnectionResetError:
        pass
    s.close()
    sink.close()


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        LinkSpec(delay_ms=-1)
    with pytest.raises(ValueError):
        LinkSpec(bandwidth_mbps=0)
