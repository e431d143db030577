"""Writing GGUF files: metadata entries encoded byte for byte, tensor data streamed in chunks.

The writer is told which metadata and tensors to write (:mod:`edgespec.llm.shards` decides that
per window, docs/design.md 3.1); tensor data is copied from the source file in fixed-size chunks,
so memory stays flat whatever the model size.

Page cache stays flat too (:func:`write_gguf`, with :mod:`edgespec.llm.pages`): a node cuts its
window inside its device's memory cgroup, which is charged for every page of the model it reads
and of the shard it writes. Left alone those pages pile up to the cgroup's limit, the written
ones dirty (reclaim under the limit must wait for their writeback), and the room the node
reports for planning (``node.info.cgroup_room``) shrinks by what has not aged onto the inactive
list yet.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from edgespec.llm.gguf_read import COPY_CHUNK, CorruptShardError
from edgespec.llm.pages import DroppingReader, drop_cached


def pack_str(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def kv_u32(key: str, value: int) -> bytes:
    return pack_str(key) + struct.pack("<II", gguf.GGUFValueType.UINT32, value)


def kv_str(key: str, value: str) -> bytes:
    return pack_str(key) + struct.pack("<I", gguf.GGUFValueType.STRING) + pack_str(value)


def kv_bool_array(key: str, values: Sequence[bool]) -> bytes:
    return (pack_str(key) + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL,
                                        len(values)) + struct.pack(f"<{len(values)}?", *values))


def kv_u32_array(key: str, values: Sequence[int]) -> bytes:
    return (pack_str(key) + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32,
                                        len(values)) + struct.pack(f"<{len(values)}I", *values))



@dataclass
class PlannedTensor:
    name: str
    ne: list[int]
    ggml_type: int
    nbytes: int
    source_offset: int | None  # None: ``data`` holds the bytes (a stub)
    data: bytes = b""



#: Bytes written between flushes of the file being written: each flush writes them to disk and
#: drops them from the page cache, so at most this much of the output is cached on the
#: writer's account at any time (the source's pieces are dropped as they are read).
SYNC_CHUNK = 16 << 20


class _FlushingWriter:
    """Appends to a file, writing it to disk every ``SYNC_CHUNK`` bytes and dropping what was
    written from the page cache (see the module docstring); optionally hashes what it writes."""

    def __init__(self, f: Any, digest: bool) -> None:
        self.f = f
        self.hash = hashlib.sha256() if digest else None
        self.pos = 0  # bytes written
        self.synced = 0  # bytes on disk and dropped from the cache

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        if self.hash is not None:
            self.hash.update(data)
        self.pos += len(data)
        if self.pos - self.synced >= SYNC_CHUNK:
            self.sync()

    def sync(self) -> None:
        self.f.flush()
        getattr(os, "fdatasync", os.fsync)(self.f.fileno())  # macOS has fsync only
        drop_cached(self.f.fileno(), self.synced, self.pos - self.synced)
        self.synced = self.pos


def write_gguf(source: Path, out_path: Path, kvs: Sequence[bytes], plan: Sequence[PlannedTensor],
               align: int, progress: Any, digest: bool = False) -> str | None:
    """Write a GGUF v3 file of the encoded metadata ``kvs`` and the tensors of ``plan`` (data
    read from ``source`` at their offsets), atomically: a partial file never takes the name.

    Neither file's pages are left in the page cache: the data is streamed in ``COPY_CHUNK``
    pieces, each source piece dropped once copied, the output written to disk and dropped
    every ``SYNC_CHUNK`` (see the module docstring), and synced before it takes its name.
    With ``digest``, returns the sha256 of the bytes written (no second read of the file)."""
    header = bytearray(struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, len(plan), len(kvs)))
    for entry in kvs:
        header += entry
    rel = 0
    for t in plan:
        header += pack_str(t.name) + struct.pack("<I", len(t.ne))
        header += struct.pack(f"<{len(t.ne)}Q", *t.ne) + struct.pack("<IQ", t.ggml_type, rel)
        rel += t.nbytes + (-t.nbytes % align)
    header += b"\0" * (-len(header) % align)

    # A name of this writer's own: two processes cutting the same window at once (two heads,
    # or a node and a head on one host) must not write into each other's file.
    tmp = out_path.with_name(f"{out_path.name}.part{os.getpid()}-{threading.get_ident()}")
    try:
        # The source unbuffered: every byte read is one this loop asked for and drops.
        with open(tmp, "wb") as f, open(source, "rb", buffering=0) as fsrc:
            fout, src = _FlushingWriter(f, digest), DroppingReader(fsrc)
            fout.write(header)
            buf = bytearray(COPY_CHUNK)
            view = memoryview(buf)
            for t in plan:
                if t.source_offset is None:
                    fout.write(t.data)
                else:
                    at, left = t.source_offset, t.nbytes
                    while left:
                        n = src.readinto(view[:min(left, COPY_CHUNK)], at)
                        if not n:
                            raise CorruptShardError(f"{source} ends inside tensor {t.name!r}")
                        fout.write(view[:n])
                        at += n
                        left -= n
                fout.write(b"\0" * (-t.nbytes % align))
                if progress is not None:
                    progress.update(t.nbytes)
            src.end_run()
            fout.sync()
        os.replace(tmp, out_path)
        return None if fout.hash is None else fout.hash.hexdigest()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

