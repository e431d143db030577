"""A home lab in a box for tests and benchmarks: N devices, each a network namespace on one
bridge (``netns.NetnsLab``) with its own memory cap and CPU quota (a cgroup, v1 or v2), its own
EDGESPEC_HOME, and an `edgespec node` that finds the head over mDNS like a real device. The head
has a namespace of its own (and, with ``head_share``, a CPU quota too); ``plain`` names further
namespaces on the bridge without a cgroup (a link emulator's, outside every device's share).

CPU quotas use a short CFS period (``CFS_PERIOD_US``, 4 ms; longer where a share's quota
would fall under the kernel's 1 ms minimum): a device held to 30% of a core then runs at that
rate within every few milliseconds, as a slow device does. With a longer period an idle device
bursts at full speed for its whole quota before it is throttled, which flatters whatever leaves
devices idle between short decodes: on the 1.5B ring (docs/experiments.md 20) one client's lap
took 151 ms over 10 ms periods, less than its stages' own CPU time (50 ms a token) takes at
30% of a core (167 ms), and 174 ms over 4 ms periods (52 ms of CPU: 173 ms).

    with HomeLab(["n1", "n2", "n3"], tmp_path) as lab:
        lab.device("n3").cap(memory_mib=330, cpu_share=0.25)
        lab.start_nodes(key_file)
        print(lab.head_run([... "ring", "up", "--nodes", "auto", ...]))

``skip_reason()`` says why a lab cannot be built here (not root, no `ip`, no writable cgroup
hierarchy) so tests skip with that reason. Everything a lab makes (namespaces, cgroups,
processes) is removed when it closes.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import netns

REPO = Path(__file__).resolve().parent.parent
PORT = 7654
CFS_PERIOD_US = 4_000
#: The kernel's smallest CFS quota.
MIN_QUOTA_US = 1_000


def cpu_usage_us(path: Path | str) -> int | None:
    """CPU time spent in a cgroup so far, read off its ``Cgroup.usage_path`` (v1's
    ``cpuacct.usage`` in ns, v2's ``cpu.stat`` line ``usage_usec``); None where unreadable."""
    with contextlib.suppress(OSError, ValueError):
        text = Path(path).read_text()
        if Path(path).name == "cpu.stat":
            m = re.search(r"^usage_usec (\d+)", text, re.M)
            return int(m.group(1)) if m else None
        return int(text) // 1000
    return None


class Cgroup:
    """One cgroup holding a memory limit and a CPU quota: on a unified (v2) hierarchy one
    directory, on v1 one in each of the memory and cpu hierarchies."""

    def __init__(self, name: str) -> None:
        self.name = name
        root = Path("/sys/fs/cgroup")
        ctrl = root / "cgroup.controllers"
        self.v2 = ctrl.exists() and {"memory", "cpu"} <= set(ctrl.read_text().split())
        if self.v2:
            sub = root / "cgroup.subtree_control"
            with contextlib.suppress(OSError):
                sub.write_text("+memory +cpu")
            self.dirs = [root / name]
        else:
            self.dirs = [root / "memory" / name, root / "cpu" / name]
            if (root / "cpuacct").is_dir() and not (root / "cpuacct").samefile(root / "cpu"):
                self.dirs.append(root / "cpuacct" / name)
        for d in self.dirs:
            d.mkdir()

    def cap(self, memory_mib: int | None = None, cpu_share: float | None = None,
            period_us: int = CFS_PERIOD_US) -> None:
        """Set (or, with None, lift) the memory limit and the CPU share (1.0 = one core) over
        CFS periods of ``period_us``."""
        mem = "max" if memory_mib is None else str(memory_mib << 20)
        if cpu_share is not None:
            period_us = max(period_us, math.ceil(MIN_QUOTA_US / cpu_share))
        quota = -1 if cpu_share is None else int(cpu_share * period_us)
        if self.v2:
            (self.dirs[0] / "memory.max").write_text(mem)
            (self.dirs[0] / "cpu.max").write_text(
                f"{'max' if quota < 0 else quota} {period_us}")
        else:
            (self.dirs[0] / "memory.limit_in_bytes").write_text(
                "-1" if memory_mib is None else mem)
            (self.dirs[1] / "cpu.cfs_quota_us").write_text("-1")  # a period may shrink now
            (self.dirs[1] / "cpu.cfs_period_us").write_text(str(period_us))
            (self.dirs[1] / "cpu.cfs_quota_us").write_text(str(quota))

    def cpu_stat(self) -> dict[str, int]:
        """The kernel's CPU accounting here: ``nr_periods``, ``nr_throttled`` and
        ``throttled_us`` (v1's ``throttled_time`` is in ns), and ``usage_us`` where kept."""
        d = self.dirs[0] if self.v2 else self.dirs[1]
        out: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):
            for line in (d / "cpu.stat").read_text().splitlines():
                k, v = line.split()
                out[k] = int(v)
        if "throttled_time" in out:
            out["throttled_us"] = out.pop("throttled_time") // 1000
        if not self.v2:
            usage = cpu_usage_us(self.usage_path)
            if usage is not None:
                out["usage_us"] = usage
        return out

    @property
    def usage_path(self) -> Path:
        """The file that counts this cgroup's CPU time (``cpu_usage_us`` reads it)."""
        if self.v2:
            return self.dirs[0] / "cpu.stat"
        return Path("/sys/fs/cgroup/cpuacct") / self.name / "cpuacct.usage"

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` started inside this cgroup (it joins before it runs, so every byte it
        allocates is charged here)."""
        joins = " && ".join(f"echo $$ > {d}/cgroup.procs" for d in self.dirs)
        return ["sh", "-c", f'{joins} && exec "$@"', "sh", *argv]

    def oom_kills(self) -> int:
        """Processes the kernel killed here for memory."""
        f = self.dirs[0] / ("memory.events" if self.v2 else "memory.oom_control")
        with contextlib.suppress(OSError, ValueError):
            m = re.search(r"oom_kill (\d+)", f.read_text())
            return int(m.group(1)) if m else 0
        return 0

    def peak_mib(self) -> int:
        """The most memory charged here at once (page cache included), in MiB; -1 where the
        kernel does not keep it (v2 before Linux 5.19)."""
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            with contextlib.suppress(OSError, ValueError):
                return int((self.dirs[0] / name).read_text().split()[0]) >> 20
        return -1

    def close(self) -> None:
        for d in self.dirs:
            procs = d / "cgroup.procs"
            with contextlib.suppress(OSError):
                for pid in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def skip_reason() -> str | None:
    """Why a home lab cannot be built here, or None."""
    reason = netns.skip_reason()
    if reason:
        return reason
    if shutil.which("nsenter") is None:
        return "util-linux's `nsenter` not found (apt-get install util-linux)"
    try:
        Cgroup(f"edgespec-probe-{uuid.uuid4().hex[:6]}").close()
    except OSError as e:
        return f"cannot create cgroups here ({e}): needs root and a writable cgroup hierarchy"
    return None


def stop_process(p: subprocess.Popen, timeout: float = 30) -> int | None:
    """SIGTERM ``p`` and wait ``timeout`` s for it, then SIGKILL; its exit status."""
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
    return p.returncode


def edgespec() -> list[str]:
    exe = Path(sys.executable).with_name("edgespec")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "edgespec"]


def enter(host: netns.Host, cgroup: Cgroup | None, argv: list[str]) -> list[str]:
    """``argv`` run in ``host``'s network namespace and (unless None) in ``cgroup``."""
    argv = ["nsenter", f"--net=/run/netns/{host.netns}", "--", *argv]
    return cgroup.wrap(argv) if cgroup is not None else argv


def env_for(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["EDGESPEC_HOME"] = str(home)
    env.pop("EDGESPEC_KEY_FILE", None)
    env["OMP_WAIT_POLICY"] = "passive"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Device:
    """One device of the lab: its namespace, cgroup, home and node process."""

    name: str
    host: netns.Host
    cgroup: Cgroup
    home: Path
    node: subprocess.Popen | None = None
    logs: tuple[Path, Path] = field(default=(Path(), Path()))

    def cap(self, memory_mib: int | None = None, cpu_share: float | None = None) -> None:
        self.cgroup.cap(memory_mib, cpu_share)

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` run in this device: its cgroup, then its network namespace only
        (``nsenter``: ``ip netns exec`` would also mount a sysfs of its own, where a process
        could not read its cgroup's limit as a container's process can)."""
        return enter(self.host, self.cgroup, argv)

    def start_node(self, key_file: Path, workdir: Path, timeout: float = 60,
                   prefix: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> None:
        """Start (or restart) this device's node and wait until it advertises; ``prefix``
        runs before it (e.g. ``unshare`` for a mount namespace of its own), ``extra`` are
        more of its options."""
        out, err = workdir / f"{self.name}.out", workdir / f"{self.name}.err"
        self.logs = (out, err)
        # The logs are appended to: a restarted node is up once it says so after this point.
        seen = err.stat().st_size if err.exists() else 0
        argv = [*prefix, *edgespec(), "node", "--key-file", str(key_file), "--name", self.name,
                "--bind", "0.0.0.0", "--port", str(PORT), "--threads", "1", *extra]
        with open(out, "a") as fo, open(err, "a") as fe:
            self.node = subprocess.Popen(self.enter(argv), env=env_for(self.home), cwd=REPO,
                                         stdout=fo, stderr=fe, text=True)
        self.host.procs.append(self.node)
        deadline = time.monotonic() + timeout
        pattern = re.compile(rf"advertising {self.name}\.")
        while not pattern.search(err.read_bytes()[seen:].decode(errors="replace")):
            if self.node.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: node did not start:\n"
                                     f"{err.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def stop_node(self) -> None:
        if self.node is not None:
            stop_process(self.node)


class HomeLab:
    """A head and N devices on one bridge (see the module docstring)."""

    def __init__(self, names: list[str], workdir: Path, *, head_share: float | None = None,
                 plain: tuple[str, ...] = ()) -> None:
        self.names = names
        self.workdir = workdir
        self.head_share = head_share
        self.net = netns.NetnsLab(len(names) + 1 + len(plain), names=["head", *names, *plain])
        self.devices: dict[str, Device] = {}
        self.head_home = workdir / "home-head"
        self.head_cgroup: Cgroup | None = None
        self.hosts: dict[str, netns.Host] = {}

    def __enter__(self) -> HomeLab:
        self.net.__enter__()
        tag = uuid.uuid4().hex[:6]
        try:
            self.hosts = {h.name: h for h in self.net.hosts}
            self.head = self.hosts["head"]
            self.head_home.mkdir(parents=True, exist_ok=True)
            if self.head_share is not None:
                self.head_cgroup = Cgroup(f"edgespec-lab-{tag}-head")
                self.head_cgroup.cap(cpu_share=self.head_share)
            for n in self.names:
                home = self.workdir / f"home-{n}"
                home.mkdir(parents=True, exist_ok=True)
                self.devices[n] = Device(n, self.hosts[n], Cgroup(f"edgespec-lab-{tag}-{n}"),
                                         home)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def device(self, name: str) -> Device:
        return self.devices[name]

    def start_nodes(self, key_file: Path) -> None:
        for d in self.devices.values():
            d.start_node(key_file, self.workdir)

    def head_run(self, argv: list[str], timeout: float = 600, check: bool = True,
                 ) -> subprocess.CompletedProcess[str]:
        res = self.head.run(argv, env=env_for(self.head_home), cwd=REPO, timeout=timeout,
                            check=False)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(argv[:4])}... exited {res.returncode}:\n"
                                 f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return res

    def head_popen(self, argv: list[str], **kw) -> subprocess.Popen:
        """Start ``argv`` as the head: its namespace, its CPU share (``head_share``), its
        EDGESPEC_HOME (stopped when the lab closes)."""
        kw.setdefault("env", env_for(self.head_home))
        p = subprocess.Popen(enter(self.head, self.head_cgroup, argv), cwd=REPO, **kw)
        self.head.procs.append(p)
        return p

    def close(self) -> None:
        for d in self.devices.values():
            with contextlib.suppress(Exception):
                d.stop_node()
        self.net.close()
        for d in self.devices.values():
            d.cgroup.close()
        if self.head_cgroup is not None:
            self.head_cgroup.close()
