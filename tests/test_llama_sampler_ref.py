"""Self-test of tests/llama_sampler_ref.py (llama.cpp's own samplers via ctypes; no model)."""

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from llama_sampler_ref import (  # noqa: E402
    llama_cpp_candidates,
    llama_cpp_logits_after,
    llama_cpp_probs,
)


def _softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def row():
    return (np.random.default_rng(1234).normal(size=1000) * 2.0).astype(np.float32)


def test_neutral_and_temperature_are_softmax(row):
    p = llama_cpp_probs(row)
    assert p.dtype == np.float64 and p.shape == row.shape
    np.testing.assert_allclose(p, _softmax(row), rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(llama_cpp_probs(row, temperature=1.0), _softmax(row), rtol=1e-9)
    np.testing.assert_allclose(llama_cpp_probs(row, temperature=0.7),
                               _softmax(row.astype(np.float64) / 0.7), rtol=1e-5)
    lg = llama_cpp_logits_after(row, temperature=0.5)
    np.testing.assert_array_equal(lg, row / np.float32(0.5))


def test_top_k(row):
    p = llama_cpp_probs(row, top_k=5)
    nz = np.nonzero(p)[0]
    assert len(nz) == 5
    assert set(nz) == set(np.argsort(-row)[:5])
    np.testing.assert_allclose(p[nz], _softmax(row[nz]), rtol=1e-9)
    assert abs(p.sum() - 1.0) < 1e-12
    # top_k sorts: candidates come back in descending logit order
    ids, lg = llama_cpp_candidates(row, top_k=5)
    assert list(ids) == list(np.argsort(-row)[:5]) and np.all(np.diff(lg) <= 0)
    # k above the vocab keeps everything
    assert np.count_nonzero(llama_cpp_probs(row, top_k=5000)) == row.size


def test_min_p(row):
    base = _softmax(row)
    for mp in (0.05, 0.2, 0.5):
        p = llama_cpp_probs(row, min_p=mp)
        keep = base >= mp * base.max()
        # llama.cpp tests logit >= max + logf(p) in float32: allow rounding at the edge
        edge = np.abs(base / base.max() - mp) < 1e-5
        assert np.array_equal((p > 0)[~edge], keep[~edge])
        nz = p > 0
        np.testing.assert_allclose(p[nz], base[nz] / base[nz].sum(), rtol=1e-9)


def test_top_p(row):
    base = _softmax(row)
    order = np.argsort(-row)
    cum = np.cumsum(base[order])
    for tp in (0.3, 0.9):
        p = llama_cpp_probs(row, top_p=tp)
        n = int(np.searchsorted(cum, tp)) + 1  # shortest prefix with cum >= p
        assert abs(np.count_nonzero(p) - n) <= 1  # float32 cumsum in llama.cpp
        assert set(np.nonzero(p)[0]) == set(order[:np.count_nonzero(p)])
        assert abs(p.sum() - 1.0) < 1e-12
    # exact ties with the threshold: cumsum >= p keeps the crossing token only
    z = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    np.testing.assert_allclose(llama_cpp_probs(z, top_p=0.5), [1.0, 0.0, 0.0])


def test_typical_p(row):
    base = _softmax(row)
    ent = -(base * np.log(base)).sum()
    score = np.abs(-np.log(base) - ent)
    order = np.argsort(score)
    cum = np.cumsum(base[order])
    p = llama_cpp_probs(row, typical_p=0.5)
    n = int(np.searchsorted(cum, 0.5, side="right")) + 1  # first cum > p
    assert abs(np.count_nonzero(p) - n) <= 1
    assert set(np.nonzero(p)[0]) == set(order[:np.count_nonzero(p)])
    assert abs(p.sum() - 1.0) < 1e-12


def test_logit_bias(row):
    t_top = int(np.argmax(row))
    p = llama_cpp_probs(row, bias=[(t_top, -np.inf)])
    assert p[t_top] == 0.0 and abs(p.sum() - 1.0) < 1e-12
    lg = llama_cpp_logits_after(row, bias=[(t_top, -np.inf), (7, 3.0), (7, 1.0)])
    assert lg[t_top] == -np.inf
    assert lg[7] == pytest.approx(float(row[7]) + 4.0, abs=1e-5)  # duplicates add up
    q = llama_cpp_probs(row, bias=[(7, -10.0)])
    assert q[7] < _softmax(row)[7] * 1e-3


def test_penalties(row):
    window = [3, 4, 4, 10, 3, 4]
    base = _softmax(row)
    p = llama_cpp_probs(row, window=window, repeat_penalty=1.5)
    for t in set(window):
        assert p[t] < base[t]
    others = np.setdiff1d(np.arange(row.size), window)
    assert np.all(p[others] >= base[others])
    assert abs(p.sum() - 1.0) < 1e-12

    lg = llama_cpp_logits_after(row, window=window, repeat_penalty=1.3,
                                frequency_penalty=0.25, presence_penalty=0.5)
    for t in range(row.size):
        c = window.count(t)
        x = float(row[t])
        if c:
            x = x * 1.3 if x <= 0 else x / 1.3
            x -= c * 0.25 + 0.5
        assert lg[t] == pytest.approx(x, abs=1e-5)

    # ring buffer: only the last repeat_last_n accepted tokens count
    lg = llama_cpp_logits_after(row, window=[5, 6, 7], repeat_last_n=2, repeat_penalty=2.0)
    assert set(np.nonzero(lg != row)[0]) == {6, 7}
    # 0 disables, and the library clamps negative last_n to 0 (no "-1 = n_ctx")
    for n in (0, -1):
        np.testing.assert_array_equal(
            llama_cpp_logits_after(row, window=[5], repeat_last_n=n, repeat_penalty=2.0), row)


def test_full_chain(row):
    kw = dict(bias=[(int(np.argmax(row)), -5.0)], window=[1, 2, 2], repeat_penalty=1.1,
              frequency_penalty=0.1, presence_penalty=0.1, top_k=100, typical_p=0.95,
              top_p=0.9, min_p=0.02, temperature=0.8)
    p = llama_cpp_probs(row, **kw)
    assert 1 <= np.count_nonzero(p) <= 100 and abs(p.sum() - 1.0) < 1e-12
    lg = llama_cpp_logits_after(row, **kw)
    nz = np.isfinite(lg)
    np.testing.assert_array_equal(nz, p > 0)
    np.testing.assert_allclose(p[nz], _softmax(lg[nz]), rtol=1e-9)
    # deterministic: same call, same answer
    np.testing.assert_array_equal(llama_cpp_probs(row, **kw), p)


def test_typical_warns_on_zero_prob_candidate(row):
    # llama.cpp's typical sampler computes 0 * log(0) = NaN for p == 0 candidates
    with pytest.warns(RuntimeWarning, match="typical_p"):
        llama_cpp_probs(row, bias=[(0, -np.inf)], typical_p=0.5)
