"""The draft model's Q4_0 copy (edgespec.drafters.quant) and the CPU extra-buffer default."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from tinygguf import make_tiny_gguf

from edgespec.drafters import DraftModelDrafter
from edgespec.drafters.quant import fast_draft, mostly_fast
from edgespec.llm.cpu import cpu_has_amx, extra_bufts_default
from edgespec.llm.gguf_read import read_tensor_types


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _types(path: Path) -> Counter:
    out: Counter = Counter()
    for name, nbytes in read_tensor_types(path):
        out[name] += nbytes
    return out


def test_fast_draft_makes_one_cached_q4_0_copy(home, tmp_path):
    src = make_tiny_gguf(tmp_path / "draft.gguf", n_layer=2, n_embd=64, seed=3)
    assert not mostly_fast(src)  # random f32/f16 weights
    said: list[str] = []
    out = fast_draft(src, say=said.append)
    assert out != src and out.parent == home / "models" / "derived" and out.is_file()
    assert len(said) == 1 and "Q4_0 copy" in said[0]
    types = _types(out)
    assert types["Q4_0"] > sum(v for k, v in types.items() if k != "Q4_0")  # weights are Q4_0
    assert mostly_fast(out)
    assert not list(out.parent.glob("*.partial"))
    # Cached: a second call quantizes nothing and returns the same file.
    mtime = out.stat().st_mtime_ns
    assert fast_draft(src, say=said.append) == out and len(said) == 1
    assert out.stat().st_mtime_ns == mtime
    # Already fast: used as it is; "none" keeps any file as given.
    assert fast_draft(out) == out
    assert fast_draft(src, "none") == src
    with pytest.raises(ValueError, match="q4_0, none"):
        fast_draft(src, "q2_k")


def test_a_failed_copy_falls_back_to_the_file_as_given(home, tmp_path, monkeypatch):
    import edgespec.drafters.quant as dq

    def refuse(src, dst, qtype):
        Path(dst).write_bytes(b"half a file")
        raise dq.LlamaLoadError("llama.cpp could not quantize it (code 1)")

    monkeypatch.setattr(dq, "quantize_model", refuse)
    src = make_tiny_gguf(tmp_path / "draft.gguf", n_layer=2, n_embd=64, seed=5)
    assert fast_draft(src) == src  # only speed is lost
    derived = home / "models" / "derived"
    assert not list(derived.glob("*"))  # no half-written copy left behind


def test_quantized_draft_keeps_the_targets_tokenizer(home, tmp_path):
    """The copy still passes the tokenizer check against the original (same vocabulary) and
    drafts: quantization changes only how good its guesses are."""
    src = make_tiny_gguf(tmp_path / "draft.gguf", n_layer=2, n_embd=64, seed=4)
    with DraftModelDrafter(fast_draft(src), target=src, n_ctx=256) as drafter:
        drafter.begin([5, 6, 7, 8])
        tree = drafter.propose(8, budget=6, max_depth=4)
        assert len(tree) == 6


def test_extra_buffer_types_off_only_with_amx(tmp_path, monkeypatch):
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile amx_int8\n")
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_vnni\n")
    assert cpu_has_amx(str(amx)) and not cpu_has_amx(str(plain))
    assert not cpu_has_amx(str(tmp_path / "missing"))
    monkeypatch.setenv("EDGESPEC_EXTRA_BUFTS", "0")
    assert extra_bufts_default() is False
    monkeypatch.setenv("EDGESPEC_EXTRA_BUFTS", "1")
    assert extra_bufts_default() is True
    monkeypatch.delenv("EDGESPEC_EXTRA_BUFTS")
    assert extra_bufts_default() is (not cpu_has_amx())
