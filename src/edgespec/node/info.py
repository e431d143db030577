"""What a node tells the LAN about itself: id, backend, free memory, cached model fingerprints.

Everything here is public by design (it goes into mDNS TXT records): no paths, no key material.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

FINGERPRINT_HEX = 16  # 64 bits of sha256: enough to tell models apart, short for TXT records
_STAMP_SUFFIXES = (".verified", ".sha256")  # models.py writes .verified; we cache our own hash in .sha256


def free_ram_bytes() -> int:
    """Memory available for new allocations (Linux MemAvailable; sysconf elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def free_vram_bytes() -> int | None:
    """Free memory of discrete NVIDIA GPUs (sum over devices), or None where not detectable.

    Unified-memory devices (Apple silicon, Jetson) have no separate VRAM: their budget is the
    free RAM, so None is the honest answer there.
    """
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
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    digest = h.hexdigest()
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
