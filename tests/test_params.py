"""``GenerationParams``: a request's settings are checked once, on construction, with the field
named; ``Ring.prepare`` checks what depends on the ring and fits ``max_tokens`` to it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tinygguf import make_tiny_gguf

from edgespec.api import Ring
from edgespec.batch import SamplerRef
from edgespec.errors import RequestError
from edgespec.params import GenerationParams


@pytest.mark.parametrize(("fields", "param"), [
    ({"temperature": -0.1}, "temperature"), ({"temperature": "0.5"}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"seed": 1.5}, "seed"), ({"stop": [1]}, "stop"),
    ({"spec": "fast"}, "spec"),
])
def test_a_bad_value_is_refused_naming_its_field(fields, param):
    with pytest.raises(RequestError) as err:
        GenerationParams(**fields)
    assert err.value.param == param


def test_values_are_normalised_once_and_frozen():
    p = GenerationParams(max_tokens=4.0, temperature=1, seed=-1, stop="\n")
    assert (p.max_tokens, p.temperature, p.seed, p.stop) == (4, 1.0, (1 << 64) - 1, ("\n",))
    assert isinstance(p.max_tokens, int) and isinstance(p.temperature, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 5  # type: ignore[misc]
    assert GenerationParams.of(p, top_k=3).top_k == 3 and p.top_k == 0
    with pytest.raises(TypeError, match="temprature"):
        GenerationParams.of(temprature=0.5)


def test_the_ring_fits_max_tokens_and_refuses_what_it_cannot_run(tmp_path):
    tiny = make_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", n_layer=2, n_embd=64, seed=4)
    with Ring.local(tiny, stages=1, processes=False, n_ctx=256) as ring:
        req = ring.prepare([1, 2, 3], GenerationParams(max_tokens=1000))
        assert req.params.max_tokens == 253 and req.capped == 253
        assert ring.prepare([1, 2, 3], GenerationParams(max_tokens=8)).capped is None
        # The mode is resolved once, here: one stage and a (retrieval) drafter, so auto runs
        # as sync; a mode asked for runs as asked.
        assert ring.prepare([1, 2, 3], GenerationParams()).mode == "sync"
        assert ring.prepare([1, 2, 3], GenerationParams(spec="flow")).mode == "flow"
        with pytest.raises(RequestError) as err:
            ring.prepare(list(range(1, 260)), GenerationParams())
        assert err.value.param == "prompt" and err.value.code == "context_length_exceeded"
        with pytest.raises(RequestError) as err:
            ring.prepare([1, 10**6], GenerationParams())
        assert err.value.param == "prompt" and "vocabulary" in str(err.value)
        with pytest.raises(RequestError) as err:
            ring.prepare([1, 2], GenerationParams(logit_bias={10**6: 5}))
        assert err.value.param == "logit_bias" and "vocabulary" in str(err.value)
        gen = ring.generate([1, 2, 3], max_tokens=1000, ignore_eos=True)
        assert len(gen.tokens) == 253 and gen.capped_max_tokens == 253
        assert gen.finish_reason == "length"


def _pick(logits, pos, settings):
    from edgespec.node.sampler import RequestSampler

    return RequestSampler(settings).draw(logits, pos, np.zeros(len(pos), np.int32),
                                         SamplerRef())[0]


def test_logit_bias_travels_in_the_registration_and_shifts_the_draw():
    """The bias is registered with the request's sampler at the last stage, which adds it to
    every row's logits before the argmax or the seeded draw; a stage refuses a registration
    whose bias is malformed."""
    from edgespec.sampling import SamplerSettings

    params = GenerationParams(logit_bias={"2": 100, 0: -100.0})
    assert params.logit_bias == ((0, -100.0), (2, 100.0))
    sampling = params.sampling
    assert SamplerSettings.from_meta(sampling.as_meta()) == sampling
    assert GenerationParams().sampling.as_meta() == {}  # nothing when unused
    logits = np.array([[5.0, 1.0, 0.0, 2.0], [0.0, 9.0, 1.0, 0.0]], np.float32)
    pos = np.array([3, 4], np.int32)
    assert _pick(logits, pos, GenerationParams().sampling).tolist() == [0, 1]
    assert _pick(logits, pos, sampling).tolist() == [2, 2]
    assert logits[0, 0] == 5.0  # the stage's logits are not changed in place
    drawn = _pick(logits, pos, GenerationParams(temperature=1.0, seed=3,
                                                logit_bias={1: -100}).sampling)
    assert 1 not in drawn.tolist()
    with pytest.raises(ValueError, match="outside the vocabulary of 4 tokens"):
        _pick(logits, pos, GenerationParams(logit_bias={9: 1}).sampling)
    for bad in ([[1, 101]], [[-1, 2]], [["x", 2]], [[1]], "x", [[t, 2] for t in range(301)]):
        with pytest.raises(ValueError):
            SamplerSettings.from_meta({"logit_bias": bad})
