"""The last stage's sampler chain (``edgespec.node.sampler``) against llama.cpp's own samplers
(``llama_sampler_ref``: llama.cpp's C samplers through llama-cpp-python, no model needed).

On fixed logits, every field of ``edgespec.sampling.FIELDS`` changes the distribution exactly
as llama.cpp's stage of the same name does (one case per field: a field without a case fails
here), and all of them together in llama.cpp's order; the seeded draw follows that
distribution (chi-square over many positions) and is the same draw for the same position
whatever the batch; a registration's settings survive the wire.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from llama_sampler_ref import llama_cpp_probs
from scipy import stats

from edgespec.batch import SamplerRef
from edgespec.node.sampler import RequestSampler, probabilities
from edgespec.sampling import FIELDS, SamplerSettings

VOCAB = 512
#: The generated text the penalties look at: tokens among the likely ones, some repeated.
TEXT = [7, 3, 7, 11, 5, 7, 3]

#: One case per field: the field (with what it needs to show its effect), compared with
#: llama.cpp's stage at temperature 1 unless the case sets it.
CASES: dict[str, dict] = {
    "repeat_penalty": {"repeat_penalty": 1.7},
    "frequency_penalty": {"frequency_penalty": 0.8},
    "presence_penalty": {"presence_penalty": -0.6},
    "repeat_last_n": {"repeat_last_n": 3, "frequency_penalty": 1.0, "repeat_penalty": 1.3},
    "top_k": {"top_k": 9},
    "typical_p": {"typical_p": 0.6},
    "top_p": {"top_p": 0.7},
    "min_p": {"min_p": 0.08},
    "temperature": {"temperature": 0.6},
    "seed": {"seed": 12345},  # the draw's stream, not the distribution: see below
}

ALL = {"repeat_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.2,
       "repeat_last_n": 5, "top_k": 60, "typical_p": 0.95, "top_p": 0.9, "min_p": 0.01,
       "temperature": 0.8, "seed": 3}


def _logits(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z = rng.normal(size=VOCAB).astype(np.float32) * 2.5
    z[[3, 5, 7, 11]] += 4.0  # the text's tokens are likely ones, so penalties matter
    return z


def _settings(fields: dict) -> SamplerSettings:
    return SamplerSettings(tuple({"temperature": 1.0, **fields}.items()))


def _ours(z: np.ndarray, fields: dict, text=TEXT) -> np.ndarray:
    s = _settings(fields)
    shaped = RequestSampler(s).shape(z[None, :], [list(text)])[0]
    return probabilities(shaped, s)


def _theirs(z: np.ndarray, fields: dict, text=TEXT) -> np.ndarray:
    f = {"temperature": 1.0, **fields}
    f.pop("seed", None)
    n = f.get("repeat_last_n", 64)
    window = list(text) if n < 0 else list(text)[len(text) - n:] if n else []
    f["repeat_last_n"] = len(window) if n < 0 else n
    return llama_cpp_probs(z, window=window, **f)


def test_every_field_has_a_case():
    assert set(CASES) == {k.name for k in FIELDS}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_field_shapes_the_distribution_as_llama_cpps_stage(name):
    for seed in range(3):
        z = _logits(seed)
        ours, theirs = _ours(z, CASES[name]), _theirs(z, CASES[name])
        assert np.array_equal(ours > 0, theirs > 0), (name, seed)  # the same tokens kept
        np.testing.assert_allclose(ours, theirs, atol=2e-6, rtol=1e-4)
        if name != "seed":  # the field changed something
            assert not np.allclose(ours, _ours(z, {}), atol=1e-6), name


def test_all_fields_together_in_llama_cpps_order():
    for seed in range(5):
        z = _logits(seed)
        ours, theirs = _ours(z, ALL), _theirs(z, ALL)
        assert np.array_equal(ours > 0, theirs > 0)
        np.testing.assert_allclose(ours, theirs, atol=2e-6, rtol=1e-4)
    # -1: the whole generated text
    z = _logits(9)
    np.testing.assert_allclose(_ours(z, {**ALL, "repeat_last_n": -1}),
                               _theirs(z, {**ALL, "repeat_last_n": -1}), atol=2e-6, rtol=1e-4)


def test_logit_bias_then_the_chain_as_llama_cpp():
    z = _logits(4)
    bias = ((3, -5.0), (40, 6.0), (100, -100.0))
    s = SamplerSettings((("temperature", 0.9), ("top_p", 0.85)), bias=bias)
    shaped = RequestSampler(s).shape(z[None, :], [[]])[0]
    np.testing.assert_allclose(probabilities(shaped, s),
                               llama_cpp_probs(z, bias=bias, temperature=0.9, top_p=0.85),
                               atol=2e-6, rtol=1e-4)


def test_the_seeded_draw_follows_the_chains_distribution():
    """Draws at many positions (each position's uniform is its own) follow the chain's
    distribution; the same position draws the same token in any batch; another seed draws
    another stream."""
    z = _logits(2)
    s = _settings(ALL)
    p = _ours(z, ALL)
    n = 6000
    rows = np.repeat(z[None, :], n, axis=0)
    pos = np.arange(n, dtype=np.int32)
    sampler = RequestSampler(s)
    sampler.text = list(TEXT)
    ref = SamplerRef(1, None, len(TEXT))
    drawn = sampler.draw(rows, pos, np.zeros(n, np.int32), ref)[0]
    counts = np.bincount(drawn, minlength=VOCAB).astype(float)
    assert counts[p == 0].sum() == 0  # nothing outside what the chain keeps
    keep = p * n >= 5
    obs, exp = counts[keep], p[keep] * n
    if p[~keep].sum() > 0:  # the rare tokens pooled
        obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, p[~keep].sum() * n)
    exp *= obs.sum() / exp.sum()
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    alone = sampler.draw(rows[17:18], pos[17:18], np.zeros(1, np.int32), ref)[0]
    assert alone[0] == drawn[17]
    other = RequestSampler(_settings({**ALL, "seed": 4}))
    other.text = list(TEXT)
    assert not np.array_equal(other.draw(rows[:200], pos[:200], np.zeros(200, np.int32),
                                         ref)[0], drawn[:200])


def test_settings_survive_the_wire_and_bounds_are_the_tables():
    s = _settings(ALL)
    assert SamplerSettings.from_meta(s.as_meta()) == s
    for k in FIELDS:
        bad = k.low - 1 if k.low > -(1 << 62) else None
        if bad is not None:
            with pytest.raises(ValueError, match=k.name):
                SamplerSettings.from_meta({k.name: bad})


def test_a_requests_sampler_lives_from_its_first_batch_to_its_end(tmp_path):
    """On a ring, a request's sampler is registered at the last stage by its first batch and
    released when it ends: finished, cut short by the caller, or failed at the stage."""
    from tinygguf import make_tiny_gguf

    from edgespec.api import Ring

    tiny = make_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", n_layer=2, n_embd=64, seed=4)
    with Ring.local(tiny, stages=2, processes=False, n_ctx=256) as ring:
        samplers = ring.chain.worker.samplers
        kw = {"temperature": 0.7, "frequency_penalty": 0.5, "top_k": 20, "seed": 1}
        for mode in ("none", "sync", "flow"):
            ring.generate([1, 2, 3], max_tokens=12, spec=mode, ignore_eos=True, **kw)
            assert len(samplers) == 0, mode
            stream = ring.stream([1, 2, 3], max_tokens=40, spec=mode, ignore_eos=True, **kw)
            next(iter(stream))
            assert len(samplers) == 1, mode
            stream.close()
            assert len(samplers) == 0, mode
        ring.generate([1, 2, 3], max_tokens=5)  # plain greedy: nothing registered
        assert len(samplers) == 0


def test_node_processes_release_a_requests_sampler_in_ring_order(tmp_path):
    """Over real node processes the release travels the ring behind the request's last KV
    operations; the last node's health shows the samplers it holds."""
    from tinygguf import make_tiny_gguf

    from edgespec.api import Ring

    tiny = make_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", n_layer=2, n_embd=64, seed=4)

    def held(ring) -> int:
        return sum(st["samplers"] for m in ring.chain.members
                   for st in m.request("health", timeout=10).meta["stages"].values())

    with Ring.local(tiny, stages=2, n_ctx=256) as ring:
        kw = {"temperature": 0.7, "presence_penalty": 0.5, "seed": 2}
        stream = ring.stream([1, 2, 3], max_tokens=40, spec="none", ignore_eos=True, **kw)
        next(iter(stream))
        assert held(ring) == 1
        stream.close()
        ring.generate([1, 2, 3], max_tokens=8, spec="flow", ignore_eos=True, **kw)
        deadline = time.monotonic() + 10
        while held(ring) and time.monotonic() < deadline:  # the release is on its way
            time.sleep(0.05)
        assert held(ring) == 0


def test_a_replay_registers_the_sampler_on_the_rebuilt_ring(tmp_path):
    """The node holding a request's sampler (the last stage) is killed mid-answer: the rebuilt
    ring's new last stage gets the settings and the text so far with the replay, and the
    seeded, penalised answer is the one a ring without the fault gives."""
    import os
    import signal

    from tinygguf import make_tiny_gguf

    from edgespec.api import Ring

    tiny = make_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", n_layer=3, n_embd=64, seed=5)
    kw = {"max_tokens": 48, "spec": "none", "ignore_eos": True, "temperature": 0.9,
          "top_k": 30, "min_p": 0.02, "frequency_penalty": 0.7, "repeat_last_n": 16, "seed": 9}
    with Ring.local(tiny, stages=3, n_ctx=256) as ring:
        reference = ring.generate([5, 6, 7], **kw)
        ring.reset()
        stream = ring.stream([5, 6, 7], **kw)
        for seen, _piece in enumerate(stream, start=1):
            if seen == 12:
                os.kill(ring.local_nodes.procs[2].pid, signal.SIGKILL)
        gen = stream.result
        assert gen.stats.recoveries == 1 and ring.chain.n_stages == 2
        assert gen.tokens == reference.tokens
