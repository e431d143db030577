"""What a node tells the LAN about itself: id, backend, free memory, cached model fingerprints.

Everything here is public by design (it goes into mDNS TXT records): no paths, no key material.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path

FINGERPRINT_HEX = 16  # 64 bits of sha256: enough to tell models apart, short for TXT records
_STAMP_SUFFIXES = (".verified", ".sha256")  # models.py writes .verified; we cache our own hash in .sha256


def free_ram_bytes() -> int:
    """Memory this process may still take: the smaller of what the machine has available
    (Linux MemAvailable; sysconf elsewhere) and the room its cgroup's memory limit leaves
    (a container's ``--memory``, a systemd ``MemoryMax``: ``cgroup_room``). On unified-memory
    devices (Jetson) the GPU shares this pool, so it is counted here once and not again as
    VRAM (``free_vram_bytes`` says None there)."""
    machine = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    machine = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if not machine:
        try:
            machine = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            machine = 0
    room = cgroup_room()
    return machine if room is None else min(machine, room) if machine else room


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Closing a llama.cpp window frees its buffers, but glibc keeps freed heap memory
    resident for reuse (after a profile, some 20 MiB on the 0.5B), and what stays resident is
    what this node's memory cgroup charges and ``free_ram_bytes`` reports as used. Python's
    cycles go first: what a closed window left in one (a sampler's grammar matchers, which
    hold llguidance's view of the vocabulary, some 20 MiB) would otherwise wait for a
    collection that a quiet node may not run for a long time."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: A cgroup v1 limit at or above this means "no limit" (the kernel's unlimited value is
#: 2**63 rounded down to a page).
_NO_LIMIT = 1 << 62


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text) if text.isdigit() else None


def _stat_field(path: Path, name: str) -> int:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _cgroup_dirs(controller: str, proc_cgroup: str | Path, fs_root: str | Path
                 ) -> Iterator[tuple[bool, Path]]:
    """(cgroup v2?, directory) of this process's cgroup for ``controller`` and of each of its
    ancestors up to the hierarchy's mount, own cgroup first: the v2 hierarchy (``0::path``,
    mounted at ``fs_root``) and the v1 hierarchy holding ``controller`` (mounted at
    ``fs_root/<controller>`` or, where controllers share one, ``fs_root/cpu,cpuacct``-style).
    Nothing when ``proc_cgroup`` cannot be read."""
    fs_root = Path(fs_root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hid == "0" and controllers == "":  # v2: one hierarchy, files in every cgroup
            v2, base = True, fs_root
        elif controller in controllers.split(","):
            v2, base = False, fs_root / controller
            if not base.is_dir() and (fs_root / controllers).is_dir():
                base = fs_root / controllers
        else:
            continue
        here = base / rel.lstrip("/")
        if not here.is_dir():  # in a container the namespace's own cgroup is the mount's root
            here = base
        while True:
            yield v2, here
            if here == base or base not in here.parents:
                break
            here = here.parent


def cgroup_room(proc_cgroup: str | Path = "/proc/self/cgroup",
                fs_root: str | Path = "/sys/fs/cgroup") -> int | None:
    """The room this process's memory cgroups leave: over its cgroup and every ancestor with a
    limit, the smallest limit minus the memory in use (page cache the kernel would reclaim,
    the inactive file pages, is not counted as used). cgroup v2 (``memory.max``,
    ``memory.current``) and v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``). None
    when no limit applies or cgroups cannot be read."""
    rooms: list[int] = []
    for v2, here in _cgroup_dirs("memory", proc_cgroup, fs_root):
        limit_f, usage_f, inactive = (("memory.max", "memory.current", "inactive_file") if v2
                                      else ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                            "total_inactive_file"))
        limit = _read_int(here / limit_f)
        if limit is not None and limit < _NO_LIMIT:
            used = _read_int(here / usage_f) or 0
            used -= min(used, _stat_field(here / "memory.stat", inactive))
            rooms.append(max(0, limit - used))
    return min(rooms) if rooms else None


def cpu_quota(proc_cgroup: str | Path = "/proc/self/cgroup",
              fs_root: str | Path = "/sys/fs/cgroup") -> tuple[float, float] | None:
    """The CFS quota that holds this process: (cores, period in seconds) of the tightest quota
    over its cgroup and every ancestor (0.25 cores: a quarter of one core, run in bursts of
    0.25 x period). v2 ``cpu.max`` ("quota period", "max" for none), v1 ``cpu.cfs_quota_us``
    / ``cpu.cfs_period_us`` (-1 for none). A container's ``--cpus`` and a systemd
    ``CPUQuota`` are such quotas. None when no quota applies or cgroups cannot be read."""
    found: list[tuple[float, float]] = []
    for v2, here in _cgroup_dirs("cpu", proc_cgroup, fs_root):
        if v2:
            try:
                quota, _, period = (here / "cpu.max").read_text().strip().partition(" ")
            except OSError:
                continue
            q, p = (int(quota), int(period)) if quota.isdigit() and period.isdigit() else (0, 0)
        else:
            q = _read_int(here / "cpu.cfs_quota_us") or 0  # -1 (no quota) reads as None
            p = _read_int(here / "cpu.cfs_period_us") or 0
        if q > 0 and p > 0:
            found.append((q / p, p / 1e6))
    return min(found) if found else None


def cpu_quota_cores(proc_cgroup: str | Path = "/proc/self/cgroup",
                    fs_root: str | Path = "/sys/fs/cgroup") -> float | None:
    """The CPU this process's cgroups allow, in cores (``cpu_quota``), or None."""
    quota = cpu_quota(proc_cgroup, fs_root)
    return None if quota is None else quota[0]


def unified_memory(root: str | Path = "/") -> bool:
    """Whether the GPU shares the machine's RAM (NVIDIA Jetson / Tegra boards): the device tree
    names a Tegra SoC or a Jetson board, or L4T's ``/etc/nv_tegra_release`` is there. There
    the GPU's memory is the pool ``free_ram_bytes`` already counts."""
    root = Path(root)
    if (root / "etc/nv_tegra_release").is_file():
        return True
    for name in ("proc/device-tree/model", "proc/device-tree/compatible"):
        try:
            text = (root / name).read_bytes().decode("ascii", "replace").lower()
        except OSError:
            continue
        if "tegra" in text or "jetson" in text:
            return True
    return False


def free_vram_bytes(root: str | Path = "/") -> int | None:
    """Free memory of discrete NVIDIA GPUs (sum over devices), or None where not detectable.

    Unified-memory devices (Apple silicon, Jetson: ``unified_memory``) have no separate VRAM:
    their budget is the free RAM, so None is the honest answer there, and the one pool is
    counted once (a Jetson's ``nvidia-smi``, where there is one, would report that same pool).
    """
    if unified_memory(root):
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
        values = [int(v) for v in out.split() if v.strip().isdigit()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return sum(values) * 1024 * 1024 if values else None


def detect_backend() -> str:
    """'cpu', 'cuda', 'metal', 'vulkan', 'rocm' or 'gpu', from llama.cpp's build.

    ``llama_supports_gpu_offload`` says whether the linked llama.cpp can offload at all; the
    backend libraries shipped next to it say which kind.
    """
    from edgespec.llm.capi import gpu_backend

    return gpu_backend()


def load_or_create_node_id(state_dir: str | os.PathLike[str]) -> str:
    """A stable random node id kept in ``state_dir/node_id`` (created on first use)."""
    d = Path(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    p = d / "node_id"
    try:
        text = p.read_text().strip()
        if len(text) == 16 and all(c in "0123456789abcdef" for c in text):
            return text
    except FileNotFoundError:
        pass
    nid = secrets.token_hex(8)
    tmp = p.with_name(f"node_id.tmp{os.getpid()}")
    tmp.write_text(nid + "\n")
    os.replace(tmp, p)
    return nid


def _read_stamp(path: Path, st: os.stat_result) -> str | None:
    for suffix in _STAMP_SUFFIXES:
        stamp = path.with_name(path.name + suffix)
        try:
            data = json.loads(stamp.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("size") == st.st_size and data.get("mtime_ns") == st.st_mtime_ns:
            digest = data.get("sha256")
            if isinstance(digest, str) and len(digest) == 64:
                return digest
    return None


def model_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a model file, cached in ``<file>.sha256`` (reuses models.py's ``.verified``).

    The cache is keyed by size and mtime, so a changed file is hashed again.
    """
    p = Path(path)
    st = p.stat()
    digest = _read_stamp(p, st)
    if digest is not None:
        return digest
    from edgespec.llm.gguf_read import file_sha256

    digest = file_sha256(p, keep_cached=False)  # at start-up: not left cached on the device
    stamp = p.with_name(p.name + ".sha256")
    try:
        tmp = stamp.with_name(stamp.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
        os.replace(tmp, stamp)
    except OSError:
        pass  # read-only cache: hash again next time
    return digest


def fingerprint(sha256_hex: str) -> str:
    """The short public fingerprint of a model's sha256."""
    return sha256_hex[:FINGERPRINT_HEX]


def model_fingerprints(dirs: Iterable[str | os.PathLike[str]]) -> list[str]:
    """Fingerprints of every ``*.gguf`` directly in (or under ``models/`` of) ``dirs``, sorted."""
    seen: set[str] = set()
    for d in dirs:
        base = Path(d)
        for p in [*base.glob("*.gguf"), *base.glob("models/*.gguf"), *base.glob("shards/**/*.gguf")]:
            if p.is_file():
                seen.add(fingerprint(model_sha256(p)))
    return sorted(seen)


def describe_this_node(
    name: str,
    port: int,
    *,
    node_id: str,
    cache_dirs: Iterable[str | os.PathLike[str]] = (),
    addresses: Iterable[str] = (),
    backend: str | None = None,
):
    """The ``discovery.NodeInfo`` this machine advertises right now."""
    from edgespec.wire.discovery import NodeInfo

    vram = free_vram_bytes()
    return NodeInfo(
        name=name,
        node_id=node_id,
        port=port,
        addresses=tuple(addresses),
        backend=backend or detect_backend(),
        free_ram_mb=free_ram_bytes() // (1024 * 1024),
        free_vram_mb=None if vram is None else vram // (1024 * 1024),
        models=tuple(model_fingerprints(cache_dirs)),
    )
