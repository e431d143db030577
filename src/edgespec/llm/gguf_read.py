"""Reading GGUF files: a small header parser, what a file is (:class:`ShardInfo`), its fingerprint.

gguf.GGUFReader builds a numpy view per string and takes ~6 s on a 152k-token vocabulary; here
string arrays are skipped over and every metadata entry is kept as raw bytes, so shards copy them
verbatim (docs/design.md 3.1). Every shard records ``edgespec.fingerprint`` (the full model's
identity, see :func:`fingerprint`), ``edgespec.range``, ``edgespec.n_layer`` and
``edgespec.role``, so a runtime can refuse a shard of another model or a neighbour whose range
does not join its own.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from edgespec.llm.pages import read_once

KEY_FINGERPRINT = "edgespec.fingerprint"
KEY_RANGE = "edgespec.range"
KEY_N_LAYER = "edgespec.n_layer"
KEY_N_VOCAB = "edgespec.n_vocab"
KEY_ROLE = "edgespec.role"

COPY_CHUNK = 8 << 20  # bytes per read when streaming tensor data
_FP_SAMPLE = 4096  # bytes hashed from each end of every tensor for the fingerprint


class ShardError(ValueError):
    """A model or shard file cannot be used as asked."""


class CorruptShardError(ShardError):
    """The file is not a readable GGUF, or its bytes do not match the manifest's sha256."""



@dataclass(frozen=True)
class ShardInfo:
    """What a GGUF file is, read from its metadata (a full model is the window ``[0, n_layer)``)."""

    path: Path
    architecture: str
    fingerprint: str
    layer_range: tuple[int, int]
    n_layer_total: int
    n_embd: int
    n_vocab: int  # the full model's vocabulary (a middle shard itself holds a stub of 1)
    role: str  # "full", "first", "middle" or "last"
    is_shard: bool

    @property
    def n_layer(self) -> int:
        """Layers in this window."""
        return self.layer_range[1] - self.layer_range[0]

    @property
    def has_embeddings(self) -> bool:
        return self.layer_range[0] == 0

    @property
    def has_head(self) -> bool:
        return self.layer_range[1] == self.n_layer_total


def window_role(a: int, b: int, n_layer: int) -> str:
    """``"full"``, ``"first"``, ``"middle"`` or ``"last"``: what window ``[a, b)`` holds."""
    if a == 0 and b == n_layer:
        return "full"
    if a == 0:
        return "first"
    if b == n_layer:
        return "last"
    return "middle"


SCALAR_FMT = {
    gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b", gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h", gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?", gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.FLOAT64: "d",
}


@dataclass
class KVEntry:
    key: str
    vtype: int
    sub_type: int | None  # element type of an array
    raw: bytes  # type tag + value, exactly as in the file
    value: Any  # decoded, except string arrays (None: only their length is known)
    length: int  # array length (1 for scalars)


@dataclass
class TensorEntry:
    name: str
    ne: list[int]  # ggml order: ne[0] is the contiguous dimension
    ggml_type: int
    offset: int  # absolute file offset of the data
    nbytes: int


class GGUFHeader:
    """Metadata and tensor directory of a GGUF file (little-endian GGUF v2/v3)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.kv: dict[str, KVEntry] = {}
        self.tensors: list[TensorEntry] = []
        with open(path, "rb") as f:
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # empty file
                raise CorruptShardError(f"{path} is not a GGUF file ({e})") from e
        try:
            self._parse()
        except CorruptShardError:
            self.close()
            raise
        except (struct.error, ValueError, UnicodeDecodeError, IndexError, OverflowError) as e:
            self.close()
            raise CorruptShardError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> GGUFHeader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parse(self) -> None:
        mm, size = self._mm, len(self._mm)
        if size < 24:
            raise CorruptShardError(f"{self.path} is too short for a GGUF header ({size} bytes)")
        magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", mm, 0)
        if magic != gguf.GGUF_MAGIC:
            raise CorruptShardError(f"{self.path} is not a GGUF file (bad magic)")
        if version not in (2, 3):
            raise CorruptShardError(f"{self.path}: unsupported GGUF version {version}")
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise CorruptShardError(f"{self.path}: implausible counts ({n_tensors} tensors, {n_kv} keys)")
        off = 24
        for _ in range(n_kv):
            key, off = self._str(off)
            start = off
            (vtype,) = struct.unpack_from("<I", mm, off)
            off += 4
            value, sub, length, off = self._value(vtype, off)
            self.kv[key] = KVEntry(key, vtype, sub, bytes(mm[start:off]), value, length)
        infos = []
        for _ in range(n_tensors):
            name, off = self._str(off)
            (n_dims,) = struct.unpack_from("<I", mm, off)
            if n_dims > 8:
                raise CorruptShardError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
            ne = list(struct.unpack_from(f"<{n_dims}Q", mm, off + 4))
            off += 4 + 8 * n_dims
            ggml_type, rel = struct.unpack_from("<IQ", mm, off)
            off += 12
            infos.append((name, ne, ggml_type, rel))
        align = self.alignment
        data_start = off + (-off % align)
        for name, ne, ggml_type, rel in infos:
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError) as e:
                raise CorruptShardError(f"{self.path}: tensor {name!r} has unknown type {ggml_type}") from e
            n_el = 1
            for d in ne:
                n_el *= int(d)
            nbytes = n_el // block * type_size
            t = TensorEntry(name, [int(d) for d in ne], int(ggml_type), data_start + int(rel), nbytes)
            if t.offset + nbytes > size:
                raise CorruptShardError(
                    f"{self.path} is truncated: tensor {name!r} ends at byte {t.offset + nbytes}, "
                    f"file has {size}")
            self.tensors.append(t)

    def _str(self, off: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._mm, off)
        if off + 8 + n > len(self._mm):
            raise CorruptShardError(f"{self.path}: string runs past the end of the file")
        return self._mm[off + 8:off + 8 + n].decode("utf-8"), off + 8 + n

    def _value(self, vtype: int, off: int) -> tuple[Any, int | None, int, int]:
        mm = self._mm
        if vtype in SCALAR_FMT:
            fmt = "<" + SCALAR_FMT[vtype]  # type: ignore[index]
            return struct.unpack_from(fmt, mm, off)[0], None, 1, off + struct.calcsize(fmt)
        if vtype == gguf.GGUFValueType.STRING:
            v, off = self._str(off)
            return v, None, 1, off
        if vtype == gguf.GGUFValueType.ARRAY:
            sub, n = struct.unpack_from("<IQ", mm, off)
            off += 12
            if sub in SCALAR_FMT:
                fmt = SCALAR_FMT[sub]  # type: ignore[index]
                width = struct.calcsize(fmt)
                if off + n * width > len(mm):
                    raise CorruptShardError(f"{self.path}: array runs past the end of the file")
                vals = list(struct.unpack_from(f"<{n}{fmt}", mm, off)) if n <= 4096 else None
                return vals, sub, n, off + n * width
            if sub == gguf.GGUFValueType.STRING:
                unpack = struct.Struct("<Q").unpack_from
                for _ in range(n):  # skip: tokens and merges are copied as raw bytes
                    off += 8 + unpack(mm, off)[0]
                if off > len(mm):
                    raise CorruptShardError(f"{self.path}: string array runs past the end of the file")
                return None, sub, n, off
            raise CorruptShardError(f"{self.path}: unsupported metadata array of type {sub}")
        raise CorruptShardError(f"{self.path}: unknown metadata value type {vtype}")

    # -- accessors

    def get(self, key: str) -> Any:
        kv = self.kv.get(key)
        return None if kv is None else kv.value

    @property
    def alignment(self) -> int:
        a = self.get("general.alignment")
        if a is None:
            return gguf.GGUF_DEFAULT_ALIGNMENT
        if not isinstance(a, int) or a <= 0 or a & (a - 1):
            raise CorruptShardError(f"{self.path}: bad general.alignment {a!r}")
        return a

    def tensor(self, name: str) -> TensorEntry | None:
        for t in self.tensors:
            if t.name == name:
                return t
        return None

    def dims(self) -> tuple[str, int, int, int]:
        """(architecture, n_layer, n_embd, n_vocab)."""
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise CorruptShardError(f"{self.path} has no general.architecture")
        n_layer = self.get(f"{arch}.block_count")
        n_embd = self.get(f"{arch}.embedding_length")
        if not isinstance(n_layer, int) or not isinstance(n_embd, int):
            raise CorruptShardError(f"{self.path} lacks {arch}.block_count / {arch}.embedding_length")
        emb = self.tensor("token_embd.weight")
        if emb is None or len(emb.ne) != 2:
            raise CorruptShardError(f"{self.path} has no 2-D token_embd.weight")
        return arch, n_layer, n_embd, emb.ne[1]

    def fingerprint(self) -> str:
        arch, n_layer, n_embd, n_vocab = self.dims()
        h = hashlib.sha256()
        h.update(json.dumps({"arch": arch, "n_layer": n_layer, "n_embd": n_embd, "n_vocab": n_vocab},
                            sort_keys=True).encode())
        # pread, not the mapping: mapped pages (and their read-ahead) would count as resident.
        with open(self.path, "rb") as f:
            fd = f.fileno()
            for t in sorted(self.tensors, key=lambda t: t.name):
                h.update(f"{t.name}|{t.ne}|{t.ggml_type}|{t.nbytes}\n".encode())
                h.update(os.pread(fd, min(t.nbytes, _FP_SAMPLE), t.offset))
                if t.nbytes > _FP_SAMPLE:
                    tail = max(_FP_SAMPLE, t.nbytes - _FP_SAMPLE)
                    h.update(os.pread(fd, t.nbytes - tail, t.offset + tail))
        return h.hexdigest()[:32]



def open_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    return GGUFHeader(p)


def read_info(path: str | os.PathLike[str]) -> ShardInfo:
    """Identify a GGUF file: a full model or a shard written by this module.

    Raises:
        FileNotFoundError, CorruptShardError.
    """
    p = Path(path)
    with open_gguf(p) as h:
        arch, n_layer, n_embd, n_vocab_file = h.dims()
        fp = h.get(KEY_FINGERPRINT)
        if fp is None:
            return ShardInfo(p, arch, h.fingerprint(), (0, n_layer), n_layer, n_embd,
                             n_vocab_file, "full", False)
        rng, total = h.get(KEY_RANGE), h.get(KEY_N_LAYER)
        n_vocab, role = h.get(KEY_N_VOCAB), h.get(KEY_ROLE)
        if rng is None or total is None or n_vocab is None or role is None or len(rng) != 2:
            raise CorruptShardError(f"{p} has {KEY_FINGERPRINT} but incomplete edgespec.* metadata")
        a, b = int(rng[0]), int(rng[1])
        if b - a != n_layer or not 0 <= a < b <= int(total):
            raise CorruptShardError(
                f"{p}: edgespec.range {a}:{b} disagrees with block_count {n_layer} / n_layer {total}")
        return ShardInfo(p, arch, str(fp), (a, b), int(total), n_embd, int(n_vocab), str(role), True)


def fingerprint(path: str | os.PathLike[str]) -> str:
    """The model identity of a GGUF file: 32 hex chars.

    A stable hash of architecture, n_layer, n_embd, n_vocab, every tensor's name/shape/type/size
    and the first and last 4 KiB of every tensor's data. For a shard, the fingerprint of the full
    model it was cut from (stored in its metadata), so nodes holding different windows of one
    model advertise the same fingerprint.
    """
    return read_info(path).fingerprint


def file_sha256(path: str | os.PathLike[str], keep_cached: bool = True) -> str:
    """sha256 of a file; ``keep_cached=False`` drops each piece from the page cache once read
    (a hash at start-up that nothing reads again soon, ``pages.read_once``)."""
    h = hashlib.sha256()
    if not keep_cached:
        for piece in read_once(path, COPY_CHUNK):
            h.update(piece)
        return h.hexdigest()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tensor_names(path: str | os.PathLike[str]) -> list[str]:
    """Tensor names in a GGUF file, in file order (diagnostics and tests)."""
    with open_gguf(path) as h:
        return [t.name for t in h.tensors]


def read_tensor_types(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """(ggml type name, data bytes) of every tensor in a GGUF file, in file order."""
    with open_gguf(path) as h:
        return [(gguf.GGMLQuantizationType(t.ggml_type).name, t.nbytes) for t in h.tensors]

