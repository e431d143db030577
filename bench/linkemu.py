"""Link emulator: an asyncio TCP proxy that adds one-way delay (+ jitter) and caps bandwidth.

Kernel netem is not available on these machines, so ring links are slowed down in user space:
put one proxy on every link (head -> stage 0, stage -> stage, last stage -> head) and point the
sender at the proxy instead of the real peer. Sockets on both sides stay real TCP sockets.

Model of one direction of a link: bytes read at time t are serialised at ``bandwidth`` after
the bytes before them (a FIFO wire), then propagate for ``delay`` (+ a jitter sample), and are
written out in order (TCP never reorders, so a delivery time is never earlier than the
previous one). Both directions are delayed, so a round trip through one proxy adds 2 x delay.

Timer precision: asyncio's default epoll selector rounds every timeout *up* to whole
milliseconds, which alone would add up to 1 ms per hop. The proxy's loop therefore runs on
``selectors.SelectSelector`` (microsecond timeouts); a proxy serves a handful of links, far below
select's descriptor limit. The proxy never spins: on a host whose cores the ring saturates, a
busy-wait would take CPU from the very processes whose speed is measured (see ``_Timer``).

    python -m bench.linkemu --self-check        # prints JSON, exit 1 if a check fails
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import selectors
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

CHUNK = 64 * 1024
PACED_CHUNK = 16 * 1024  # smaller pieces when bandwidth-limited, so delivery is smooth


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link, applied to each direction independently."""

    delay_ms: float = 0.0  # one-way propagation delay
    jitter_ms: float = 0.0  # standard deviation of extra delay (clipped at 0, order kept)
    bandwidth_mbps: float | None = None  # megabits per second; None = unlimited
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError("delay and jitter must be >= 0")
        if self.bandwidth_mbps is not None and self.bandwidth_mbps <= 0:
            raise ValueError("bandwidth must be > 0 (or None for unlimited)")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """An event loop with microsecond timer resolution (see module docstring)."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Timer:
    """Wakes up at a deadline without a fixed bias and without spinning.

    Even with microsecond select timeouts, a wake-up comes late by the kernel's timer slack and
    the scheduler (~0.3 ms measured on a busy 2-core VM). The timer learns that lateness (moving
    average) and sleeps until ``deadline - lateness``, so wake-ups land on the deadline on
    average, a fraction of a millisecond either side. It used to yield to the loop from there
    until the deadline: that busy-wait cost ~2 ms of CPU per delivered piece (measured: 4 ms per
    round trip through one proxy), 7-12% of a core in the head's process during 4-client
    cells of a 4-stage ring, taken from the ring it measured; and its lateness estimate only ever grew (it
    added each wake-up's lateness to the estimate instead of averaging it), so it sat at the
    2 ms bound and every delivery spun for ~2 ms.
    """

    def __init__(self) -> None:
        self.lateness = 2e-4

    async def wait_until(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        ahead = deadline - loop.time() - self.lateness
        if ahead > 0:
            await asyncio.sleep(ahead)
            late = loop.time() - (deadline - self.lateness)  # past the planned wake-up
            # Bounded so one long stall (GC, preemption) cannot make every later wake-up early.
            self.lateness = min(2e-3, max(0.0, 0.8 * self.lateness + 0.2 * late))


class _Direction:
    """Bytes from one socket to the other, delayed and paced."""

    def __init__(self, spec: LinkSpec, rng: random.Random, timer: _Timer) -> None:
        self.spec = spec
        self.rng = rng
        self.timer = timer
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        # Bound the buffer: bandwidth-delay product plus slack, so a fast sender is held back
        # by TCP flow control instead of filling our memory.
        bdp = (spec.bandwidth_mbps or 1000) * 1e6 / 8 * (spec.delay_ms + 4 * spec.jitter_ms + 50) / 1e3
        self.limit = int(max(4 * CHUNK, bdp))
        self.wire_free = 0.0
        self.last_delivery = 0.0
        self.bytes = 0

    def schedule(self, now: float, data: bytes) -> None:
        s = self.spec
        if s.bandwidth_mbps is not None:
            start = max(now, self.wire_free)
            self.wire_free = start + len(data) * 8 / (s.bandwidth_mbps * 1e6)
            t = self.wire_free
        else:
            t = now
        t += s.delay_ms / 1e3
        if s.jitter_ms:
            t += max(0.0, self.rng.gauss(0.0, s.jitter_ms / 1e3))
        t = max(t, self.last_delivery)
        self.last_delivery = t
        self.queue.append((t, data))
        self.queued += len(data)

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        room = asyncio.Event()
        room.set()
        done = False

        async def read_side() -> None:
            nonlocal done
            piece = PACED_CHUNK if self.spec.bandwidth_mbps else CHUNK
            try:
                while True:
                    await room.wait()
                    data = await reader.read(CHUNK)
                    if not data:
                        break
                    now = loop.time()
                    for i in range(0, len(data), piece):
                        self.schedule(now, data[i : i + piece])
                    if self.queued >= self.limit:
                        room.clear()
                    wake.set()
            finally:
                done = True
                wake.set()

        async def write_side() -> None:
            while True:
                if not self.queue:
                    if done:
                        break
                    wake.clear()
                    await wake.wait()
                    continue
                t, data = self.queue[0]
                await self.timer.wait_until(loop, t)
                self.queue.popleft()
                self.queued -= len(data)
                if self.queued < self.limit:
                    room.set()
                writer.write(data)
                self.bytes += len(data)
                await writer.drain()
            if writer.can_write_eof():
                with contextlib.suppress(Exception):
                    writer.write_eof()  # pass the half-close on, after the delayed bytes

        reader_task = asyncio.ensure_future(read_side())
        try:
            await write_side()
        finally:
            reader_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await reader_task


class LinkEmulator:
    """A listening proxy to ``target`` that applies ``spec`` to every connection through it."""

    def __init__(self, target: tuple[str, int], spec: LinkSpec, listen: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.target = target
        self.spec = spec
        self.listen = listen
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._rng = random.Random(spec.seed)
        self._timer = _Timer()
        self.connections = 0
        self.bytes_forwarded = 0

    @property
    def address(self) -> tuple[str, int]:
        """Where to connect instead of the target."""
        if self._server is None:
            raise RuntimeError("emulator not started")
        return self._server.sockets[0].getsockname()[:2]

    async def start(self) -> tuple[str, int]:
        """Start listening; returns the proxy address."""
        self._server = await asyncio.start_server(self._handle, *self.listen)
        return self.address

    async def close(self) -> None:
        """Stop listening and cut every proxied connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        # Abort the sockets rather than cancel the handler tasks: each handler then sees a
        # reset, closes its other side and ends on its own.
        for w in list(self._writers):
            w.transport.abort()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self.connections += 1
        _nodelay(c_writer)
        self._writers.add(c_writer)
        try:
            try:
                u_reader, u_writer = await asyncio.open_connection(*self.target)
            except OSError:
                c_writer.close()
                return
            _nodelay(u_writer)
            self._writers.add(u_writer)
            up = _Direction(self.spec, self._rng, self._timer)
            down = _Direction(self.spec, self._rng, self._timer)
            try:
                await asyncio.gather(up.pump(c_reader, u_writer), down.pump(u_reader, c_writer))
            except (ConnectionError, OSError):
                pass  # one side reset: close both below
            finally:
                self.bytes_forwarded += up.bytes + down.bytes
                for w in (u_writer, c_writer):
                    w.close()
                for w in (u_writer, c_writer):
                    with contextlib.suppress(Exception):
                        await w.wait_closed()
                self._writers.discard(u_writer)
        finally:
            self._writers.discard(c_writer)
            if task is not None:
                self._tasks.discard(task)


class LinkEmulatorThread:
    """Runs link emulators on a private event loop in a background thread (for blocking code).

    >>> with LinkEmulatorThread() as emu:                       # doctest: +SKIP
    ...     host, port = emu.add(("127.0.0.1", stage1_port), LinkSpec(delay_ms=10))
    """

    def __init__(self) -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="linkemu", daemon=True)
        self._emulators: list[LinkEmulator] = []
        self._thread.start()

    @property
    def native_id(self) -> int:
        """The loop thread's OS id (its CPU use is in ``/proc/self/task/<id>/stat``)."""
        tid = self._thread.native_id
        assert tid is not None  # set once the thread started, which __init__ did
        return tid

    def cpu_s(self) -> float:
        """CPU seconds the proxies' thread has used so far (Linux)."""
        return thread_cpu_s(self.native_id)

    def add(self, target: tuple[str, int], spec: LinkSpec, listen: tuple[str, int] = ("127.0.0.1", 0)) -> tuple[str, int]:
        """Start a proxy to ``target``; returns its address."""
        emu = LinkEmulator(target, spec, listen)
        addr = asyncio.run_coroutine_threadsafe(emu.start(), self._loop).result(10)
        self._emulators.append(emu)
        return addr

    def close(self) -> None:
        """Stop every proxy and the loop."""
        if not self._loop.is_running():
            return
        for emu in self._emulators:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(emu.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> LinkEmulatorThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def emulated_links(targets: Sequence[tuple[str, int]], spec: LinkSpec) -> Iterator[list[tuple[str, int]]]:
    """One proxy per ring link: yields the addresses to use instead of ``targets``."""
    with LinkEmulatorThread() as emu:
        yield [emu.add(t, spec) for t in targets]


# ----------------------------------------------------------------------------- self-check


class _EchoServer:
    """Blocking echo server on loopback (the far end of the measured link)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(c,), daemon=True).start()

    @staticmethod
    def _echo(c: socket.socket) -> None:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with c:
            while data := c.recv(CHUNK):
                c.sendall(data)

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def _rtts(address: tuple[str, int], n: int, size: int = 64) -> list[float]:
    with socket.create_connection(address) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = b"x" * size
        out = []
        for _ in range(n + 2):
            t0 = time.perf_counter()
            s.sendall(msg)
            got = 0
            while got < size:
                got += len(s.recv(CHUNK))
            out.append(time.perf_counter() - t0)
        return out[2:]  # drop connection warm-up


def thread_cpu_s(native_id: int) -> float:
    """User+system CPU seconds of one thread of this process (Linux ``/proc``)."""
    stat = Path(f"/proc/self/task/{native_id}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_check(delays_ms: Sequence[float] = (5, 10, 25, 50), pings: int = 15, bandwidth_mbps: float = 40.0, tolerance: float = 0.10, cpu_pings: int = 300) -> dict:
    """Measure added round trip per delay, the proxy's own CPU per round trip and throughput
    under a cap; returns a JSON-able report."""
    echo = _EchoServer()
    report: dict = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "tolerance": tolerance,
        "delay": [],
    }
    ok = True
    try:
        base = statistics.median(_rtts(echo.address, pings * 2))
        report["baseline_rtt_ms"] = round(base * 1e3, 4)
        with LinkEmulatorThread() as emu:
            for d in delays_ms:
                proxy = emu.add(echo.address, LinkSpec(delay_ms=d))
                rtt = statistics.median(_rtts(proxy, pings))
                added = (rtt - base) * 1e3
                target = 2 * d
                err = (added - target) / target
                passed = abs(err) <= tolerance
                ok &= passed
                report["delay"].append({"one_way_ms": d, "target_added_rtt_ms": target, "measured_added_rtt_ms": round(added, 3), "error": round(err, 4), "pass": passed})
            # The proxy's own CPU: on one host it shares the cores with the ring it slows down.
            # Many round trips, as the kernel counts CPU time in whole ticks (10 ms).
            proxy = emu.add(echo.address, LinkSpec(delay_ms=min(delays_ms)))
            cpu0 = emu.cpu_s()
            trips = len(_rtts(proxy, cpu_pings)) + 2  # with the 2 warm-up trips
            report["proxy_cpu_ms_per_round_trip"] = round((emu.cpu_s() - cpu0) * 1e3 / trips, 3)
            # Bandwidth: push 2 MB one way through a capped link, time until the echo is back.
            size = 2 * 1024 * 1024
            proxy = emu.add(echo.address, LinkSpec(bandwidth_mbps=bandwidth_mbps))
            with socket.create_connection(proxy) as s:
                payload = os.urandom(size)
                t0 = time.perf_counter()
                sender = threading.Thread(target=s.sendall, args=(payload,))
                sender.start()
                got = bytearray()
                while len(got) < size:
                    got += s.recv(CHUNK)
                elapsed = time.perf_counter() - t0
                sender.join()
            # Each byte crosses the capped link twice, but the two directions are separate
            # wires working in parallel, so the transfer takes ~ size / bandwidth.
            mbps = size * 8 / elapsed / 1e6
            err = (mbps - bandwidth_mbps) / bandwidth_mbps
            passed = abs(err) <= tolerance and bytes(got) == payload
            ok &= passed
            report["bandwidth"] = {"cap_mbps": bandwidth_mbps, "measured_mbps": round(mbps, 2), "error": round(err, 4), "intact": bytes(got) == payload, "pass": passed}
    finally:
        echo.close()
    report["pass"] = ok
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.linkemu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--self-check", action="store_true",
                    help="measure the added RTT at 5/10/25/50 ms, the proxy's CPU per round trip and a bandwidth cap")
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (proxy mode)")
    ap.add_argument("--target", help="HOST:PORT to forward to (proxy mode)")
    ap.add_argument("--link", action="append", default=[], metavar="LISTEN=TARGET",
                    help="one more proxy, HOST:PORT=HOST:PORT (repeatable; all with the same "
                         "delay, jitter and bandwidth)")
    ap.add_argument("--delay-ms", type=float, default=0.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--bandwidth-mbps", type=float, default=None)
    args = ap.parse_args(argv)
    if args.self_check:
        report = self_check()
        print(json.dumps(report, indent=2))
        return 0 if report["pass"] else 1
    if not args.target and not args.link:
        ap.error("--target or --link is required unless --self-check")
    spec = LinkSpec(args.delay_ms, args.jitter_ms, args.bandwidth_mbps)

    def address(s: str) -> tuple[str, int]:
        host, port = s.rsplit(":", 1)
        return host, int(port)

    pairs = [(address(args.listen), address(args.target))] if args.target else []
    for link in args.link:
        listen, _, target = link.partition("=")
        if not target:
            ap.error(f"--link {link!r}: want LISTEN_HOST:PORT=TARGET_HOST:PORT")
        pairs.append((address(listen), address(target)))

    async def run() -> None:
        links = []
        for listen, target in pairs:
            addr = await LinkEmulator(target, spec, listen).start()
            links.append({"listening": list(addr), "target": list(target)})
        # One line once every proxy listens: the caller waits for it.
        print(json.dumps({"links": links, "spec": asdict(spec)}), flush=True)
        await asyncio.Event().wait()

    loop = new_event_loop()
    try:
        loop.run_until_complete(run())
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
