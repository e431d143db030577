"""Cut a GGUF model into layer-window shards that llama.cpp loads as small models.

A window ``[a, b)`` becomes one GGUF file holding blocks ``a..b-1`` renumbered to ``0..b-a-1``,
``{arch}.block_count = b - a`` and the global tensors (``output_norm``, llama's ``rope_freqs``...):

* the first window keeps the real token embeddings and tokenizer (it turns ids into states);
* the last window keeps the real head (``output.weight`` or the tied ``token_embd``);
* a middle window never sees ids nor produces logits, so it carries a stub vocabulary
  (``tokenizer.ggml.model = "none"``, ``vocab_size = 1``, a zero ``{n_embd, 1}`` embedding) and no
  head: every middle device saves the embedding/head bytes.

Windows, ranges, the manifest and the one name a shard file gets (:func:`shard_file_name`) are
here; reading, writing and per-architecture handling are in their own modules of this package
(docs/design.md 3.1). The command line is ``edgespec shard``.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from edgespec.llm.architectures import ARCHITECTURES, arch_handling, arch_metadata, check_windows
from edgespec.llm.gguf_read import (
    KEY_FINGERPRINT,
    KEY_N_LAYER,
    KEY_N_VOCAB,
    KEY_RANGE,
    KEY_ROLE,
    SCALAR_FMT,
    GGUFHeader,
    ShardError,
    open_gguf,
    read_info,
    window_role,
)
from edgespec.llm.gguf_write import (
    PlannedTensor,
    kv_str,
    kv_u32,
    kv_u32_array,
    pack_str,
    write_gguf,
)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "edgespec-shards/1"

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


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



def shard_file_name(a: int, b: int, fingerprint: str = "", stem: str = "") -> str:
    """The file name of window ``[a, b)``: ``[stem.][fingerprint[:12].]Laaa-bbb.gguf``.

    The one place a shard file is named (shard directories, cut caches, a node's store of sent
    shards): the model's stem says what it is to a person, the fingerprint prefix keeps windows
    of two models with one stem apart.
    """
    parts = [p for p in (stem, fingerprint[:12]) if p]
    return ".".join([*parts, f"L{int(a):03d}-{int(b):03d}", "gguf"])


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



def window_metadata(h: GGUFHeader, arch: str, n_layer: int, n_vocab: int, fp: str, a: int, b: int,
                     role: str) -> list[bytes]:
    """Encoded metadata entries of the window: the source's, verbatim where unchanged."""
    stub = role == "middle"
    dropped = {f"{arch}.block_count", f"{arch}.vocab_size"}
    pinned = arch_metadata(h, arch, n_layer, n_vocab, a, b, dropped)
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
                and kv.sub_type in SCALAR_FMT and kv.length == n_layer and kv.value is not None):
            fmt = SCALAR_FMT[kv.sub_type]  # type: ignore[index]
            part = kv.value[a:b]
            raw = struct.pack("<IIQ", kv.vtype, kv.sub_type, len(part)) + struct.pack(f"<{len(part)}{fmt}", *part)
        out.append(pack_str(key) + raw)
    out.extend(pinned)
    out.append(kv_u32(f"{arch}.block_count", b - a))
    if stub:
        out.append(kv_str("tokenizer.ggml.model", "none"))
        out.append(kv_u32(f"{arch}.vocab_size", 1))
    elif f"{arch}.vocab_size" in h.kv:
        out.append(pack_str(f"{arch}.vocab_size") + h.kv[f"{arch}.vocab_size"].raw)
    out.append(kv_str(KEY_FINGERPRINT, fp))
    out.append(kv_u32_array(KEY_RANGE, [a, b]))
    out.append(kv_u32(KEY_N_LAYER, n_layer))
    out.append(kv_u32(KEY_N_VOCAB, n_vocab))
    out.append(kv_str(KEY_ROLE, role))
    return out



def plan_tensors(h: GGUFHeader, a: int, b: int, role: str) -> list[PlannedTensor]:
    """The window's tensors in file order: renumbered blocks, global tensors, stubs."""
    plan: list[PlannedTensor] = []
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
                plan.append(PlannedTensor(f"blk.{i - a}.{m.group(2)}", t.ne, t.ggml_type, t.nbytes, t.offset))
            continue
        if t.name == "token_embd.weight" and stub:
            n_embd = t.ne[0]
            zeros = np.zeros((1, n_embd), dtype=np.float32).tobytes()
            plan.append(PlannedTensor(t.name, [n_embd, 1], int(gguf.GGMLQuantizationType.F32), len(zeros),
                                 None, zeros))
            continue
        if t.name.startswith("output.") and not keeps_head:
            if stub and handling is not None and handling.head_required and t.name == "output.weight":
                n_embd = t.ne[0]
                zeros = np.zeros((1, n_embd), dtype=np.float32).tobytes()
                plan.append(PlannedTensor(t.name, [n_embd, 1], int(gguf.GGMLQuantizationType.F32), len(zeros),
                                     None, zeros))
            continue  # no head before the last window (tied to token_embd if llama.cpp asks)
        plan.append(PlannedTensor(t.name, t.ne, t.ggml_type, t.nbytes, t.offset))
    return plan



def _write_window(h: GGUFHeader, out_path: Path, arch: str, n_layer: int, n_vocab: int, fp: str,
                  a: int, b: int, progress: Any, digest: bool = False) -> str | None:
    """Write window ``[a, b)`` to ``out_path``; with ``digest``, return the file's sha256."""
    role = window_role(a, b, n_layer)
    return write_gguf(h.path, out_path, window_metadata(h, arch, n_layer, n_vocab, fp, a, b, role),
                      plan_tensors(h, a, b, role), h.alignment, progress, digest=digest)


def _progress_bar(total: int, enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr)


def _load_source(model_path: str | os.PathLike[str]) -> tuple[GGUFHeader, str, int, int, int]:
    h = open_gguf(model_path)
    try:
        arch, n_layer, n_embd, n_vocab = h.dims()
        if KEY_FINGERPRINT in h.kv:
            raise ShardError(f"{h.path} is already a shard (edgespec.range present); shard the full model")
        arch_handling(arch)
    except BaseException:
        h.close()
        raise
    return h, arch, n_layer, n_embd, n_vocab


def _windows_bytes(h: GGUFHeader, ranges: Sequence[tuple[int, int]], n_layer: int) -> int:
    return sum(t.nbytes for a, b in ranges for t in plan_tensors(h, a, b, window_role(a, b, n_layer)))


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
        check_windows(h, arch, rngs, n_layer, n_vocab)
        fp = h.fingerprint()
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        bar = _progress_bar(_windows_bytes(h, rngs, n_layer), progress, f"shard {h.path.name}")
        manifest = Manifest(source=h.path.name, fingerprint=fp, architecture=arch, n_layer=n_layer,
                            n_embd=n_embd, n_vocab=n_vocab, ranges=rngs)
        try:
            for a, b in rngs:
                path = out / shard_file_name(a, b, stem=h.path.stem)
                digest = _write_window(h, path, arch, n_layer, n_vocab, fp, a, b, bar, digest=True)
                manifest.shards.append(ShardFile(path.name, (a, b), window_role(a, b, n_layer),
                                                 path.stat().st_size, str(digest)))
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
        check_windows(h, arch, [(a, b)], n_layer, n_vocab)
        fp = h.fingerprint()
        out = Path(out_path) if out_path is not None else h.path.with_name(shard_file_name(a, b, stem=h.path.stem))
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

