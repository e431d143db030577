"""Cut a GGUF model into layer-window shards that llama.cpp loads as small models (DESIGN 3.1).

A window ``[a, b)`` becomes one GGUF file holding blocks ``a..b-1`` renumbered to ``0..b-a-1``,
``{arch}.block_count = b - a`` and the global tensors (``output_norm``, llama's ``rope_freqs``...):

* the first window keeps the real token embeddings and tokenizer (it turns ids into states);
* the last window keeps the real head (``output.weight`` or the tied ``token_embd``);
* a middle window never sees ids nor produces logits, so it carries a stub vocabulary
  (``tokenizer.ggml.model = "none"``, ``vocab_size = 1``, a zero ``{n_embd, 1}`` embedding) and no
  head: every middle device saves the embedding/head bytes.

Every shard records ``edgespec.fingerprint`` (the full model's identity, see :func:`fingerprint`),
``edgespec.range``, ``edgespec.n_layer`` and ``edgespec.role``, so a runtime can refuse a shard of
another model or a neighbour whose range does not join its own. Tensor data is streamed from the
source file in fixed-size chunks: memory stays flat whatever the model size.

Command line (also ``edgespec shard``)::

    python -m edgespec.shard MODEL.gguf --stages 3 --out DIR
    python -m edgespec.shard MODEL.gguf --ranges 0:8,8:16,16:24 --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

__all__ = [
    "MANIFEST_NAME",
    "SUPPORTED_ARCHITECTURES",
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
    "run_shard_command",
    "shard_model",
    "validate_ranges",
]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
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
# Reading


def _open(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    try:
        return gguf.GGUFReader(p)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad bytes
        raise CorruptShardError(f"{p} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def _scalar(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    v = f.contents()
    return v


def _arch(reader: gguf.GGUFReader, path: Path) -> str:
    arch = _scalar(reader, "general.architecture")
    if not isinstance(arch, str):
        raise CorruptShardError(f"{path} has no general.architecture")
    return arch


def _tensor_map(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _ne(t: Any) -> list[int]:
    # ggml order: ne[0] is the contiguous dimension (n_embd for token_embd).
    return [int(x) for x in t.shape]


def _model_dims(reader: gguf.GGUFReader, path: Path) -> tuple[str, int, int, int]:
    arch = _arch(reader, path)
    n_layer = _scalar(reader, f"{arch}.block_count")
    n_embd = _scalar(reader, f"{arch}.embedding_length")
    if n_layer is None or n_embd is None:
        raise CorruptShardError(f"{path} lacks {arch}.block_count / {arch}.embedding_length")
    tensors = _tensor_map(reader)
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise CorruptShardError(f"{path} has no token_embd.weight")
    n_vocab = _ne(emb)[1]
    return arch, int(n_layer), int(n_embd), int(n_vocab)


def _compute_fingerprint(reader: gguf.GGUFReader, path: Path) -> str:
    arch, n_layer, n_embd, n_vocab = _model_dims(reader, path)
    h = hashlib.sha256()
    h.update(json.dumps({"arch": arch, "n_layer": n_layer, "n_embd": n_embd, "n_vocab": n_vocab},
                        sort_keys=True).encode())
    raw = reader.data  # the file as a read-only memmap: only the sampled pages are touched
    for t in sorted(reader.tensors, key=lambda t: t.name):
        h.update(f"{t.name}|{_ne(t)}|{int(t.tensor_type)}|{int(t.n_bytes)}\n".encode())
        start, n = int(t.data_offset), int(t.n_bytes)
        h.update(bytes(raw[start:start + min(n, _FP_SAMPLE)]))
        if n > _FP_SAMPLE:
            h.update(bytes(raw[start + max(_FP_SAMPLE, n - _FP_SAMPLE):start + n]))
    return h.hexdigest()[:32]


def read_info(path: str | os.PathLike[str]) -> ShardInfo:
    """Identify a GGUF file: a full model or a shard written by this module.

    Raises:
        FileNotFoundError, CorruptShardError.
    """
    p = Path(path)
    reader = _open(p)
    try:
        arch, n_layer, n_embd, n_vocab_file = _model_dims(reader, p)
        fp = _scalar(reader, KEY_FINGERPRINT)
        if fp is None:
            return ShardInfo(p, arch, _compute_fingerprint(reader, p), (0, n_layer), n_layer, n_embd,
                             n_vocab_file, "full", False)
        rng = _scalar(reader, KEY_RANGE)
        total = _scalar(reader, KEY_N_LAYER)
        n_vocab = _scalar(reader, KEY_N_VOCAB)
        role = _scalar(reader, KEY_ROLE)
        if rng is None or total is None or n_vocab is None or role is None or len(rng) != 2:
            raise CorruptShardError(f"{p} has {KEY_FINGERPRINT} but incomplete edgespec.* metadata")
        a, b = int(rng[0]), int(rng[1])
        if b - a != n_layer or not 0 <= a < b <= int(total):
            raise CorruptShardError(
                f"{p}: edgespec.range {a}:{b} disagrees with block_count {n_layer} / n_layer {total}")
        return ShardInfo(p, arch, str(fp), (a, b), int(total), n_embd, int(n_vocab), str(role), True)
    finally:
        _close_reader(reader)


def _close_reader(reader: gguf.GGUFReader) -> None:
    mm = getattr(reader.data, "_mmap", None)
    if mm is not None:
        try:
            mm.close()
        except (BufferError, ValueError):
            pass  # a view is still alive; the mapping goes with it


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


def _field_value(f: Any) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """A reader field as (value, type, sub_type) for GGUFWriter.add_key_value, strings as raw bytes."""
    main = f.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        if len(f.types) != 2:
            raise ShardError(f"nested metadata array {f.name!r} is not supported")
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]) for i in f.data], main, sub
        return [x.item() for i in f.data for x in f.parts[i]], main, sub
    if main == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]), main, None
    return f.parts[f.data[0]][0].item(), main, None


def _window_metadata(reader: gguf.GGUFReader, arch: str, n_layer: int, a: int, b: int,
                     stub_vocab: bool) -> list[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    out = []
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.startswith("edgespec."):
            continue
        if stub_vocab and key.startswith("tokenizer."):
            continue
        if key in (f"{arch}.block_count", f"{arch}.vocab_size"):
            continue
        value, vtype, sub = _field_value(f)
        # Per-layer arrays (some llama variants store head counts or ffn sizes per layer) follow
        # the renumbered blocks.
        if (key.startswith(f"{arch}.") and vtype == gguf.GGUFValueType.ARRAY
                and sub != gguf.GGUFValueType.STRING and len(value) == n_layer):
            value = value[a:b]
        out.append((key, value, vtype, sub))
    return out


def _plan_tensors(reader: gguf.GGUFReader, a: int, b: int, role: str) -> list[tuple[str, Any]]:
    """(new name, source tensor or a numpy stub) in the order they are written."""
    plan: list[tuple[str, Any]] = []
    tensors = _tensor_map(reader)
    stub = role == "middle"
    keeps_head = role in ("last", "full")
    for t in reader.tensors:
        m = _BLOCK_RE.match(t.name)
        if m:
            i = int(m.group(1))
            if a <= i < b:
                plan.append((f"blk.{i - a}.{m.group(2)}", t))
            continue
        if t.name == "token_embd.weight":
            if stub:
                n_embd = _ne(tensors["token_embd.weight"])[0]
                plan.append((t.name, np.zeros((1, n_embd), dtype=np.float32)))
            else:
                plan.append((t.name, t))
            continue
        if t.name.startswith("output.") and not keeps_head:
            continue  # no head before the last window (tied to token_embd if llama.cpp asks)
        plan.append((t.name, t))  # output_norm, rope_freqs and other global tensors
    return plan


def _tensor_bytes(item: Any) -> int:
    return int(item.nbytes) if isinstance(item, np.ndarray) else int(item.n_bytes)


def _write_window(reader: gguf.GGUFReader, src: Path, out_path: Path, arch: str, n_layer: int,
                  n_vocab: int, fp: str, a: int, b: int, progress: Any) -> None:
    role = _role(a, b, n_layer)
    stub = role == "middle"
    tmp = out_path.with_name(out_path.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    alignment = _scalar(reader, "general.alignment")
    if alignment is not None:
        writer.data_alignment = int(alignment)
    for key, value, vtype, sub in _window_metadata(reader, arch, n_layer, a, b, stub):
        writer.add_key_value(key, value, vtype, sub_type=sub)
    writer.add_uint32(f"{arch}.block_count", b - a)
    if stub:
        writer.add_string("tokenizer.ggml.model", "none")
        writer.add_uint32(f"{arch}.vocab_size", 1)
    elif f"{arch}.vocab_size" in reader.fields:
        writer.add_uint32(f"{arch}.vocab_size", n_vocab)
    writer.add_string(KEY_FINGERPRINT, fp)
    writer.add_array(KEY_RANGE, [a, b])
    writer.add_uint32(KEY_N_LAYER, n_layer)
    writer.add_uint32(KEY_N_VOCAB, n_vocab)
    writer.add_string(KEY_ROLE, role)

    plan = _plan_tensors(reader, a, b, role)
    for name, item in plan:
        if isinstance(item, np.ndarray):
            writer.add_tensor_info(name, item.shape, item.dtype, item.nbytes)
        else:
            writer.add_tensor_info(name, item.data.shape, item.data.dtype, int(item.n_bytes),
                                   raw_dtype=item.tensor_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        fout = writer.fout[0]
        align = writer.data_alignment
        with open(src, "rb") as fsrc:
            buf = bytearray(_COPY_CHUNK)
            view = memoryview(buf)
            for _, item in plan:
                fout.write(b"\0" * (-fout.tell() % align))
                if isinstance(item, np.ndarray):
                    fout.write(item.tobytes())
                    nbytes = item.nbytes
                else:
                    nbytes = int(item.n_bytes)
                    fsrc.seek(int(item.data_offset))
                    left = nbytes
                    while left:
                        n = fsrc.readinto(view[:min(left, _COPY_CHUNK)])
                        if not n:
                            raise CorruptShardError(f"{src} ends inside tensor data (truncated file?)")
                        fout.write(view[:n])
                        left -= n
                if progress is not None:
                    progress.update(nbytes)
            fout.write(b"\0" * (-fout.tell() % align))
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def _shard_name(src: Path, a: int, b: int) -> str:
    return f"{src.stem}.L{a:03d}-{b:03d}.gguf"


def _progress_bar(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)


def _load_source(model_path: str | os.PathLike[str]) -> tuple[Path, gguf.GGUFReader, str, int, int, int]:
    src = Path(model_path)
    reader = _open(src)
    arch, n_layer, n_embd, n_vocab = _model_dims(reader, src)
    if KEY_FINGERPRINT in reader.fields:
        _close_reader(reader)
        raise ShardError(f"{src} is already a shard (edgespec.range present); shard the full model")
    if arch not in SUPPORTED_ARCHITECTURES:
        _close_reader(reader)
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported yet for layer-window sharding "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return src, reader, arch, n_layer, n_embd, n_vocab


def _windows_bytes(reader: gguf.GGUFReader, ranges: Sequence[tuple[int, int]], n_layer: int) -> int:
    return sum(_tensor_bytes(item) for a, b in ranges
               for _, item in _plan_tensors(reader, a, b, _role(a, b, n_layer)))


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
    src, reader, arch, n_layer, n_embd, n_vocab = _load_source(model_path)
    try:
        if (ranges is None) == (n_stages is None):
            raise ShardError("give exactly one of ranges= or n_stages=")
        rngs = list(ranges) if ranges is not None else even_ranges(n_layer, int(n_stages or 0))
        rngs = [(int(a), int(b)) for a, b in rngs]
        validate_ranges(rngs, n_layer, cover=True)
        fp = _compute_fingerprint(reader, src)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        bar = _progress_bar(_windows_bytes(reader, rngs, n_layer), progress, f"shard {src.name}")
        manifest = Manifest(source=src.name, fingerprint=fp, architecture=arch, n_layer=n_layer,
                            n_embd=n_embd, n_vocab=n_vocab, ranges=rngs)
        try:
            for a, b in rngs:
                path = out / _shard_name(src, a, b)
                _write_window(reader, src, path, arch, n_layer, n_vocab, fp, a, b, bar)
                manifest.shards.append(ShardFile(path.name, (a, b), _role(a, b, n_layer),
                                                 path.stat().st_size, file_sha256(path)))
        finally:
            if bar is not None:
                bar.close()
        (out / MANIFEST_NAME).write_text(manifest.to_json())
        return manifest
    finally:
        _close_reader(reader)


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
    src, reader, arch, n_layer, _n_embd, n_vocab = _load_source(model_path)
    try:
        a, b = int(layer_range[0]), int(layer_range[1])
        validate_ranges([(a, b)], n_layer, cover=False)
        fp = _compute_fingerprint(reader, src)
        out = Path(out_path) if out_path is not None else src.with_name(_shard_name(src, a, b))
        if out.exists():
            try:
                info = read_info(out)
                if info.fingerprint == fp and info.layer_range == (a, b):
                    return out
            except ShardError:
                pass  # unreadable leftover: rewrite it
        out.parent.mkdir(parents=True, exist_ok=True)
        bar = _progress_bar(_windows_bytes(reader, [(a, b)], n_layer), progress, f"cut {a}:{b}")
        try:
            _write_window(reader, src, out, arch, n_layer, n_vocab, fp, a, b, bar)
        finally:
            if bar is not None:
                bar.close()
        return out
    finally:
        _close_reader(reader)


def iter_tensor_names(path: str | os.PathLike[str]) -> Iterator[str]:
    """Tensor names in a GGUF file (diagnostics and tests)."""
    reader = _open(path)
    try:
        yield from (t.name for t in reader.tensors)
    finally:
        _close_reader(reader)


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
