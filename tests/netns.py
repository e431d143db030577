"""Throwaway virtual LANs for tests: N network namespaces ("hosts") on one bridge.

Layout: a private "switch" namespace holds a bridge; each host namespace gets ``eth0`` (a veth
pair whose other end is enslaved to the bridge) with an address in ``10.231.0.0/24``, plus
loopback with multicast enabled. Because the bridge and every veth live inside namespaces we
create, nothing touches the host's own network and concurrent labs cannot clash; deleting the
namespaces removes everything.

Cleanup runs on context exit, at interpreter exit, and for namespaces left over by a crashed
earlier run (their owning pid is encoded in the name and is no longer alive).

Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2's ``ip`` (Debian package
``iproute2``); ``skip_reason()`` says which is missing so tests can skip with that reason.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

SUBNET_PREFIX = "10.231.0."
_NAME_RE = re.compile(r"^esn(\d+)x[0-9a-f]{6}-")
_live_labs: set[NetnsLab] = set()


def skip_reason() -> str | None:
    """Why namespace tests cannot run here, or None if they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run the netns tests as root)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command not found (apt-get install iproute2)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_netns(name: str) -> None:
    """Kill what runs inside a namespace we created, then delete it."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for p in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(p), signal.SIGKILL)
    _ip("netns", "delete", name, check=False)


def remove_stale() -> list[str]:
    """Delete namespaces made by earlier lab runs whose process is gone; return their names."""
    removed = []
    for name in _netns_names():
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _delete_netns(name)
            removed.append(name)
    return removed


@dataclass
class Host:
    """One namespace on the lab bridge."""

    name: str  # short label, e.g. "n1"
    netns: str  # namespace name
    address: str  # IPv4 on eth0
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], *, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
        """Run a command inside the namespace and wait for it."""
        res = subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, **kw)
        if check and res.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(argv)} exited {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr}")
        return res

    def popen(self, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start a process inside the namespace (killed at lab cleanup if still running)."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        p = subprocess.Popen(self.command(argv), **kw)  # `ip netns exec` execs argv: same pid
        self.procs.append(p)
        return p


class NetnsLab:
    """``with NetnsLab(3) as lab: lab.hosts[0].run([...])`` — N hosts on one bridge."""

    def __init__(self, n_hosts: int, *, names: Sequence[str] | None = None) -> None:
        if not 1 <= n_hosts <= 200:
            raise ValueError("n_hosts must be in 1..200")
        if names is not None and len(names) != n_hosts:
            raise ValueError("need one name per host")
        self.tag = f"esn{os.getpid()}x{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.tag}-sw"
        labels = list(names) if names is not None else [f"h{i}" for i in range(n_hosts)]
        self.hosts = [Host(label, f"{self.tag}-{label}", f"{SUBNET_PREFIX}{10 + i}") for i, label in enumerate(labels)]
        self._created: list[str] = []

    def __enter__(self) -> NetnsLab:
        reason = skip_reason()
        if reason:
            raise RuntimeError(reason)
        remove_stale()
        _live_labs.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._created.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        # mDNS is link-local multicast; keep the bridge from filtering it by IGMP snooping.
        with contextlib.suppress(RuntimeError):
            _ip("-n", self.switch, "link", "set", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts):
            _ip("netns", "add", h.netns)
            self._created.append(h.netns)
            port = f"p{i}"
            _ip("-n", h.netns, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("-n", h.netns, "link", "set", "lo", "multicast", "on")
        self._wait_carrier()

    def _wait_carrier(self, timeout: float = 5.0) -> None:
        """Wait until every eth0 is operational (veths take a moment to come up)."""
        deadline = time.monotonic() + timeout
        for h in self.hosts:
            while True:
                state = _ip("-n", h.netns, "-o", "link", "show", "eth0").stdout
                if "LOWER_UP" in state or time.monotonic() > deadline:
                    break
                time.sleep(0.05)

    def close(self) -> None:
        """Stop every process started in the lab and delete its namespaces. Idempotent."""
        for h in self.hosts:
            for p in h.procs:
                if p.poll() is None:
                    p.terminate()
            for p in h.procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
            h.procs.clear()
        for name in reversed(self._created):
            _delete_netns(name)
        self._created.clear()
        _live_labs.discard(self)


@atexit.register
def _cleanup_at_exit() -> None:
    for lab in list(_live_labs):
        with contextlib.suppress(Exception):
            lab.close()
