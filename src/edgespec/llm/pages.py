"""Resident pages a loaded window does not need, given back to the device (docs/design.md
5.3, "What a window holds").

Two kinds, both found after llama.cpp has done its work, neither of them data the window reads:

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

And the page cache of files read or written once (``drop_cached``, ``DroppingReader``,
``read_once``, ``drop_file_cache``): a node cuts, hashes and loads files inside its device's
memory cgroup, which is charged for every cached page (``edgespec.llm.gguf_write``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["DroppingReader", "drop_cached", "drop_file_cache", "read_once", "release_file",
           "release_range", "supported"]

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
        drop_file_cache(path)
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


# ------------------------------------------------------------------------------ page cache

def drop_cached(fd: int, offset: int, length: int) -> None:
    """Drop the clean cached pages of bytes ``[offset, offset + length)`` of ``fd``: data read or
    written once and not needed again soon. A page another process maps stays; where the
    platform has no ``posix_fadvise`` (macOS) this does nothing."""
    if length > 0 and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


#: How far past the end of a range read its cached pages may reach: the page cache holds a file
#: in folios of up to 2 MiB (x86-64's PMD size), and dropping a range leaves a folio that
#: reaches outside it.
FOLIO_REACH = 2 << 20


class DroppingReader:
    """Reads pieces of the source file and drops each from the page cache once read.

    A piece's last folio may reach into the next piece, so a piece that follows the one before
    it is dropped from that one's start (the folio they share goes with it), and the reach
    past the last piece of a run is dropped when the run ends (:meth:`end_run`)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.run: tuple[int, int] | None = None  # the previous piece read

    def readinto(self, view: memoryview, at: int) -> int:
        if self.run is not None and not self.run[0] <= at <= self.run[1] + FOLIO_REACH:
            self.end_run()
        self.f.seek(at)
        n = self.f.readinto(view) or 0
        start = at if self.run is None else self.run[0]
        drop_cached(self.f.fileno(), start, at + n - start)
        self.run = (at, at + n)
        return n

    def end_run(self) -> None:
        if self.run is not None:
            lo, hi = self.run
            drop_cached(self.f.fileno(), lo, hi - lo + FOLIO_REACH)
            self.run = None


def drop_file_cache(path: str | os.PathLike[str]) -> None:
    """Drop the clean cached pages of the file at ``path``: a window llama.cpp has read into
    its own buffers (or mapped: mapped pages stay) is not read again, and a memory cgroup
    would go on counting its pages against the device until they are reclaimed."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            drop_cached(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)


def read_once(path: str | os.PathLike[str], chunk: int) -> Iterator[memoryview]:
    """The bytes of ``path`` in ``chunk``-byte pieces (each valid until the next), every piece
    dropped from the page cache once read: a scan such as hashing a file would otherwise
    leave it all cached on the reader's account, and a second read of pages still cached
    from an earlier one moves them to the active list, which a memory cgroup's room
    (``node.info.cgroup_room``) counts as used."""
    with open(path, "rb", buffering=0) as f:
        src = DroppingReader(f)
        view = memoryview(bytearray(chunk))
        at = 0
        try:
            while n := src.readinto(view, at):
                yield view[:n]
                at += n
        finally:
            src.end_run()
