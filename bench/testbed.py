"""Where a ring's speed is measured: the lab (a device per network namespace, each on its own
CPU share) or, where no lab can be built, all-in-one on this host, labelled as such.

The lab (``Testbed``, root only) is ``tests/lab.py``'s ``HomeLab``: ``devices`` devices, each a
network namespace on one bridge with its own CPU quota (``device_share`` of a core over 10 ms
CFS periods) and EDGESPEC_HOME, an ``edgespec node`` in it advertising over mDNS; the head in
a namespace of its own on ``head_share`` of a core (a desktop beside small boxes). Links are
emulated by ``bench.linkemu`` in one more namespace on the bridge, outside every share (its own
CPU time is reported): each device is reached through a port of the emulator there, so every
connection to a device, the head's and the previous device's, crosses one emulated link. The
head finds the devices over mDNS and forms the ring with that address map as its ``proxy``.

Named link profiles (``LINKS``): ``wired`` 1 ms one way, ``wifi`` 5 ms with 2 ms jitter and
50 Mbit/s, ``sites`` 50 ms; a number is a plain delay in ms. A lap crosses devices + 1 links.
Bandwidth is capped per connection (a Wi-Fi medium shared by every link is not modelled).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.linkemu import LinkSpec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the lab itself (tests/lab.py, tests/netns.py)

import lab as homelab  # noqa: E402

#: A device's CPU time so far, read by the lab's head (``Testbed.usage_paths``).
cpu_usage_us = homelab.cpu_usage_us

EMULATOR_PORT = 7100  # the emulator's port for device i is EMULATOR_PORT + i

LINKS: dict[str, LinkSpec] = {
    "loopback": LinkSpec(delay_ms=0.0),
    "wired": LinkSpec(delay_ms=1.0),
    "wifi": LinkSpec(delay_ms=5.0, jitter_ms=2.0, bandwidth_mbps=50.0),
    "sites": LinkSpec(delay_ms=50.0),
}


def link_spec(name: str) -> LinkSpec:
    """A named profile of ``LINKS``, or a plain one-way delay in ms."""
    if name in LINKS:
        return LINKS[name]
    try:
        return LinkSpec(delay_ms=float(name))
    except ValueError:
        raise ValueError(f"unknown link {name!r}: one of {', '.join(LINKS)} or a delay in "
                         f"ms") from None


def link_label(name: str) -> str:
    spec = link_spec(name)
    parts = [f"{spec.delay_ms:g} ms"]
    if spec.jitter_ms:
        parts.append(f"±{spec.jitter_ms:g} ms jitter")
    if spec.bandwidth_mbps:
        parts.append(f"{spec.bandwidth_mbps:g} Mbit/s")
    return ", ".join(parts)


def lab_skip_reason() -> str | None:
    """Why no lab can be built here (so the all-in-one mode runs instead), or None."""
    return homelab.skip_reason()


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Testbed:
    """The lab for one benchmark run (see the module docstring)."""

    def __init__(self, workdir: Path, *, devices: int = 3, device_share: float | None = 0.3,
                 head_share: float | None = 0.9) -> None:
        self.workdir = workdir
        self.names = [f"n{i + 1}" for i in range(devices)]
        self.device_share = device_share
        self.head_share = head_share
        self.lab = homelab.HomeLab(self.names, workdir, head_share=head_share,
                                   plain=("wire",))
        self.key_file = workdir / "ring.key"
        self._single_cg: homelab.Cgroup | None = None

    def __enter__(self) -> Testbed:
        from edgespec.llm import models
        from edgespec.wire import auth

        self.workdir.mkdir(parents=True, exist_ok=True)
        auth.write_key(self.key_file)
        self.lab.__enter__()
        try:
            # The head shares this host's model cache (the models and the draft model's
            # quantized copy are made once); its ring state stays its own.
            (self.lab.head_home / "models").symlink_to(models.models_dir())
            for n in self.names:
                self.lab.device(n).cap(cpu_share=self.device_share)
            for n in self.names:
                self.lab.device(n).start_node(self.key_file, self.workdir)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.lab.close()
        if self._single_cg is not None:
            self._single_cg.close()

    def describe(self) -> dict[str, Any]:
        return {"where": "lab", "devices": len(self.names),
                "device_cpu_share": self.device_share, "head_cpu_share": self.head_share,
                "cfs_period_us": homelab.CFS_PERIOD_US,
                "cgroups": "v2" if self.lab.device(self.names[0]).cgroup.v2 else "v1"}

    def usage_paths(self) -> dict[str, list]:
        """Each device's CPU-time file and share of a core, for ``cpu_usage_us`` in another
        process (the lab's head)."""
        return {n: [str(self.lab.device(n).cgroup.usage_path), self.device_share]
                for n in self.names}

    def device_cpu(self) -> dict[str, dict[str, int]]:
        """Each device's (and the head's) CPU accounting: usage and throttling."""
        out = {n: self.lab.device(n).cgroup.cpu_stat() for n in self.names}
        if self.lab.head_cgroup is not None:
            out["head"] = self.lab.head_cgroup.cpu_stat()
        return out

    @contextlib.contextmanager
    def links(self, name: str) -> Iterator[LinkEmulatorProcess]:
        """An emulator in the wire namespace with one ``name`` link to each device."""
        wire = self.lab.hosts["wire"]
        routes = {self.lab.device(n).host.address: (wire.address, EMULATOR_PORT + i)
                  for i, n in enumerate(self.names)}
        emu = LinkEmulatorProcess(wire, routes, link_spec(name), self.workdir / f"links-{name}")
        try:
            yield emu
        finally:
            emu.close()

    def head_popen(self, argv: list[str], **kw) -> subprocess.Popen:
        return self.lab.head_popen(argv, **kw)

    def device_popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """``argv`` on a device's CPU share but outside the lab's devices (the unsplit model
        as one such device would run it)."""
        if self._single_cg is None:
            self._single_cg = homelab.Cgroup(f"edgespec-lab-single-{os.getpid()}")
            self._single_cg.cap(cpu_share=self.device_share)
        kw.setdefault("env", homelab.env_for(self.lab.head_home))
        return subprocess.Popen(self._single_cg.wrap(argv), cwd=REPO, **kw)


class LinkEmulatorProcess:
    """``python -m bench.linkemu`` in the wire namespace, one proxy per device: ``routes``
    maps a device's address to the emulator's (host, port) in front of it."""

    def __init__(self, wire: Any, routes: dict[str, tuple[str, int]], spec: LinkSpec,
                 log_stem: Path) -> None:
        self.routes = routes
        self.spec = spec
        argv = [sys.executable, "-m", "bench.linkemu", "--delay-ms", str(spec.delay_ms),
                "--jitter-ms", str(spec.jitter_ms)]
        if spec.bandwidth_mbps:
            argv += ["--bandwidth-mbps", str(spec.bandwidth_mbps)]
        for device, (host, port) in routes.items():
            argv += ["--link", f"{host}:{port}={device}:{homelab.PORT}"]
        self.err = log_stem.with_suffix(".err")
        with open(self.err, "w") as fe:
            self.proc = subprocess.Popen(homelab.enter(wire, None, argv), cwd=REPO,
                                         stdout=subprocess.PIPE, stderr=fe, text=True)
        ready = self.proc.stdout.readline() if self.proc.stdout else ""
        if not ready:
            raise RuntimeError(f"link emulator did not start: {self.err.read_text()[-2000:]}")
        self.cpu_at_start = self.cpu_s()
        self.wall_at_start = time.monotonic()

    def proxy_map(self) -> dict[str, list]:
        """What a head takes as its ``proxy``: device address -> emulator address."""
        return {k: list(v) for k, v in self.routes.items()}

    def cpu_s(self) -> float:
        return proc_cpu_s(self.proc.pid)

    def usage(self) -> dict[str, Any]:
        """The emulator's own CPU since it started: seconds and share of one core."""
        cpu = self.cpu_s() - self.cpu_at_start
        wall = time.monotonic() - self.wall_at_start
        return {"cpu_s": round(cpu, 2), "wall_s": round(wall, 1),
                "cpu_share": round(cpu / wall, 4) if wall else None,
                "spec": asdict(self.spec)}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def proxy_from_map(mapping: dict[str, list]):
    """The head's ``proxy`` for a map of ``LinkEmulatorProcess.proxy_map``: a device's
    address to the emulator's port in front of it (any other address unchanged)."""

    def proxy(addr: tuple[str, int]) -> tuple[str, int]:
        via = mapping.get(str(addr[0]))
        return (str(via[0]), int(via[1])) if via else (str(addr[0]), int(addr[1]))

    return proxy
