"""Free memory as a device has it: the smaller of what the machine has available and the room
its memory cgroup leaves (a container's --memory, a systemd MemoryMax), for cgroup v1 and v2,
nested limits included; checked on fake cgroup trees and in a real cgroup made here."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from edgespec.node.info import cgroup_room, free_ram_bytes

MiB = 1 << 20


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_v2_limit_minus_usage_without_reclaimable_cache(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/user.slice/box\n")
    _tree(tmp_path / "fs", {
        "user.slice/box/memory.max": f"{600 * MiB}\n",
        "user.slice/box/memory.current": f"{250 * MiB}\n",
        "user.slice/box/memory.stat": f"anon 1\ninactive_file {50 * MiB}\n",
        "user.slice/memory.max": "max\n", "user.slice/memory.current": f"{900 * MiB}\n",
    })
    assert cgroup_room(proc, tmp_path / "fs") == 400 * MiB


def test_the_tightest_ancestor_limit_counts(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    _tree(tmp_path / "fs", {
        "a/b/memory.max": f"{2000 * MiB}\n", "a/b/memory.current": f"{100 * MiB}\n",
        "a/memory.max": f"{500 * MiB}\n", "a/memory.current": f"{300 * MiB}\n",
    })
    assert cgroup_room(proc, tmp_path / "fs") == 200 * MiB


def test_v1_memory_controller_and_no_limit(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n")
    _tree(tmp_path / "fs", {
        "memory/docker/abc/memory.limit_in_bytes": f"{1100 * MiB}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{700 * MiB}\n",
        "memory/docker/abc/memory.stat": f"cache 1\ntotal_inactive_file {100 * MiB}\n",
        "memory/docker/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
    })
    assert cgroup_room(proc, tmp_path / "fs") == 500 * MiB
    proc.write_text("4:memory:/\n")
    assert cgroup_room(proc, tmp_path / "fs") is None  # no limit anywhere


def test_inside_a_container_the_mount_root_is_its_own_cgroup(tmp_path):
    proc = tmp_path / "cgroup"
    proc.write_text("0::/system.slice/docker-1.scope\n")  # the host's path; not mounted here
    _tree(tmp_path / "fs", {"memory.max": f"{650 * MiB}\n", "memory.current": f"{50 * MiB}\n"})
    assert cgroup_room(proc, tmp_path / "fs") == 600 * MiB


def _memory_cgroup(limit: int) -> tuple[Path, str]:
    """A real memory cgroup with ``limit`` (v2 where it is the memory hierarchy, else v1)."""
    name = f"edgespec-test-{uuid.uuid4().hex[:8]}"
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "memory" in (v2 / "cgroup.controllers").read_text():
        where, limit_file = v2 / name, "memory.max"
    elif Path("/sys/fs/cgroup/memory").is_dir():
        where, limit_file = Path("/sys/fs/cgroup/memory") / name, "memory.limit_in_bytes"
    else:
        pytest.skip("no memory cgroup hierarchy on this machine")
    try:
        where.mkdir()
        (where / limit_file).write_text(str(limit))
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup here ({e}): needs root and a writable "
                    "cgroup hierarchy")
    return where, limit_file


def test_a_real_cgroup_limit_is_what_a_node_reports():
    where, _ = _memory_cgroup(300 * MiB)
    code = ("import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()));"
            "from edgespec.node.info import free_ram_bytes; print(free_ram_bytes())")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(where)], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    finally:
        with contextlib.suppress(OSError):  # empty once the process exited
            os.rmdir(where)
    inside = int(out.strip())
    assert 0 < inside <= 300 * MiB, inside
    assert free_ram_bytes() > 300 * MiB  # outside it: the machine's figure
