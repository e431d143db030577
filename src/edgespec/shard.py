"""Cut a GGUF model into layer-window shards that llama.cpp loads as small models.

A window ``[a, b)`` becomes one GGUF file holding blocks ``a..b-1`` renumbered to ``0..b-a-1``,
``{arch}.block_count = b - a`` and the global tensors (``output_norm``, llama's ``rope_freqs``...):

* the first window keeps the real token embeddings and tokenizer (it turns ids into states);
* the last window keeps the real head (``output.weight`` or the tied ``token_embd``);
* a middle window never sees ids nor produces logits, so it carries a stub vocabulary
  (``tokenizer.ggml.model = "none"``, ``vocab_size = 1``, a zero ``{n_embd, 1}`` embedding) and no
  head: every middle device saves the embedding/head bytes.

Every shard records ``edgespec.fingerprint`` (the full model's identity, see :func:`fingerprint`),
``edgespec.range``, ``edgespec.n_layer`` and ``edgespec.role``, so a runtime can refuse a shard of
another model or a neighbour whose range does not join its own.

What llama.cpp derives from a layer's absolute index or from the layer count (sliding-window
periods, leading dense blocks, size-dependent constants, required heads) is listed per
architecture in :data:`ARCHITECTURES`; windows get it rewritten, or are refused. Architectures
outside the table are refused by name (:data:`REFUSED_ARCHITECTURES` says why for those known
not to work).

Tensor data is streamed from the source file in fixed-size chunks: memory stays flat whatever
the model size.

Command line (also ``edgespec shard``)::

    python -m edgespec.shard MODEL.gguf --stages 3 --out DIR
    python -m edgespec.shard MODEL.gguf --ranges 0:8,8:16,16:24 --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import re
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

__all__ = [
    "MANIFEST_NAME",
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "REFUSED_ARCHITECTURES",
    "ArchHandling",
    "CorruptShardError",
    "Manifest",
    "ShardError",
    "ShardFile",
    "ShardInfo",
    "UnsupportedArchitectureError",
    "add_shard_arguments",
    "cut_window",
    "even_ranges",
    "file_sha256",
    "fingerprint",
    "main",
    "parse_ranges",
    "read_info",
    "read_tensor_types",
    "run_shard_command",
    "shard_model",
    "tensor_names",
    "validate_ranges",
]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "edgespec-shards/1"

KEY_FINGERPRINT = "edgespec.fingerprint"
KEY_RANGE = "edgespec.range"
KEY_N_LAYER = "edgespec.n_layer"
KEY_N_VOCAB = "edgespec.n_vocab"
KEY_ROLE = "edgespec.role"

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_COPY_CHUNK = 8 << 20  # bytes per read when streaming tensor data
_FP_SAMPLE = 4096  # bytes hashed from each end of every tensor for the fingerprint


class ShardError(ValueError):
    """A model or shard file cannot be used as asked."""


class CorruptShardError(ShardError):
    """The file is not a readable GGUF, or its bytes do not match the manifest's sha256."""


class UnsupportedArchitectureError(ShardError):
    """The architecture has not been tested with layer-window sharding yet."""


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


@dataclass
class ShardFile:
    file: str
    range: tuple[int, int]
    role: str
    bytes: int
    sha256: str


@dataclass
class Manifest:
    """``manifest.json`` written next to the shards."""

    source: str
    fingerprint: str
    architecture: str
    n_layer: int
    n_embd: int
    n_vocab: int
    ranges: list[tuple[int, int]]
    shards: list[ShardFile] = field(default_factory=list)
    format: str = MANIFEST_FORMAT

    def to_json(self) -> str:
        d = asdict(self)
        d["ranges"] = [list(r) for r in self.ranges]
        for s in d["shards"]:
            s["range"] = list(s["range"])
        return json.dumps(d, indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Manifest:
        try:
            d = json.loads(Path(path).read_text())
            shards = [ShardFile(s["file"], (int(s["range"][0]), int(s["range"][1])), s["role"],
                                int(s["bytes"]), s["sha256"]) for s in d["shards"]]
            for s in shards:
                # A manifest names files beside it, nothing else: no folders, no "..", no
                # absolute paths (which would load a file without its sha256 check).
                if (not isinstance(s.file, str) or Path(s.file).name != s.file
                        or s.file in (".", "..") or "\\" in s.file):
                    raise ValueError(f"shard file name {s.file!r} is not a plain file name")
            return cls(source=d["source"], fingerprint=d["fingerprint"], architecture=d["architecture"],
                       n_layer=int(d["n_layer"]), n_embd=int(d["n_embd"]), n_vocab=int(d["n_vocab"]),
                       ranges=[(int(a), int(b)) for a, b in d["ranges"]], shards=shards,
                       format=d.get("format", MANIFEST_FORMAT))
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise ShardError(f"cannot read shard manifest {path}: {e}") from e

    def shard_paths(self, directory: str | os.PathLike[str]) -> list[Path]:
        return [Path(directory) / s.file for s in self.shards]

    def entry_for(self, filename: str) -> ShardFile | None:
        for s in self.shards:
            if s.file == filename:
                return s
        return None


# --------------------------------------------------------------------------------------------
# Architectures: every place where llama.cpp reads something that depends on a layer's absolute
# index or on the number of layers in the file. A window renumbers its blocks from 0 and has
# fewer of them, so each such trap either gets rewritten metadata or is refused.


@dataclass(frozen=True)
class ArchHandling:
    """How windows of one llama.cpp architecture are cut.

    Attributes:
        swa_period: llama.cpp's default sliding-window period (a layer ``il`` slides when
            ``il % period < period - 1``, or the reverse with ``swa_dense_first``); windows get
            the explicit per-layer ``attention.sliding_window_pattern`` of their absolute layers,
            because the period restarts at the window's layer 0. None: no sliding window.
        swa_if_window_key: sliding layers exist only when ``attention.sliding_window`` > 0.
        dense_lead: ``leading_dense_block_count`` counts the window's own leading dense blocks.
        head_required: llama.cpp insists on ``output.weight`` in every file (no tied fallback).
        restore_input: the graph tensor that rescales *every* input, hidden states included
            (gemma2's ``inp_scaled``); a window after the first overwrites it with the states it
            was given (see :class:`edgespec.stage.StageRuntime`), so they enter unscaled.
        traps: every layer-indexed trap of the architecture and how windows handle it (what
            was checked against llama.cpp; the README's table says the same).
    """

    name: str
    traps: tuple[str, ...]
    swa_period: int | None = None
    swa_dense_first: bool = False
    swa_if_window_key: bool = False
    dense_lead: bool = False
    head_required: bool = False
    restore_input: str | None = None


_COMMON = ("per-layer metadata arrays sliced to the window", "tied or untied head kept on the last window only",
           "stub vocabulary on middle windows")

ARCHITECTURES: dict[str, ArchHandling] = {a.name: a for a in (
    ArchHandling("llama", _COMMON + ("global rope_freqs.weight kept in every window",
                                     "Mixtral-style routed experts (ffn_*_exps) stay in their block")),
    ArchHandling("qwen2", _COMMON + ("q/k/v biases",)),
    ArchHandling("qwen3", _COMMON + ("per-head q/k norms",)),
    ArchHandling("qwen3moe", _COMMON + ("per-head q/k norms", "routed experts stay in their block")),
    ArchHandling("gemma2", _COMMON + (
        "sliding window on every other absolute layer: explicit per-layer pattern",
        "llama.cpp scales every input by sqrt(n_embd), hidden states too: later windows overwrite "
        "inp_scaled with the states they were given",
        "attention soft-capping per layer, final soft-capping on the last window",
        "27B attention scale chosen from n_layer == 46: such models are refused"), swa_period=2,
        restore_input="inp_scaled"),
    ArchHandling("gemma3", _COMMON + (
        "sliding window on 5 of every 6 absolute layers, with its own RoPE base: explicit pattern",
        "token embeddings scaled by sqrt(n_embd) for token input only (first window)",
        "27B attention scale chosen from n_layer == 62: such models are refused"),
        swa_period=6, swa_if_window_key=True),
    ArchHandling("phi3", _COMMON + (
        "fused qkv and gate/up", "global rope_factors_long/short kept",
        "long or short RoPE factors chosen from the context size: the same in every window, as "
        "every window of a ring gets the ring's n_ctx",
        "llama.cpp ignores phi3's sliding window: nothing to rewrite")),
    ArchHandling("deepseek2", _COMMON + (
        "multi-head latent attention (per-block tensors only)",
        "leading_dense_block_count rewritten per window",
        "routed + shared experts stay in their block",
        "'lite' (no q_lora_rank) inferred from n_layer 26/27: q_lora_rank pinned, windows of those "
        "sizes refused for non-lite models",
        "expert gating default inferred from n_layer: pinned in every window"), dense_lead=True),
    ArchHandling("gpt-oss", _COMMON + (
        "sliding window on every other absolute layer: explicit per-layer pattern",
        "attention sinks and expert biases (per-block)",
        "output.weight required in every file: middle windows get a 1-row stub, the first keeps it"),
        swa_period=2, head_required=True),
)}

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

# Architectures llama.cpp loads but whose windows cannot be made exact, and why.
_RECURRENT = ("its recurrent state layers cannot drop a rejected draft by position, which tree "
              "verification needs")
REFUSED_ARCHITECTURES: dict[str, str] = {
    "gemma3n": "every layer also reads per-layer embeddings of the token ids, which a window after "
               "the first never sees",
    "glm4moe": "llama.cpp aborts the process when a glm4moe file without M-RoPE sections is given "
               "hidden states instead of token ids, and every window after the first is",
    **{a: _RECURRENT for a in ("mamba", "mamba2", "rwkv6", "rwkv7", "qwen3next", "jamba",
                               "falcon-h1", "lfm2", "granitehybrid", "nemotron_h")},
}


def _arch_handling(arch: str) -> ArchHandling:
    """The table entry of ``arch``, or a one-line refusal naming it."""
    if arch in REFUSED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} cannot be split into layer windows: {REFUSED_ARCHITECTURES[arch]}; "
            "run it unsplit on one machine")
    handling = ARCHITECTURES.get(arch)
    if handling is None:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} cannot be split into layer windows yet: how llama.cpp indexes its "
            f"layers has not been checked (supported: {', '.join(SUPPORTED_ARCHITECTURES)}); "
            "run it unsplit on one machine, or ask for support with the model's name")
    return handling


def _swa_layers(h: _Header, arch: str, handling: ArchHandling) -> list[bool] | None:
    """Which absolute layers of the full model slide (None: the model has no sliding window)."""
    n_total = h.get(f"{arch}.block_count")
    kv = h.kv.get(f"{arch}.attention.sliding_window_pattern")
    if kv is not None and kv.vtype == gguf.GGUFValueType.ARRAY:
        return None  # an explicit per-layer array: sliced like every per-layer array
    if handling.swa_period is None:
        return None
    if handling.swa_if_window_key and not (h.get(f"{arch}.attention.sliding_window") or 0) > 0:
        return None
    period = handling.swa_period
    if kv is not None and isinstance(kv.value, int):
        period = kv.value
    if period == 0:
        return [True] * n_total
    if handling.swa_dense_first:
        return [il % period != 0 for il in range(n_total)]
    return [il % period < period - 1 for il in range(n_total)]


# Layer counts from which llama.cpp infers a model size that changes a constant: gemma's 27B
# attention scale; deepseek2's "lite" variants (no query low-rank projection).
_SIZE_TRAPS = {"gemma2": (46,), "gemma3": (62,)}
_DEEPSEEK2_LITE_LAYERS = (26, 27)


def _deepseek2_is_lite(n_layer: int, n_vocab: int) -> bool:
    return n_layer in _DEEPSEEK2_LITE_LAYERS or (n_layer == 48 and n_vocab == 128256)


def _check_windows(h: _Header, arch: str, ranges: Sequence[tuple[int, int]], n_layer: int,
                   n_vocab: int) -> None:
    """Refuse windows whose layer count would make llama.cpp pick other constants."""
    if arch in _SIZE_TRAPS:
        n_embd = h.get(f"{arch}.embedding_length")
        n_head = h.get(f"{arch}.attention.head_count")
        n_head = n_head[0] if isinstance(n_head, list) and n_head else n_head
        if not isinstance(n_embd, int) or not isinstance(n_head, int) or n_head <= 0:
            raise CorruptShardError(f"{h.path} lacks {arch}.embedding_length / attention.head_count")
        head_dim = h.get(f"{arch}.attention.key_length") or n_embd // n_head
        scale_differs = n_embd // n_head != int(head_dim)
        for a, b in ranges:
            sizes = {n_layer, b - a}
            if (a, b) != (0, n_layer) and scale_differs and sizes & set(_SIZE_TRAPS[arch]):
                raise ShardError(
                    f"{arch}: llama.cpp picks the attention scale of a {n_layer}-layer model from its "
                    f"layer count, so window {a}:{b} would compute other attention; run this model "
                    "unsplit")
    if arch == "deepseek2" and not _deepseek2_is_lite(n_layer, n_vocab):
        for a, b in ranges:
            role = _role(a, b, n_layer)
            if (a, b) != (0, n_layer) and _deepseek2_is_lite(b - a, 1 if role == "middle" else n_vocab):
                raise ShardError(
                    f"deepseek2: llama.cpp treats a {b - a}-layer file as a 'lite' model (no query "
                    f"low-rank projection), so window {a}:{b} would not load; choose other ranges")


def _arch_metadata(h: _Header, arch: str, n_layer: int, n_vocab: int, a: int, b: int,
                   dropped: set[str]) -> list[bytes]:
    """Rewritten or pinned metadata of window ``[a, b)``; ``dropped`` receives the source keys
    they replace."""
    handling = ARCHITECTURES[arch]
    out: list[bytes] = []
    swa = _swa_layers(h, arch, handling)
    if swa is not None:
        key = f"{arch}.attention.sliding_window_pattern"
        dropped.add(key)
        out.append(_kv_bool_array(key, swa[a:b]))
    if handling.dense_lead:
        key = f"{arch}.leading_dense_block_count"
        lead = h.get(key)
        if isinstance(lead, int):
            dropped.add(key)
            out.append(_kv_u32(key, max(0, min(lead, b) - a)))
    if arch == "deepseek2":
        if h.get(f"{arch}.attention.q_lora_rank") is None:
            # Absent means "lite" only while the layer count says so: pin it for every window.
            out.append(_kv_u32(f"{arch}.attention.q_lora_rank", 0))
        if h.get(f"{arch}.expert_gating_func") is None:
            sigmoid = n_layer in (47, 48) and n_vocab == 154880
            out.append(_kv_u32(f"{arch}.expert_gating_func", 2 if sigmoid else 1))
    return out


# --------------------------------------------------------------------------------------------
# Reading: a small GGUF header parser. gguf.GGUFReader builds a numpy view per string and takes
# ~6 s on a 152k-token vocabulary; here string arrays are skipped over and every metadata entry
# is kept as raw bytes, so shards copy them verbatim.

_SCALAR_FMT = {
    gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b", gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h", gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?", gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q", gguf.GGUFValueType.FLOAT64: "d",
}


@dataclass
class _KV:
    key: str
    vtype: int
    sub_type: int | None  # element type of an array
    raw: bytes  # type tag + value, exactly as in the file
    value: Any  # decoded, except string arrays (None: only their length is known)
    length: int  # array length (1 for scalars)


@dataclass
class _Tensor:
    name: str
    ne: list[int]  # ggml order: ne[0] is the contiguous dimension
    ggml_type: int
    offset: int  # absolute file offset of the data
    nbytes: int


class _Header:
    """Metadata and tensor directory of a GGUF file (little-endian GGUF v2/v3)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.kv: dict[str, _KV] = {}
        self.tensors: list[_Tensor] = []
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

    def __enter__(self) -> _Header:
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
            self.kv[key] = _KV(key, vtype, sub, bytes(mm[start:off]), value, length)
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
            t = _Tensor(name, [int(d) for d in ne], int(ggml_type), data_start + int(rel), nbytes)
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
        if vtype in _SCALAR_FMT:
            fmt = "<" + _SCALAR_FMT[vtype]  # type: ignore[index]
            return struct.unpack_from(fmt, mm, off)[0], None, 1, off + struct.calcsize(fmt)
        if vtype == gguf.GGUFValueType.STRING:
            v, off = self._str(off)
            return v, None, 1, off
        if vtype == gguf.GGUFValueType.ARRAY:
            sub, n = struct.unpack_from("<IQ", mm, off)
            off += 12
            if sub in _SCALAR_FMT:
                fmt = _SCALAR_FMT[sub]  # type: ignore[index]
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

    def tensor(self, name: str) -> _Tensor | None:
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


def _open(path: str | os.PathLike[str]) -> _Header:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    return _Header(p)


def read_info(path: str | os.PathLike[str]) -> ShardInfo:
    """Identify a GGUF file: a full model or a shard written by this module.

    Raises:
        FileNotFoundError, CorruptShardError.
    """
    p = Path(path)
    with _open(p) as h:
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


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Ranges


def even_ranges(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """Split ``n_layer`` blocks into ``n_stages`` contiguous windows (earlier ones get the extra)."""
    if not 1 <= n_stages <= n_layer:
        raise ShardError(f"--stages must be in 1..{n_layer} for a {n_layer}-layer model, got {n_stages}")
    base, extra = divmod(n_layer, n_stages)
    out, a = [], 0
    for i in range(n_stages):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


def parse_ranges(spec: str) -> list[tuple[int, int]]:
    """``"0:8,8:16,16:24"`` -> ``[(0, 8), (8, 16), (16, 24)]``."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)\s*:\s*(\d+)", part)
        if not m:
            raise ShardError(f"bad layer range {part!r} in {spec!r}; expected A:B,B:C,...")
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def validate_ranges(ranges: Sequence[tuple[int, int]], n_layer: int, cover: bool = True) -> None:
    """Each window non-empty and inside the model; with ``cover``, contiguous from 0 to n_layer."""
    if not ranges:
        raise ShardError("no layer ranges given")
    for a, b in ranges:
        if not 0 <= a < b <= n_layer:
            raise ShardError(f"layer range {a}:{b} is empty or outside 0:{n_layer}")
    if cover:
        if ranges[0][0] != 0 or ranges[-1][1] != n_layer:
            raise ShardError(f"ranges {_fmt(ranges)} must start at 0 and end at {n_layer}")
        for (_, b), (a2, _) in zip(ranges, ranges[1:], strict=False):
            if a2 != b:
                raise ShardError(f"ranges {_fmt(ranges)} must be contiguous ({b} != {a2})")


def _fmt(ranges: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{a}:{b}" for a, b in ranges)


# --------------------------------------------------------------------------------------------
# Writing


def _role(a: int, b: int, n_layer: int) -> str:
    if a == 0 and b == n_layer:
        return "full"
    if a == 0:
        return "first"
    if b == n_layer:
        return "last"
    return "middle"


def _pack_str(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _kv_u32(key: str, value: int) -> bytes:
    return _pack_str(key) + struct.pack("<II", gguf.GGUFValueType.UINT32, value)


def _kv_str(key: str, value: str) -> bytes:
    return _pack_str(key) + struct.pack("<I", gguf.GGUFValueType.STRING) + _pack_str(value)


def _kv_bool_array(key: str, values: Sequence[bool]) -> bytes:
    return (_pack_str(key) + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL,
                                         len(values)) + struct.pack(f"<{len(values)}?", *values))


def _kv_u32_array(key: str, values: Sequence[int]) -> bytes:
    return (_pack_str(key) + struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32,
                                         len(values)) + struct.pack(f"<{len(values)}I", *values))


def _window_metadata(h: _Header, arch: str, n_layer: int, n_vocab: int, fp: str, a: int, b: int,
                     role: str) -> list[bytes]:
    """Encoded metadata entries of the window: the source's, verbatim where unchanged."""
    stub = role == "middle"
    dropped = {f"{arch}.block_count", f"{arch}.vocab_size"}
    pinned = _arch_metadata(h, arch, n_layer, n_vocab, a, b, dropped)
    out = []
    for key, kv in h.kv.items():
        if key.startswith("edgespec."):
            continue
        if stub and key.startswith("tokenizer."):
            continue
        if key in dropped:
            continue
        raw = kv.raw
        # Per-layer arrays (some llama variants store head counts or ffn sizes per layer) follow
        # the renumbered blocks.
        if (key.startswith(f"{arch}.") and kv.vtype == gguf.GGUFValueType.ARRAY
                and kv.sub_type in _SCALAR_FMT and kv.length == n_layer and kv.value is not None):
            fmt = _SCALAR_FMT[kv.sub_type]  # type: ignore[index]
            part = kv.value[a:b]
            raw = struct.pack("<IIQ", kv.vtype, kv.sub_type, len(part)) + struct.pack(f"<{len(part)}{fmt}", *part)
        out.append(_pack_str(key) + raw)
    out.extend(pinned)
    out.append(_kv_u32(f"{arch}.block_count", b - a))
    if stub:
        out.append(_kv_str("tokenizer.ggml.model", "none"))
        out.append(_kv_u32(f"{arch}.vocab_size", 1))
    elif f"{arch}.vocab_size" in h.kv:
        out.append(_pack_str(f"{arch}.vocab_size") + h.kv[f"{arch}.vocab_size"].raw)
    out.append(_kv_str(KEY_FINGERPRINT, fp))
    out.append(_kv_u32_array(KEY_RANGE, [a, b]))
    out.append(_kv_u32(KEY_N_LAYER, n_layer))
    out.append(_kv_u32(KEY_N_VOCAB, n_vocab))
    out.append(_kv_str(KEY_ROLE, role))
    return out


@dataclass
class _Planned:
    name: str
    ne: list[int]
    ggml_type: int
    nbytes: int
    source_offset: int | None  # None: ``data`` holds the bytes (a stub)
    data: bytes = b""


def _plan_tensors(h: _Header, a: int, b: int, role: str) -> list[_Planned]:
    """The window's tensors in file order: renumbered blocks, global tensors, stubs."""
    plan: list[_Planned] = []
    stub = role == "middle"
    keeps_head = role in ("last", "full")
    arch = h.get("general.architecture")
    handling = ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if handling is not None and handling.head_required:
        keeps_head = role != "middle"  # the first window has the real vocabulary: a real head
    for t in h.tensors:
        m = _BLOCK_RE.match(t.name)
        if m:
            i = int(m.group(1))
            if a <= i < b:
                plan.append(_Planned(f"blk.{i - a}.{m.group(2)}", t.ne, t.ggml_type, t.nbytes, t.offset))
            continue
        if t.name == "token_embd.weight" and stub:
            n_embd = t.ne[0]
            zeros = np.zeros((1, n_embd), dtype=np.float32).tobytes()
            plan.append(_Planned(t.name, [n_embd, 1], int(gguf.GGMLQuantizationType.F32), len(zeros),
                                 None, zeros))
            continue
        if t.name.startswith("output.") and not keeps_head:
            if stub and handling is not None and handling.head_required and t.name == "output.weight":
                n_embd = t.ne[0]
                zeros = np.zeros((1, n_embd), dtype=np.float32).tobytes()
                plan.append(_Planned(t.name, [n_embd, 1], int(gguf.GGMLQuantizationType.F32), len(zeros),
                                     None, zeros))
            continue  # no head before the last window (tied to token_embd if llama.cpp asks)
        plan.append(_Planned(t.name, t.ne, t.ggml_type, t.nbytes, t.offset))
    return plan


def _write_window(h: _Header, out_path: Path, arch: str, n_layer: int, n_vocab: int, fp: str,
                  a: int, b: int, progress: Any) -> None:
    role = _role(a, b, n_layer)
    align = h.alignment
    kvs = _window_metadata(h, arch, n_layer, n_vocab, fp, a, b, role)
    plan = _plan_tensors(h, a, b, role)
    header = bytearray(struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, len(plan), len(kvs)))
    for entry in kvs:
        header += entry
    rel = 0
    for t in plan:
        header += _pack_str(t.name) + struct.pack("<I", len(t.ne))
        header += struct.pack(f"<{len(t.ne)}Q", *t.ne) + struct.pack("<IQ", t.ggml_type, rel)
        rel += t.nbytes + (-t.nbytes % align)
    header += b"\0" * (-len(header) % align)

    # A name of this writer's own: two processes cutting the same window at once (two heads,
    # or a node and a head on one host) must not write into each other's file.
    tmp = out_path.with_name(f"{out_path.name}.part{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as fout, open(h.path, "rb") as fsrc:
            fout.write(header)
            buf = bytearray(_COPY_CHUNK)
            view = memoryview(buf)
            for t in plan:
                if t.source_offset is None:
                    fout.write(t.data)
                else:
                    fsrc.seek(t.source_offset)
                    left = t.nbytes
                    while left:
                        n = fsrc.readinto(view[:min(left, _COPY_CHUNK)])
                        if not n:
                            raise CorruptShardError(f"{h.path} ends inside tensor {t.name!r}")
                        fout.write(view[:n])
                        left -= n
                fout.write(b"\0" * (-t.nbytes % align))
                if progress is not None:
                    progress.update(t.nbytes)
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _shard_name(src: Path, a: int, b: int) -> str:
    return f"{src.stem}.L{a:03d}-{b:03d}.gguf"


def _progress_bar(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)


def _load_source(model_path: str | os.PathLike[str]) -> tuple[_Header, str, int, int, int]:
    h = _open(model_path)
    try:
        arch, n_layer, n_embd, n_vocab = h.dims()
        if KEY_FINGERPRINT in h.kv:
            raise ShardError(f"{h.path} is already a shard (edgespec.range present); shard the full model")
        _arch_handling(arch)
    except BaseException:
        h.close()
        raise
    return h, arch, n_layer, n_embd, n_vocab


def _windows_bytes(h: _Header, ranges: Sequence[tuple[int, int]], n_layer: int) -> int:
    return sum(t.nbytes for a, b in ranges for t in _plan_tensors(h, a, b, _role(a, b, n_layer)))


def shard_model(
    model_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    ranges: Sequence[tuple[int, int]] | None = None,
    n_stages: int | None = None,
    progress: bool = True,
) -> Manifest:
    """Write one shard per window plus ``manifest.json`` into ``out_dir``; return the manifest.

    Give either ``ranges`` (contiguous, covering all layers) or ``n_stages`` (even split).
    """
    h, arch, n_layer, n_embd, n_vocab = _load_source(model_path)
    with h:
        if (ranges is None) == (n_stages is None):
            raise ShardError("give exactly one of ranges= or n_stages=")
        rngs = list(ranges) if ranges is not None else even_ranges(n_layer, int(n_stages or 0))
        rngs = [(int(a), int(b)) for a, b in rngs]
        validate_ranges(rngs, n_layer, cover=True)
        _check_windows(h, arch, rngs, n_layer, n_vocab)
        fp = h.fingerprint()
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        bar = _progress_bar(_windows_bytes(h, rngs, n_layer), progress, f"shard {h.path.name}")
        manifest = Manifest(source=h.path.name, fingerprint=fp, architecture=arch, n_layer=n_layer,
                            n_embd=n_embd, n_vocab=n_vocab, ranges=rngs)
        try:
            for a, b in rngs:
                path = out / _shard_name(h.path, a, b)
                _write_window(h, path, arch, n_layer, n_vocab, fp, a, b, bar)
                manifest.shards.append(ShardFile(path.name, (a, b), _role(a, b, n_layer),
                                                 path.stat().st_size, file_sha256(path)))
        finally:
            if bar is not None:
                bar.close()
        (out / MANIFEST_NAME).write_text(manifest.to_json())
        return manifest


def cut_window(
    model_path: str | os.PathLike[str],
    layer_range: tuple[int, int],
    out_path: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> Path:
    """Cut one window from a full GGUF (a node carving its own stage). Returns the shard path.

    ``out_path`` defaults to ``<model dir>/<stem>.Laaa-bbb.gguf``; an existing file there that is
    already this window of this model is reused.
    """
    h, arch, n_layer, _n_embd, n_vocab = _load_source(model_path)
    with h:
        a, b = int(layer_range[0]), int(layer_range[1])
        validate_ranges([(a, b)], n_layer, cover=False)
        _check_windows(h, arch, [(a, b)], n_layer, n_vocab)
        fp = h.fingerprint()
        out = Path(out_path) if out_path is not None else h.path.with_name(_shard_name(h.path, a, b))
        if out.exists():
            try:
                info = read_info(out)
                if info.fingerprint == fp and info.layer_range == (a, b):
                    return out
            except ShardError:
                pass  # unreadable leftover: rewrite it
        out.parent.mkdir(parents=True, exist_ok=True)
        bar = _progress_bar(_windows_bytes(h, [(a, b)], n_layer), progress, f"cut {a}:{b}")
        try:
            _write_window(h, out, arch, n_layer, n_vocab, fp, a, b, bar)
        finally:
            if bar is not None:
                bar.close()
        return out


def tensor_names(path: str | os.PathLike[str]) -> list[str]:
    """Tensor names in a GGUF file, in file order (diagnostics and tests)."""
    with _open(path) as h:
        return [t.name for t in h.tensors]


def read_tensor_types(path: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """(ggml type name, data bytes) of every tensor in a GGUF file, in file order."""
    with _open(path) as h:
        return [(gguf.GGMLQuantizationType(t.ggml_type).name, t.nbytes) for t in h.tensors]


# --------------------------------------------------------------------------------------------
# Command line


def add_shard_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``edgespec shard`` (for the main CLI's sub-parser)."""
    parser.add_argument("model", help="full GGUF model file")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--stages", type=int, help="number of even layer windows")
    group.add_argument("--ranges", help="explicit windows, e.g. 0:8,8:16,16:24")
    parser.add_argument("--out", required=True, help="output directory (shards + manifest.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_shard_command(args: argparse.Namespace) -> int:
    """Run ``edgespec shard`` from parsed arguments; prints the manifest path. Returns exit code."""
    try:
        ranges = parse_ranges(args.ranges) if args.ranges else None
        manifest = shard_model(args.model, args.out, ranges=ranges, n_stages=args.stages,
                               progress=not args.no_progress)
    except (ShardError, FileNotFoundError) as e:
        print(f"edgespec shard: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    for s in manifest.shards:
        print(f"{s.range[0]:>4}:{s.range[1]:<4} {s.role:<6} {s.bytes / 2**20:9.1f} MiB  {out / s.file}")
    print(f"manifest: {out / MANIFEST_NAME} (fingerprint {manifest.fingerprint})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgespec shard", description=__doc__.split("\n\n")[0])
    add_shard_arguments(parser)
    return run_shard_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
