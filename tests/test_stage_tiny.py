"""StageRuntime / LocalPipeline on tiny generated models: splits equal the unsplit model, trees,
masked rollback, and clear errors that leave the runtime usable."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from pipeline_fixtures import LocalPipeline
from stage_fixtures import (  # noqa: F401 - fixtures
    TREE_PARENTS,
    check_tree,
    tiny_dir,
    tiny_llama,
    tiny_qwen2,
)
from stage_host import StageHost
from tinygguf import make_tiny_gguf

from edgespec.llm.gguf_read import CorruptShardError, ShardError
from edgespec.llm.llamacpp import load_model
from edgespec.llm.shards import shard_model
from edgespec.llm.tokenizer import Tokenizer
from edgespec.node.runtime import (
    FingerprintMismatchError,
    InputError,
    KVCacheFullError,
    PositionError,
    StageRuntime,
)
from edgespec.tree.kvop import KvOp, KvOpCode

KW = dict(n_ctx=512, n_batch=64, n_threads=1, n_seq_max=8)
PROMPTS = ["def add(a, b):", "The quick brown fox", "import numpy as np\n"]


def _tokens(model_path: Path, texts: list[str]) -> list[list[int]]:
    with load_model(model_path, vocab_only=True) as m:
        tok = Tokenizer(m)
        return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny(request: pytest.FixtureRequest, tiny_qwen2: Path, tiny_llama: Path) -> Path:  # noqa: F811
    return tiny_qwen2 if request.param == "qwen2" else tiny_llama


@pytest.fixture(scope="module")
def unsplit(tiny: Path):
    with LocalPipeline([StageRuntime(tiny, **KW)]) as p:
        yield p


@pytest.mark.parametrize("n_windows", [2, 3, 4])
def test_split_equals_unsplit(tiny: Path, unsplit: LocalPipeline, tmp_path: Path, n_windows: int) -> None:
    prompts = _tokens(tiny, PROMPTS)
    with LocalPipeline.from_model(tiny, n_stages=n_windows, out_dir=tmp_path, **KW) as split:
        assert [w.layer_range for w in split.windows][-1][1] == 4
        for p in prompts:
            split.reset()
            unsplit.reset()
            a, b = split.prefill(p), unsplit.prefill(p)
            assert np.abs(a - b).max() <= 1e-3
        split.reset()
        unsplit.reset()
        got = split.generate_greedy(prompts, 64)
        want = unsplit.generate_greedy(prompts, 64)
    assert got == want
    # The tiny models are built to be far from degenerate: equality must mean something.
    assert all(len(set(seq)) >= 8 for seq in want)


def test_hidden_states_float16_and_chunked_prefill(tiny: Path, tmp_path: Path) -> None:
    shard_model(tiny, tmp_path, n_stages=2, progress=False)
    paths = sorted(tmp_path.glob("*.gguf"))
    prompt = np.random.default_rng(3).integers(3, 200, 150).astype(np.int32)
    rows = [-1, 10, 100]
    with StageRuntime(paths[0], **KW) as s0, StageRuntime(paths[1], **KW) as s1, \
            StageRuntime(tiny, **KW) as full, StageRuntime(tiny, **{**KW, "n_batch": 150}) as one:
        assert not s0.is_last and s1.is_last and s0.n_batch == 64
        h = np.array(s0.forward(prompt, 0))  # 150 rows in chunks of 64
        assert h.shape == (150, 64) and h.dtype == np.float32 and np.isfinite(h).all()
        got = s1.forward(h, 0, want_rows=rows).copy()
        # Same chunking on both sides: the split is exact.
        assert np.abs(got - full.forward(prompt, 0, want_rows=rows)).max() <= 1e-3
        # One 150-row batch instead of chunks of 64: llama.cpp's batch-shape float noise only.
        ref = one.forward(prompt, 0, want_rows=rows).copy()
        assert np.abs(got - ref).max() < 0.1
        assert np.array_equal(np.argmax(got, axis=1), np.argmax(ref, axis=1))
        # float16 hidden states in: close to float32, same prediction.
        s1.truncate(0)
        half = s1.forward(h.astype(np.float16), 0, want_rows=rows)
        assert np.array_equal(np.argmax(half, axis=1), np.argmax(got, axis=1))
        assert np.abs(half - got).max() < 0.5
        assert s0.n_past() == s1.n_past() == full.n_past() == 150


def test_token_tree_and_commit(tiny: Path, unsplit: LocalPipeline, tmp_path: Path) -> None:
    prompt = _tokens(tiny, ["for i in range(10):"])[0]
    tokens = np.random.default_rng(7).integers(3, 250, len(TREE_PARENTS)).tolist()
    with LocalPipeline.from_model(tiny, n_stages=3, out_dir=tmp_path, **KW) as split:
        r = check_tree(split, unsplit, prompt, tokens, TREE_PARENTS, commit_leaf=13, commit_depth=3,
                       n_after=32)
    assert r["max_diff"] <= 1e-3, r["diffs"]
    assert r["max_diff_unpadded"] <= 1e-3  # f32 weights: batch shape does not matter here
    assert r["n_past"] == r["expected_n_past"] and r["leaf_seq_len"] == 0
    assert r["after_commit"] == r["reference"]


def test_bad_inputs_raise_and_runtime_stays_usable(tiny: Path, tmp_path: Path) -> None:
    shard_model(tiny, tmp_path, n_stages=2, progress=False)
    p0, p1 = sorted(tmp_path.glob("*.gguf"))
    toks = np.array(_tokens(tiny, ["hello world"])[0], np.int32)
    with StageRuntime(p0, **KW) as s0, StageRuntime(p1, **KW) as s1:
        h = np.array(s0.forward(toks, 0))
        ref = s1.forward(h, 0).copy()
        s0.reset()
        s1.reset()

        with pytest.raises(InputError, match="hidden width 32 does not match .* n_embd 64"):
            s1.forward(np.zeros((3, 32), np.float32), 0)
        with pytest.raises(InputError, match="takes hidden states"):
            s1.forward(toks, 0)
        with pytest.raises(InputError, match="takes token ids"):
            s0.forward(h, 0)
        with pytest.raises(InputError, match="outside the vocabulary"):
            s0.forward(np.array([1, 10_000]), 0)
        with pytest.raises(InputError, match="float32 or float16"):
            s1.forward(h.astype(np.float64), 0)
        with pytest.raises(InputError, match="seq id 9 outside"):
            s0.forward(toks, 0, seq_ids=9)
        with pytest.raises(PositionError, match="expected 0"):
            s0.forward(toks, 5)  # empty sequence must start at 0
        s0.forward(toks[:3], 0)
        with pytest.raises(PositionError, match="row 1 has position 5, expected 4"):
            s0.forward(toks[3:6], [3, 5, 6])  # a gap
        with pytest.raises(PositionError, match="copy the committed prefix"):
            s0.forward(toks[3:4], 3, seq_ids=2)  # seq 2 never saw the prefix
        assert s0.n_past() == 3 and s0.n_past(2) == 0

        # Still usable and exact after the refusals.
        s0.forward(toks[3:], 3)
        s0.truncate(0)
        h2 = np.array(s0.forward(toks, 0))
        assert np.array_equal(h2, h)
        assert np.array_equal(s1.forward(h2, 0), ref)


def test_kv_cache_full_rolls_back(tiny_qwen2: Path) -> None:  # noqa: F811
    with StageRuntime(tiny_qwen2, n_ctx=32, n_batch=64, n_threads=1) as rt:
        fill = rt.n_ctx - 8  # llama.cpp rounds n_ctx up
        toks = np.arange(fill, dtype=np.int32) % 250 + 3
        first = rt.forward(toks, 0, want_rows=[-1]).copy()
        with pytest.raises(KVCacheFullError, match="no room"):
            rt.forward(np.arange(3, 23, dtype=np.int32), fill)  # 20 rows, 8 cells left
        assert rt.n_past() == fill
        rt.truncate(0)
        again = rt.forward(toks, 0, want_rows=[-1])
        assert np.abs(again - first).max() <= 1e-5


def test_apply_plan_and_keep_seqs(tiny_qwen2: Path) -> None:  # noqa: F811
    with StageRuntime(tiny_qwen2, **KW) as rt:
        rt.forward(np.arange(5, 15, dtype=np.int32), 0)
        rt.apply_plan([KvOp(KvOpCode.CP, 0, -1, -1, 1), KvOp(KvOpCode.CP, 0, -1, -1, 2), KvOp(KvOpCode.RM, 2, 6, -1)])
        assert (rt.n_past(0), rt.n_past(1), rt.n_past(2)) == (10, 10, 6)
        rt.keep_seqs([0, 2])
        assert (rt.n_past(1), rt.n_past(2)) == (0, 6)
        rt.apply_plan([KvOp(KvOpCode.KEEP, 0)])
        assert (rt.n_past(0), rt.n_past(2)) == (10, 0)
        with pytest.raises(InputError, match="unknown KV op"):
            rt.apply_plan([KvOp(KvOpCode.CP, 0, -1, -1, 1), (9, 0, 0, 0, 1)])
        assert rt.n_past(1) == 0  # validated before anything ran
        with pytest.raises(InputError, match="seq id 8 outside"):
            rt.apply_plan([KvOp(KvOpCode.CP, 0, -1, -1, 8)])


def test_fingerprint_mismatch_and_corrupt_shards(tiny_qwen2: Path, tiny_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    other = make_tiny_gguf(tiny_dir / "other.gguf", arch="qwen2", n_layer=4, n_embd=64, seed=5)
    shard_model(tiny_qwen2, tmp_path / "a", ranges=[(0, 2), (2, 4)], progress=False)
    shard_model(other, tmp_path / "b", ranges=[(0, 2), (2, 4)], progress=False)
    a0, a1 = sorted((tmp_path / "a").glob("*.gguf"))
    b0, b1 = sorted((tmp_path / "b").glob("*.gguf"))
    toks = np.arange(10, 20, dtype=np.int32)

    with StageHost([a0], **KW) as host:
        fp = host.fingerprint
        ref = np.array(host.window(0).forward(toks, 0))
        host.window(0).reset()
        with pytest.raises(FingerprintMismatchError, match="belongs to model"):
            host.add_window(b1)
        with pytest.raises(FingerprintMismatchError):
            StageRuntime(b1, expect_fingerprint=fp, **KW)
        with pytest.raises(ShardError, match="overlaps"):
            host.add_window(a0)

        # A corrupt copy: bytes flipped inside tensor data (caught by the manifest's sha256) ...
        bad_dir = tmp_path / "bad"
        shutil.copytree(tmp_path / "a", bad_dir)
        bad = bad_dir / a1.name
        data = bytearray(bad.read_bytes())
        data[-100] ^= 0xFF
        bad.write_bytes(bytes(data))
        with pytest.raises(CorruptShardError, match="sha256"):
            host.add_window(bad)
        # ... a truncated file (caught by the header check) ...
        bad.write_bytes(bytes(data[: len(data) // 2]))
        with pytest.raises(CorruptShardError, match="truncated"):
            host.add_window(bad)
        # ... and garbage.
        bad.write_bytes(b"not a gguf at all" * 10)
        with pytest.raises(CorruptShardError, match="not a GGUF"):
            host.add_window(bad)

        # The host is unchanged and still computes the same thing.
        assert [w.layer_range for w in host.windows] == [(0, 2)]
        assert np.array_equal(host.window(0).forward(toks, 0), ref)
        s1 = host.add_window(a1)
        s1.check_upstream(fp, 2)
        with pytest.raises(FingerprintMismatchError):
            s1.check_upstream("0" * 32, 2)
        with pytest.raises(ShardError, match="starts at 2"):
            s1.check_upstream(fp, 3)

    with StageRuntime(a0, **KW) as x, StageRuntime(b1, **KW) as y, \
            pytest.raises(FingerprintMismatchError):
        LocalPipeline([x, y])


def test_window_cut_from_full_model(tiny_llama: Path, tmp_path: Path) -> None:  # noqa: F811
    toks = np.arange(10, 30, dtype=np.int32)
    with StageRuntime((tiny_llama, (0, 3)), cache_dir=tmp_path, **KW) as s0, \
            StageRuntime((tiny_llama, (3, 4)), cache_dir=tmp_path, **KW) as s1, \
            StageRuntime(tiny_llama, **KW) as full:
        assert s0.layer_range == (0, 3) and s1.is_last and len(list(tmp_path.glob("*.gguf"))) == 2
        got = s1.forward(np.array(s0.forward(toks, 0)), 0)
        assert np.abs(got - full.forward(toks, 0)).max() <= 1e-3
