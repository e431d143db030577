"""Speculative decoding on tiny float32 models: every mode and drafter must give exactly the
tokens of plain decoding (greedy), and sampling must be exactly plain sampling (lossless)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from stage_fixtures import tiny_dir  # noqa: F401  (fixture)
from tinygguf import make_tiny_gguf

from edgespec.api import Ring
from edgespec.drafters import DraftModelDrafter, HybridDrafter, RetrievalDrafter
from edgespec.head.engine import EngineConfig
from edgespec.head.request import Request
from edgespec.params import GenerationParams


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("spec") / "target.gguf", "qwen2", n_layer=4,
                          n_embd=64, seed=3)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    # Same vocabulary (same tokenizer), other weights: a draft that is often wrong.
    return make_tiny_gguf(tmp_path_factory.mktemp("spec") / "draft.gguf", "qwen2", n_layer=2,
                          n_embd=64, seed=4)


@pytest.fixture(scope="module")
def ring(tiny_target):
    with Ring.local(tiny_target, stages=2, processes=False, n_ctx=1024) as r:
        yield r


def _prompts(ring: Ring) -> list[list[int]]:
    rng = np.random.default_rng(0)
    n = ring.tokenizer.n_vocab
    rep = list(rng.integers(3, n, 6)) * 4  # a repeated pattern: retrieval drafts hit
    return [list(map(int, rng.integers(3, n, 12))), list(map(int, rep)),
            list(map(int, rng.integers(3, n, 30)))]


def _head(ring: Ring, drafter, **engine) -> Ring:
    return Ring(ring.chain, ring.tokenizer, model_name="tiny", drafter_factory=lambda: drafter,
                engine=EngineConfig(**engine))


def _drafters(kind: str, target, draft):
    if kind == "retrieval":
        return RetrievalDrafter()
    # "self": the target drafting for itself, so every draft is accepted and long paths are
    # committed; "model"/"hybrid": another model, often rejected.
    model = DraftModelDrafter(target if kind == "self" else draft, target=target)
    return model if kind == "model" else HybridDrafter(RetrievalDrafter(), model)


@pytest.mark.parametrize("kind", ["retrieval", "model", "hybrid", "self"])
@pytest.mark.parametrize("mode", ["sync", "flow"])
def test_greedy_identical_to_plain_decoding(ring, tiny_target, tiny_draft, mode, kind):
    drafter = _drafters(kind, tiny_target, tiny_draft)
    try:
        for budget in (4, 16):
            head = _head(ring, drafter, budget=budget, segments=3)
            for prompt in _prompts(ring):
                head.reset()
                ref = head.generate(prompt, max_tokens=40, spec="none").tokens
                head.reset()
                got = head.generate(prompt, max_tokens=40, spec=mode)
                assert got.tokens == ref, f"{mode}/{kind} budget {budget}"
                if kind == "self":
                    assert got.stats.mean_accepted > 1.5  # drafts accepted, paths committed
    finally:
        drafter.close()


def test_process_ring_flow_identical(tiny_target):
    with Ring.local(tiny_target, stages=3, processes=True, n_ctx=1024, budget=12,
                    segments=3) as r:
        for prompt in _prompts(r):
            r.reset()
            ref = r.generate(prompt, max_tokens=32, spec="none").tokens
            r.reset()
            assert r.generate(prompt, max_tokens=32, spec="flow").tokens == ref


@pytest.mark.parametrize("mode", ["sync", "flow"])
def test_sampling_is_plain_sampling(ring, mode):
    """With the same seed, speculative sampling returns exactly plain sampling's tokens (draws
    are keyed by position), so its distribution is the target's."""
    head = _head(ring, RetrievalDrafter(), budget=8, segments=2)
    prompt = _prompts(ring)[1]
    for seed in range(40):
        kw = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": seed}
        head.reset()
        ref = head.generate(prompt, spec="none", **kw).tokens
        head.reset()
        assert head.generate(prompt, spec=mode, **kw).tokens == ref, f"seed {seed}"


def test_sampled_first_token_follows_target_distribution(ring, tiny_target):
    """Chi-square: 3000 seeded draws of the first token against the model's softmax."""
    from edgespec.node.runtime import StageRuntime

    prompt = _prompts(ring)[0]
    with StageRuntime(tiny_target, n_ctx=256, n_threads=1) as rt:
        rt.forward(np.asarray(prompt[:-1], np.int32), 0)
        logits = rt.forward(np.asarray(prompt[-1:], np.int32), len(prompt) - 1)[-1].copy()
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    head = _head(ring, RetrievalDrafter(), budget=6)
    counts = np.zeros(len(p))
    for seed in range(3000):
        # The engine itself: the API would hide an end-of-generation token, which counts here.
        run = head.engine.run(Request(prompt, GenerationParams(
            max_tokens=1, temperature=1.0, seed=seed), "flow"))
        counts[next(run)[0]] += 1
        run.close()
    keep = p * 3000 >= 5  # pool rare tokens so the test's assumptions hold
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(p[keep], p[~keep].sum()) * 3000
    assert stats.chisquare(obs, exp).pvalue > 1e-3
