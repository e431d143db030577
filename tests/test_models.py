"""Model registry: assembly from part packages, caching, corruption handling, clear errors."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgespec.llm import models


def _make_part_packages(root: Path, prefix: str, chunks: list[bytes]) -> None:
    """Lay out importable part packages exactly like the index's wheels install them."""
    for i, data in enumerate(chunks, start=1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A registry entry whose parts are installed packages on sys.path (no network)."""
    chunks = [bytes([i]) * (1000 + 37 * i) for i in range(1, 4)]
    chunks[0] = b"GGUF" + chunks[0][4:]
    site = tmp_path / "site"
    _make_part_packages(site, "edgespec_testpart_part", chunks)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(chunks)
    spec = models.ModelSpec(
        name="test-model", filename="test-model.gguf", description="test", arch="qwen2",
        n_layer=2, n_embd=8, size=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
        parts=models._parts("edgespec-testpart-part", "1.0", [len(c) for c in chunks]),
    )
    monkeypatch.setitem(models.REGISTRY, spec.name, spec)
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    return spec, whole


def test_fetch_assembles_verifies_and_caches(fake_model, monkeypatch):
    spec, whole = fake_model
    path = models.fetch(spec.name, progress=False)
    assert path == models.cached_path(spec.name)
    assert path.read_bytes() == whole
    assert models.cache_state(spec.name) == "ok"
    assert not list(path.parent.glob("*.partial"))

    copies = []
    monkeypatch.setattr(models, "_copy_part", lambda *a, **k: copies.append(a))
    assert models.fetch(spec.name, progress=False) == path
    assert copies == [], "a second fetch must not read or download any part"


def test_truncated_cache_is_detected_and_reassembled(fake_model):
    spec, whole = fake_model
    path = models.fetch(spec.name, progress=False)
    with open(path, "r+b") as f:
        f.truncate(spec.size // 2)
    assert models.cache_state(spec.name) == "bad"
    assert models.fetch(spec.name, progress=False).read_bytes() == whole


def test_same_size_corruption_is_caught_by_verify_and_refetched(fake_model):
    spec, whole = fake_model
    path = models.fetch(spec.name, progress=False)
    data = bytearray(whole)
    data[10] ^= 0xFF
    before = path.stat().st_mtime_ns
    path.write_bytes(bytes(data))
    # Coarse filesystem clocks can keep the mtime; a real edit happens later than the fetch.
    os.utime(path, ns=(before + 10**9, before + 10**9))
    assert models.cache_state(spec.name) == "bad"
    assert not models.verify(spec.name, progress=False)
    assert models.fetch(spec.name, progress=False).read_bytes() == whole


def test_hash_mismatch_leaves_no_file(fake_model, monkeypatch):
    spec, _ = fake_model
    bad = models.ModelSpec(**{**spec.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(models.REGISTRY, spec.name, bad)
    with pytest.raises(models.ModelError, match="sha256 mismatch"):
        models.fetch(spec.name, progress=False)
    assert not models.cached_path(spec.name).exists()
    assert not list(models.models_dir().glob("*.partial"))


def test_resolve_errors_are_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    with pytest.raises(models.ModelError, match="no such model file"):
        models.resolve(tmp_path / "missing.gguf")
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(models.ModelError, match="not a GGUF file"):
        models.resolve(not_gguf)
    with pytest.raises(models.ModelError, match="edgespec models fetch qwen2.5-coder-0.5b"):
        models.resolve("qwen2.5-coder-0.5b", fetch_missing=False)
    with pytest.raises(models.ModelError, match="unknown model"):
        models.cached_path("no-such-model")


def test_cli_fetch_twice_downloads_nothing(real_model_path):
    """The real default model: a second `edgespec models fetch` is a no-op that prints the path."""
    cmd = [sys.executable, "-m", "edgespec", "models", "fetch", "qwen2.5-coder-0.5b", "-q"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(real_model_path)
    assert "nothing downloaded" in out.stderr
    assert real_model_path.stat().st_size == models.REGISTRY["qwen2.5-coder-0.5b"].size


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "edgespec", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "models" in out
    out = subprocess.run([sys.executable, "-m", "edgespec", "models", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for action in ("list", "fetch", "path", "verify"):
        assert action in out


@pytest.fixture
def tiny_disk(tmp_path):
    """A real, nearly full disk: a tmpfs of ``size`` at a folder (root only)."""
    mounted: list[Path] = []

    def make(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_fetch_onto_a_full_disk_says_so_in_one_line(tiny_disk):
    home = tiny_disk("1m")
    env = dict(os.environ, EDGESPEC_HOME=str(home))
    res = subprocess.run([sys.executable, "-m", "edgespec", "models", "fetch",
                          "qwen2.5-coder-0.5b"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode != 0
    err = res.stderr.strip().splitlines()
    assert len(err) == 1, res.stderr
    assert "not enough disk space" in err[0] and str(home) in err[0] and "EDGESPEC_HOME" in err[0]
    assert "package index" not in res.stderr and "Traceback" not in res.stderr
    assert [p.name for p in home.rglob("*") if p.is_file()] == []  # nothing half-written left


def test_a_disk_that_fills_while_writing_is_named_not_the_index(fake_model, tiny_disk,
                                                                monkeypatch):
    spec, _whole = fake_model
    home = tiny_disk("4k")
    (home / "filler").write_bytes(b"x" * 4096)  # another program filled the disk...
    real = models.shutil.disk_usage
    calls = []

    def usage(path):  # ...after the space check passed
        calls.append(path)
        return real(path)._replace(free=1 << 30) if len(calls) == 1 else real(path)

    monkeypatch.setattr(models.shutil, "disk_usage", usage)
    monkeypatch.setenv("EDGESPEC_HOME", str(home))
    with pytest.raises(models.ModelError, match="not enough disk space") as err:
        models.fetch(spec.name, progress=False)
    assert "package index" not in str(err.value)
    assert not any(p.name.endswith(".gguf") or ".partial" in p.name for p in home.rglob("*"))


def test_pip_running_out_of_space_is_named_not_the_index(tmp_path, tiny_disk, monkeypatch):
    """A part pip must fetch, onto a disk too small for its wheel: pip itself hits ENOSPC
    (a local find-links folder stands in for the index)."""
    import shutil
    import zipfile

    chunk = b"GGUF" + os.urandom(300_000 - 4)
    name = "edgespec_testfull_part1"
    links = tmp_path / "links"
    links.mkdir()
    with zipfile.ZipFile(links / f"{name}-1.0-py3-none-any.whl", "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{name}/data/part01.bin", chunk)
        info = f"{name}-1.0.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    spec = models.ModelSpec(
        name="test-full", filename="test-full.gguf", description="test", arch="qwen2",
        n_layer=2, n_embd=8, size=len(chunk), sha256=hashlib.sha256(chunk).hexdigest(),
        parts=models._parts("edgespec-testfull-part", "1.0", [len(chunk)]),
    )
    monkeypatch.setitem(models.REGISTRY, spec.name, spec)
    home = tiny_disk("128k")
    monkeypatch.setenv("EDGESPEC_HOME", str(home))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    real = shutil.disk_usage
    calls = []

    def usage(path):  # the space check up front passes: the disk fills under pip
        calls.append(path)
        return real(path)._replace(free=1 << 30) if len(calls) == 1 else real(path)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    with pytest.raises(models.ModelError) as err:
        models.fetch(spec.name, progress=False)
    msg = str(err.value)
    assert msg.startswith(f"not enough disk space in {models.models_dir()}"), msg
    assert "\n" not in msg and "EDGESPEC_HOME" in msg
    assert "package index" not in msg and "Traceback" not in msg and "pip " not in msg
    assert not any(p.is_file() for p in home.rglob("*"))  # pip's partial wheel went too
