"""Every architecture in edgespec.llm.architectures.ARCHITECTURES: a 3-window split of its tiny model computes
exactly what the unsplit model computes, in one process (logits) and through a ring of three
node processes (greedy tokens); architectures outside the table are refused in one line.

Each case is cut so that its traps bite: windows start at layers where a restarted sliding-window
period, a leading-dense count or a layer-count constant would change the computation, and the
prompt is longer than every sliding window.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
from tinygguf import make_bare_gguf, make_tiny_gguf, min_vocab

from edgespec.llm import llamacpp
from edgespec.llm.architectures import ARCHITECTURES, UnsupportedArchitectureError
from edgespec.llm.gguf_read import ShardError, read_info
from edgespec.llm.shards import cut_window, shard_model
from edgespec.llm.tokenizer import Tokenizer
from edgespec.node.runtime import StageRuntime


@dataclass(frozen=True)
class Case:
    id: str
    arch: str
    n_layer: int
    ranges: list[tuple[int, int]]
    kwargs: dict = field(default_factory=dict)


CASES = [
    Case("qwen2", "qwen2", 5, [(0, 2), (2, 4), (4, 5)]),
    Case("llama", "llama", 5, [(0, 2), (2, 4), (4, 5)]),
    Case("mixtral", "llama", 5, [(0, 2), (2, 4), (4, 5)], {"n_expert": 4}),
    Case("qwen3", "qwen3", 5, [(0, 2), (2, 4), (4, 5)]),
    Case("qwen3moe", "qwen3moe", 5, [(0, 2), (2, 4), (4, 5)]),
    # period 6: layer 5 is the only global layer; it opens the last window (its layer 0).
    # period 2; every input is scaled by sqrt(n_embd), hidden states included.
    Case("gemma2", "gemma2", 5, [(0, 1), (1, 3), (3, 5)]),
    Case("gemma3", "gemma3", 8, [(0, 3), (3, 5), (5, 8)]),
    Case("phi3", "phi3", 5, [(0, 2), (2, 4), (4, 5)]),
    # two leading dense blocks: the second window starts inside them.
    Case("deepseek2", "deepseek2", 5, [(0, 1), (1, 3), (3, 5)], {"leading_dense": 2}),
    # 27 layers make llama.cpp infer "lite" (no q_lora_rank); 9-layer windows would not.
    Case("deepseek2-lite", "deepseek2", 27, [(0, 9), (9, 18), (18, 27)],
         {"q_lora_rank": 0, "n_embd": 32}),
    # 48 layers and a 154880-token vocabulary without expert_gating_func: llama.cpp infers sigmoid
    # gating (GLM-4.7-Lite); 16-layer windows would get softmax.
    Case("deepseek2-glm-lite", "deepseek2", 48, [(0, 16), (16, 32), (32, 48)],
         {"n_embd": 32, "n_vocab": 154880, "n_pad": 154880 - min_vocab("deepseek2") - 32,
          "expert_gating": False}),
    # period 2, windows starting at odd layers.
    Case("gpt-oss", "gpt-oss", 5, [(0, 1), (1, 3), (3, 5)]),
]

PROMPT = [(i * 37 + 11) % 250 + 3 for i in range(24)]  # longer than every sliding window (4)
N_TOKENS = 32


def test_cases_cover_the_table() -> None:
    assert {c.arch for c in CASES} == set(ARCHITECTURES)


@pytest.fixture(scope="module", params=CASES, ids=[c.id for c in CASES])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    c: Case = request.param
    base = tmp_path_factory.mktemp(c.id)
    model = make_tiny_gguf(base / f"{c.id}.gguf", arch=c.arch, n_layer=c.n_layer, seed=7, **c.kwargs)
    manifest = shard_model(model, base / "shards", ranges=c.ranges, progress=False)
    return c, model, manifest.shard_paths(base / "shards")


def _greedy_unsplit(model: Path, n: int) -> list[int]:
    with llamacpp.load_model(model, vocab_only=True) as vocab:
        tok = Tokenizer(vocab)
        with StageRuntime(model, n_ctx=256, n_threads=1) as rt:
            logits = rt.forward(np.asarray(PROMPT, np.int32), 0, want_rows=[-1])[0]
            out: list[int] = []
            while len(out) < n:
                t = int(np.argmax(logits))
                if tok.is_eog(t):
                    break
                out.append(t)
                logits = rt.forward(np.asarray([t], np.int32), len(PROMPT) + len(out) - 1)[0]
    return out


def test_three_windows_give_identical_logits(case) -> None:
    c, model, shards = case
    with StageRuntime(model, n_ctx=256, n_threads=1) as full:
        want = full.forward(np.asarray(PROMPT, np.int32), 0).copy()
    states: np.ndarray = np.asarray(PROMPT, np.int32)
    for path in shards:
        with StageRuntime(path, n_ctx=256, n_threads=1) as rt:
            assert rt.layer_range == read_info(path).layer_range
            states = rt.forward(states, 0).copy()
    assert states.shape == want.shape
    assert float(np.abs(states - want).max()) == 0.0
    # The model is far from uniform, so equality means something.
    assert len(set(np.argmax(want, axis=1).tolist())) >= 4


def test_process_ring_greedy_equals_unsplit(case) -> None:
    from edgespec.api import Ring

    c, model, _ = case
    want = _greedy_unsplit(model, N_TOKENS)
    assert len(set(want)) >= 4
    with Ring.local(model, stages=3, ranges=c.ranges, spec="none", processes=True, n_ctx=512) as ring:
        got = ring.generate(PROMPT, max_tokens=N_TOKENS, spec="none").tokens
    assert got == want


# ---------------------------------------------------------------------------- traps, one by one


def _meta(path: Path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_sliding_window_pattern_follows_absolute_layers(tmp_path: Path) -> None:
    model = make_tiny_gguf(tmp_path / "g3.gguf", arch="gemma3", n_layer=8, seed=1)
    m = shard_model(model, tmp_path / "s", ranges=[(0, 3), (3, 5), (5, 8)], progress=False)
    patterns = [_meta(p)["gemma3.attention.sliding_window_pattern"] for p in m.shard_paths(tmp_path / "s")]
    assert patterns == [[True, True, True], [True, True], [False, True, True]]


def test_leading_dense_blocks_counted_per_window(tmp_path: Path) -> None:
    model = make_tiny_gguf(tmp_path / "ds.gguf", arch="deepseek2", n_layer=5, seed=1, leading_dense=2)
    m = shard_model(model, tmp_path / "s", ranges=[(0, 1), (1, 3), (3, 5)], progress=False)
    leads = [_meta(p)["deepseek2.leading_dense_block_count"] for p in m.shard_paths(tmp_path / "s")]
    assert leads == [1, 1, 0]


def test_deepseek2_window_that_would_turn_lite_is_refused(tmp_path: Path) -> None:
    model = make_tiny_gguf(tmp_path / "ds.gguf", arch="deepseek2", n_layer=30, n_embd=32, seed=1)
    with pytest.raises(ShardError, match="window 3:30 would not load"):
        shard_model(model, tmp_path / "s", ranges=[(0, 3), (3, 30)], progress=False)
    with pytest.raises(ShardError, match="'lite'"):
        cut_window(model, (0, 27), tmp_path / "w.gguf")


@pytest.mark.parametrize("arch, n_layer", [("gemma3", 62), ("gemma2", 46)])
def test_gemma_27b_attention_scale_is_refused(tmp_path: Path, arch: str, n_layer: int) -> None:
    """llama.cpp picks the 27B attention scale (1/sqrt(n_embd/n_head), not 1/sqrt(head_dim))
    from the layer count; a window has another count, so the split is refused."""
    def write(path: Path, key_length: int) -> Path:
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(n_layer)
        w.add_embedding_length(64)
        w.add_head_count(4)
        w.add_key_length(key_length)
        w.add_tensor("token_embd.weight", np.zeros((4, 64), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    with pytest.raises(ShardError, match="attention scale"):
        shard_model(write(tmp_path / "27b.gguf", 32), tmp_path / "a", n_stages=2, progress=False)
    # Where both formulas agree (head_dim == n_embd / n_head) nothing changes: allowed.
    shard_model(write(tmp_path / "same.gguf", 16), tmp_path / "b", n_stages=2, progress=False)


def test_gpt_oss_middle_window_carries_a_stub_head(tmp_path: Path) -> None:
    model = make_tiny_gguf(tmp_path / "go.gguf", arch="gpt-oss", n_layer=3, seed=1)
    m = shard_model(model, tmp_path / "s", n_stages=3, progress=False)
    sizes = []
    for p in m.shard_paths(tmp_path / "s"):
        t = {x.name: [int(d) for d in x.shape] for x in gguf.GGUFReader(p).tensors}
        sizes.append(t["output.weight"])
    assert sizes == [[64, m.n_vocab], [64, 1], [64, m.n_vocab]]


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("arch, reason", [("bloom", "not been checked"), ("rwkv7", "recurrent state"),
                                          ("glm4moe", "aborts the process")])
def test_refused_architecture_gets_one_line(tmp_path: Path, arch: str, reason: str) -> None:
    model = make_bare_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(UnsupportedArchitectureError, match=f"'{arch}'.*{reason}"):
        shard_model(model, tmp_path / "out", n_stages=2, progress=False)
    proc = subprocess.run([sys.executable, "-m", "edgespec", "shard", str(model), "--stages", "2",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"'{arch}'" in lines[0], proc.stderr
