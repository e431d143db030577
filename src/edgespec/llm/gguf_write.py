"""Writing GGUF files: metadata entries encoded byte for byte, tensor data streamed in chunks.

The writer is told which metadata and tensors to write (:mod:`edgespec.llm.shards` decides that
per window, docs/design.md 3.1); tensor data is copied from the source file in fixed-size chunks,
so memory stays flat whatever the model size.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from edgespec.llm.gguf_read import COPY_CHUNK, CorruptShardError


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



def write_gguf(source: Path, out_path: Path, kvs: Sequence[bytes], plan: Sequence[PlannedTensor],
               align: int, progress: Any) -> None:
    """Write a GGUF v3 file of the encoded metadata ``kvs`` and the tensors of ``plan`` (data
    read from ``source`` at their offsets), atomically: a partial file never takes the name."""
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
        with open(tmp, "wb") as fout, open(source, "rb") as fsrc:
            fout.write(header)
            buf = bytearray(COPY_CHUNK)
            view = memoryview(buf)
            for t in plan:
                if t.source_offset is None:
                    fout.write(t.data)
                else:
                    fsrc.seek(t.source_offset)
                    left = t.nbytes
                    while left:
                        n = fsrc.readinto(view[:min(left, COPY_CHUNK)])
                        if not n:
                            raise CorruptShardError(f"{source} ends inside tensor {t.name!r}")
                        fout.write(view[:n])
                        left -= n
                fout.write(b"\0" * (-t.nbytes % align))
                if progress is not None:
                    progress.update(t.nbytes)
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

