"""The planner's memory estimates per architecture: window weights as the shards really hold them
(experts dominate a mixture-of-experts window, leading dense blocks weigh little), and KV cache
sizes equal to what llama.cpp allocates (grouped-query, sliding-window, latent attention)."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import pytest
from tinygguf import make_tiny_gguf

from edgespec.head.memory import (
    TREE_ROWS,
    WINDOW_OVERHEAD,
    ends_need,
    logits_bytes,
    model_memory,
    window_need,
)
from edgespec.head.planner import RESERVE, NodeProfile, plan_ring
from edgespec.llm import llamacpp
from edgespec.llm.shards import shard_model
from edgespec.node.runtime import StageRuntime

N_CTX = 1024


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("mem")
    specs = {
        "qwen3": dict(arch="qwen3", n_layer=4),
        "qwen3moe": dict(arch="qwen3moe", n_layer=4, n_expert=8),
        "deepseek2": dict(arch="deepseek2", n_layer=5, leading_dense=2, n_expert=8),
        "gemma3": dict(arch="gemma3", n_layer=7),
        "gpt-oss": dict(arch="gpt-oss", n_layer=4),
    }
    return {k: make_tiny_gguf(base / f"{k}.gguf", seed=2, **v) for k, v in specs.items()}


@pytest.mark.parametrize("name", ["qwen3", "qwen3moe", "deepseek2", "gemma3", "gpt-oss"])
def test_window_weights_match_the_shards(models, name: str, tmp_path: Path) -> None:
    model = models[name]
    mem = model_memory(model)
    n = mem.n_layer
    ranges = [(0, 1), (1, n - 1), (n - 1, n)]
    manifest = shard_model(model, tmp_path, ranges=ranges, progress=False)
    for (a, b), path in zip(ranges, manifest.shard_paths(tmp_path), strict=True):
        held = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
        stubs = 3 * 64 * 4  # a middle window: 1-row embedding (and head) stubs, output_norm
        assert 0 <= held - mem.window_bytes(a, b, 0) <= stubs, (a, b)


def test_experts_dominate_and_dense_lead_is_light(models) -> None:
    mem = model_memory(models["deepseek2"])
    dense, moe = mem.layer_weights[0], mem.layer_weights[2]
    assert mem.layer_weights[1] == dense and moe > 3 * dense
    # The old estimate (file size / layers) would call every layer the same size.
    uniform = models["deepseek2"].stat().st_size // mem.n_layer
    assert moe > uniform > dense


def _llamacpp_kv_bytes(model: Path, capfd: pytest.CaptureFixture[str]) -> float:
    llamacpp.set_verbose(True)
    try:
        capfd.readouterr()
        with StageRuntime(model, n_ctx=N_CTX, n_threads=1):
            pass
        err = capfd.readouterr().err
    finally:
        llamacpp.set_verbose(False)
    sizes = re.findall(r"llama_kv_cache: size =\s+([0-9.]+) MiB", err)
    assert sizes, err[-2000:]
    return sum(float(x) for x in sizes) * 2**20


@pytest.mark.parametrize("name", ["qwen3", "deepseek2", "gemma3", "gpt-oss"])
def test_kv_estimate_is_what_llamacpp_allocates(models, name: str, capfd) -> None:
    mem = model_memory(models[name])
    estimate = sum(mem.kv_per_token) * N_CTX
    allocated = _llamacpp_kv_bytes(models[name], capfd)
    assert abs(estimate - allocated) <= 0.01 * 2**20 * 2  # llama.cpp prints MiB with 2 decimals


def test_latent_attention_caches_the_latent_only(models) -> None:
    mem = model_memory(models["deepseek2"])
    # kv_lora_rank 32 + rope dims 8, f16, one shared latent: not 2 x 4 heads x 24 dims.
    assert mem.kv_per_token == [(32 + 8) * 2] * 5


def test_plan_fits_moe_windows_into_free_memory(models) -> None:
    """A small last node: counted as file size / layers it takes two expert blocks plus the
    embeddings and head, which do not fit; counted per layer it takes what fits."""
    model = models["deepseek2"]
    mem = model_memory(model)
    n = mem.n_layer
    uniform = model.stat().st_size // n
    small = int(window_need(mem, n - 1, n, N_CTX, 256) / RESERVE) + 1
    assert window_need(mem, n - 2, n, N_CTX, 256) > small * RESERVE
    nodes = [NodeProfile("b", "big", "10.0.0.2", 1, free_mem=1 << 34),
             NodeProfile("a", "small", "10.0.0.1", 1, free_mem=small)]
    plan = plan_ring(n, uniform, nodes, memory=mem, n_ctx=N_CTX)
    for i, node in enumerate(nodes):
        need = sum(window_need(mem, w.start, w.stop, N_CTX, 256) for w in plan.windows
                   if w.node == i)
        assert need <= node.free_mem * RESERVE
    assert plan.ranges == [(0, 4), (4, 5)]


def test_the_ends_count_what_their_vocabulary_costs(models) -> None:
    """Embeddings are mapped and cost only the rows read; each end holds a head (the last reads
    it, the first holds llama.cpp's repacked copy of the embeddings, or gpt-oss's own head);
    the logits buffer llama.cpp clears at creation counts where it is bigger than the compute
    buffers, and the last window also writes a tree's logits; a middle window holds none of
    them."""
    big = 1 << 40  # the logits reserve above WINDOW_OVERHEAD whatever the test model's vocabulary
    mem = model_memory(models["qwen3"])
    n = mem.n_layer
    layers = sum(mem.layer_bytes(i, N_CTX) for i in range(2))
    reserve = logits_bytes(mem, 256)
    first = window_need(mem, 0, 2, N_CTX, 256)
    assert first == (layers + WINDOW_OVERHEAD + mem.embd_bytes
                     + max(0, reserve - WINDOW_OVERHEAD))
    last_layers = sum(mem.layer_bytes(i, N_CTX) for i in range(n - 2, n))
    assert window_need(mem, n - 2, n, N_CTX, 256) == (
        last_layers + WINDOW_OVERHEAD + (mem.head_bytes or mem.embd_bytes)
        + max(0, reserve - WINDOW_OVERHEAD) + logits_bytes(mem, TREE_ROWS))
    assert window_need(mem, 1, 3, N_CTX, 256) == (
        sum(mem.layer_bytes(i, N_CTX) for i in range(1, 3)) + WINDOW_OVERHEAD)
    assert logits_bytes(mem, 256) == 256 * logits_bytes(mem, 1) > 0
    assert ends_need(mem, True, False, big // (4 * mem.n_vocab)) > big - WINDOW_OVERHEAD
    oss = model_memory(models["gpt-oss"])
    assert oss.head_on_first
    assert window_need(oss, 0, 2, N_CTX, 1) == (
        sum(oss.layer_bytes(i, N_CTX) for i in range(2)) + WINDOW_OVERHEAD + oss.head_bytes
        + max(0, logits_bytes(oss, 1) - WINDOW_OVERHEAD))
