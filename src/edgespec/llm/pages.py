"""Resident pages a loaded window does not need, given back to the device (docs/design.md 3.9).

Three kinds, all found after llama.cpp has done its work, none of them data the window reads:

* **Mapped file pages.** llama.cpp maps the model file with ``MAP_POPULATE`` and copies the
  weights it repacks for the CPU into buffers of its own; the pages it read them from stay
  mapped. :func:`release_file` drops this process's mappings of the file
  (``MADV_DONTNEED``: the mapping stays valid, a later read faults the page back from the file)
  and asks the kernel to evict the file's cached pages (``POSIX_FADV_DONTNEED``). What the
  window does read from the mapping (norms, weights left in the file's layout, the embedding
  rows of the tokens it sees, the head of the last window) comes back on first use; what it
  never reads (the token embeddings of the last window) stays on disk.
* **A buffer reserved bigger than it is used.** :func:`release_range` drops the pages inside
  ``[address, address + nbytes)``; the next write there gets fresh zero pages.

Both are ``madvise(MADV_DONTNEED)``, which never changes what the process reads from a file
mapping and only zeroes anonymous memory the caller says it does not need.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from pathlib import Path

__all__ = ["release_file", "release_range", "supported"]

_MADV_DONTNEED = 4  # Linux, every architecture
_PAGE = mmap.PAGESIZE


def supported() -> bool:
    """``madvise`` and ``/proc/self/maps`` exist (Linux); elsewhere nothing is released."""
    return sys.platform.startswith("linux") and _libc() is not None


_libc_handle: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL | None:
    global _libc_handle
    if _libc_handle is None and sys.platform.startswith("linux"):
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
        _libc_handle = lib
    return _libc_handle


def _madvise(start: int, length: int) -> None:
    lib = _libc()
    if lib is None or length <= 0:
        return
    if lib.madvise(start, length, _MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) at {start:#x}+{length}: {os.strerror(err)}")


def file_mappings(path: str | os.PathLike[str]) -> list[tuple[int, int]]:
    """``(start, end)`` of every mapping of ``path`` in this process."""
    real = os.path.realpath(path)
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].rstrip("\n") == real:
                    a, b = parts[0].split("-")
                    out.append((int(a, 16), int(b, 16)))
    except OSError:
        return []
    return out


def release_file(path: str | os.PathLike[str], evict: bool = True) -> int:
    """Drop this process's resident pages of every mapping of ``path``; with ``evict``, also ask
    the kernel to drop the file's clean cached pages nobody maps. Returns the bytes of mapping
    walked (0 where unsupported or the file is not mapped)."""
    if not supported():
        return 0
    walked = 0
    for a, b in file_mappings(path):
        _madvise(a, b - a)
        walked += b - a
    if evict and walked:
        fd = os.open(Path(path), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return walked


def release_range(address: int, nbytes: int) -> int:
    """Drop the whole pages inside ``[address, address + nbytes)`` (anonymous memory reads back
    as zeros afterwards). Returns the bytes released."""
    if not supported() or address <= 0 or nbytes <= 0:
        return 0
    a = (address + _PAGE - 1) // _PAGE * _PAGE
    b = (address + nbytes) // _PAGE * _PAGE
    if b <= a:
        return 0
    _madvise(a, b - a)
    return b - a
