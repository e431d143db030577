"""edgespec.llm (shards, gguf_read, architectures): windows, stub vocabularies, manifest, fingerprints, errors, CLI; plus the
tiny-model generator and the llama.cpp loading helper it relies on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from stage_fixtures import tiny_dir, tiny_llama, tiny_qwen2  # noqa: F401 - fixtures
from tinygguf import make_bare_gguf, make_tiny_gguf, min_vocab

from edgespec.llm import cpu, llamacpp
from edgespec.llm.architectures import UnsupportedArchitectureError
from edgespec.llm.gguf_read import (
    CorruptShardError,
    ShardError,
    file_sha256,
    fingerprint,
    read_info,
    tensor_names,
)
from edgespec.llm.shards import (
    MANIFEST_NAME,
    Manifest,
    cut_window,
    even_ranges,
    parse_ranges,
    shard_model,
)
from edgespec.llm.tokenizer import Tokenizer


def _meta(path: Path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _tensors(path: Path) -> dict[str, tuple[list[int], int]]:
    r = gguf.GGUFReader(path)
    return {t.name: ([int(x) for x in t.shape], int(t.tensor_type)) for t in r.tensors}


def test_three_windows_layout(tiny_qwen2: Path, tmp_path: Path) -> None:  # noqa: F811
    m = shard_model(tiny_qwen2, tmp_path, n_stages=3, progress=False)
    assert m.ranges == [(0, 2), (2, 3), (3, 4)]
    assert [s.role for s in m.shards] == ["first", "middle", "last"]
    on_disk = Manifest.load(tmp_path / MANIFEST_NAME)
    assert on_disk == m and on_disk.fingerprint == fingerprint(tiny_qwen2)
    assert (m.architecture, m.n_layer, m.n_embd, m.n_vocab) == ("qwen2", 4, 64, min_vocab("qwen2") + 32)
    full = _tensors(tiny_qwen2)
    for s, path in zip(m.shards, m.shard_paths(tmp_path), strict=True):
        assert file_sha256(path) == s.sha256 and path.stat().st_size == s.bytes
        meta = _meta(path)
        a, b = s.range
        assert meta["qwen2.block_count"] == b - a
        assert meta["edgespec.range"] == [a, b] and meta["edgespec.fingerprint"] == m.fingerprint
        t = _tensors(path)
        # Blocks renumbered from 0, same shapes and types as the source block.
        for name, spec in full.items():
            if name.startswith("blk."):
                i = int(name.split(".")[1])
                new = f"blk.{i - a}." + name.split(".", 2)[2]
                assert (new in t) == (a <= i < b)
                if a <= i < b:
                    assert t[new] == spec
        assert "output_norm.weight" in t
        if s.role == "middle":
            assert t["token_embd.weight"] == ([64, 1], int(gguf.GGMLQuantizationType.F32))
            assert "output.weight" not in t
            assert meta["tokenizer.ggml.model"] == "none" and meta["qwen2.vocab_size"] == 1
            assert "tokenizer.ggml.tokens" not in meta
        else:
            assert t["token_embd.weight"] == full["token_embd.weight"]
            assert meta["tokenizer.ggml.model"] == "gpt2"
            assert ("output.weight" in t) == (s.role == "last")
        # llama.cpp loads every window as a model of its own.
        with llamacpp.load_model(path) as model:
            assert model.n_layer == b - a and model.n_embd == 64
            assert model.n_vocab == (1 if s.role == "middle" else m.n_vocab)
        info = read_info(path)
        assert info.is_shard and info.layer_range == (a, b) and info.n_vocab == m.n_vocab


def test_llama_keeps_global_tensors_and_cut_window_matches(tiny_llama: Path, tmp_path: Path) -> None:  # noqa: F811
    m = shard_model(tiny_llama, tmp_path / "all", ranges=[(0, 1), (1, 3), (3, 4)], progress=False)
    for path in m.shard_paths(tmp_path / "all"):
        assert "rope_freqs.weight" in tensor_names(path)
    cut = cut_window(tiny_llama, (1, 3), tmp_path / "own.gguf")
    assert file_sha256(cut) == m.shards[1].sha256  # a node cutting its own window gets the same file
    assert cut_window(tiny_llama, (1, 3), tmp_path / "own.gguf") == cut  # reused, not rewritten
    with pytest.raises(ShardError, match="already a shard"):
        shard_model(cut, tmp_path / "again", n_stages=2, progress=False)


def test_fingerprint_identity(tiny_dir: Path, tiny_qwen2: Path, tiny_llama: Path) -> None:  # noqa: F811
    again = make_tiny_gguf(tiny_dir / "again.gguf", arch="qwen2", n_layer=4, n_embd=64, seed=0)
    other = make_tiny_gguf(tiny_dir / "seed9.gguf", arch="qwen2", n_layer=4, n_embd=64, seed=9)
    fp = fingerprint(tiny_qwen2)
    assert len(fp) == 32 and fingerprint(again) == fp
    assert fingerprint(other) != fp and fingerprint(tiny_llama) != fp


def test_ranges() -> None:
    assert even_ranges(24, 5) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 24)]
    assert parse_ranges("0:8, 8:16,16:24") == [(0, 8), (8, 16), (16, 24)]
    with pytest.raises(ShardError, match="bad layer range"):
        parse_ranges("0-8")
    with pytest.raises(ShardError, match="1..4"):
        even_ranges(4, 5)


@pytest.mark.parametrize("ranges, message", [
    ([(0, 2), (3, 4)], "contiguous"),
    ([(0, 2), (2, 3)], "end at 4"),
    ([(0, 2), (2, 2), (2, 4)], "empty"),
    ([(0, 5)], "outside"),
])
def test_bad_ranges(tiny_qwen2: Path, tmp_path: Path, ranges, message) -> None:  # noqa: F811
    with pytest.raises(ShardError, match=message):
        shard_model(tiny_qwen2, tmp_path, ranges=ranges, progress=False)
    assert not list(tmp_path.glob("*.gguf"))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = make_bare_gguf(tmp_path / "bloom.gguf", "bloom")
    with pytest.raises(UnsupportedArchitectureError, match="'bloom' cannot be split into layer windows yet"):
        shard_model(path, tmp_path / "out", n_stages=2, progress=False)


def test_corrupt_files(tiny_qwen2: Path, tmp_path: Path) -> None:  # noqa: F811
    data = tiny_qwen2.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(data[: len(data) - 5000])
    with pytest.raises(CorruptShardError, match="truncated"):
        read_info(tmp_path / "trunc.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:100])
    with pytest.raises(CorruptShardError):
        read_info(tmp_path / "head.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"\0" * 64)
    with pytest.raises(CorruptShardError, match="not a GGUF"):
        fingerprint(tmp_path / "junk.gguf")
    with pytest.raises(FileNotFoundError):
        read_info(tmp_path / "missing.gguf")


def test_cli(tiny_qwen2: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-m", "edgespec", "shard", str(tiny_qwen2), "--ranges", "0:1,1:4",
                        "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "manifest:" in r.stdout
    assert json.loads((out / MANIFEST_NAME).read_text())["ranges"] == [[0, 1], [1, 4]]
    r = subprocess.run([sys.executable, "-m", "edgespec", "shard", str(tiny_qwen2), "--ranges", "0:1,2:4",
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "contiguous" in r.stderr


def test_tiny_models_tokenize_and_chat(tiny_qwen2: Path, tiny_llama: Path) -> None:  # noqa: F811
    for path in (tiny_qwen2, tiny_llama):
        with llamacpp.load_model(path, vocab_only=True) as m:
            tok = Tokenizer(m)
            text = "def f(x):\n    return x * 2  # ünïcode"
            ids = tok.encode(text, add_special=False)
            assert tok.decode(ids) == text
            if path == tiny_qwen2:
                assert len(ids) < len(text.encode())  # BPE merges are used
            else:
                assert any(i >= 259 for i in ids)  # SentencePiece pieces, not only byte fallback
                assert any(3 <= i < 259 for i in ids)  # "ü" falls back to byte tokens
            chat = tok.chat_prompt([{"role": "user", "content": "hi"}])
            assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with llamacpp.load_model(tiny_qwen2, vocab_only=True) as m:
        tok = Tokenizer(m)
        ids = tok.chat_tokens([{"role": "user", "content": "hi"}])
        assert ids[0] == tok.encode("<|im_start|>", add_special=False, parse_special=True)[0]
        assert tok.is_eog(tok.eos_id)
    with pytest.raises(ValueError, match="n_vocab must be"):
        make_tiny_gguf(tiny_qwen2.parent / "x.gguf", n_vocab=100)


def test_llamacpp_helpers(tmp_path: Path) -> None:
    assert cpu.default_threads(contexts_on_host=3) == 1
    assert cpu.default_threads() == cpu.physical_cores() >= 1
    with pytest.raises(FileNotFoundError):
        llamacpp.load_model(tmp_path / "nope.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    with pytest.raises(llamacpp.LlamaLoadError, match="could not load"):
        llamacpp.load_model(tmp_path / "bad.gguf")
    addrs = llamacpp.ggml_function_addresses()
    assert set(addrs) == {"ggml_get_name", "ggml_nbytes", "ggml_backend_tensor_get", "ggml_backend_tensor_set"}
    assert all(a > 0 for a in addrs.values())


@pytest.mark.real_model
def test_real_model_streaming_memory(real_model_path: Path, tmp_path: Path) -> None:
    """Sharding the 491 MB model keeps the process's peak RSS far below the model size."""
    # VmHWM (this process's own peak), not ru_maxrss: Linux carries ru_maxrss over from the
    # parent across fork+exec, so a child of a big pytest process would report the parent's.
    code = (
        "import sys\n"
        "from edgespec.llm.shards import shard_model\n"
        "m = shard_model(sys.argv[1], sys.argv[2], n_stages=3, progress=False)\n"
        "hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
        "print(hwm, sum(s.bytes for s in m.shards))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(real_model_path), str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    peak_kib, written = (int(x) for x in r.stdout.split())
    assert written > 400 * 2**20
    assert peak_kib * 1024 < 160 * 2**20, f"peak RSS {peak_kib} KiB"
