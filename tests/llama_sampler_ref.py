"""Independent sampler-chain reference built on llama.cpp's OWN sampler code.

Drives the C samplers of the installed llama-cpp-python (``libllama``) through
its low-level ctypes bindings on a ``llama_token_data_array`` filled from one
numpy logits row.  No model, context or vocab is needed.

Stage order follows llama.cpp's ``common_sampler`` defaults (common/sampling.cpp,
``common_params_sampling::samplers``): logit_bias is pushed first, then
penalties, (dry, top_n_sigma: not modelled), top_k, typical_p, top_p, min_p,
(xtc: not modelled), temperature.  The final ``dist`` sampler only draws, so
the distribution it draws from is the softmax of the surviving candidates'
logits as the chain left them (``dist`` itself does float32 ``expf`` with a
double sum; here the softmax is float64 on the float32 logits).

Semantics of the vendored llama.cpp (llama-cpp-python 0.3.36,
vendor/llama.cpp/src/llama-sampler.cpp), for reference:

* logit_bias: ``logit += bias`` for each (token, bias) pair (duplicates add up).
  A bias of -inf leaves the token as a candidate with logit -inf (p = 0).
* penalties: ring buffer of the last ``penalty_last_n`` accepted tokens with a
  count per token.  For every candidate whose count c > 0:
  ``logit = logit * repeat if logit <= 0 else logit / repeat``, then
  ``logit -= c * freq + presence``.  ``penalty_last_n`` < 0 is clamped to 0
  (= disabled) by the library; there is no "-1 = context size" here.
  Disabled when last_n == 0 or (repeat == 1 and freq == 0 and presence == 0).
* top_k: keep the k largest logits (k <= 0: no-op; k > size: k = size);
  sorts the array descending. Tie order at the cut-off is unspecified.
* typical_p: softmax over the CURRENT candidates (sorted by logit first),
  entropy H = -sum p log p, score |-log p_i - H|; std::sort by score (not
  stable); keep in ascending-score order until the float32 cumulative prob is
  STRICTLY > p (the crossing token kept).  Leaves the array in score order,
  sorted = false.  QUIRK: if any candidate's float32 p is exactly 0 (a -inf
  logit, or a logit more than ~104 below the max) then 0 * log 0 = NaN makes
  H and every score NaN, and the kept set is garbage (std::sort on NaN keys);
  this module emits a RuntimeWarning when that happens.
* top_p: softmax over the CURRENT candidates (renormalised), sort by logit
  descending, keep the shortest prefix whose float32 cumulative prob is >= p
  (the crossing token included); p >= 1: no-op.
* min_p: keep tokens with ``logit >= max_logit + logf(p)`` (float32), i.e.
  p_i >= p * p_max over the current candidates (>=, ties at the threshold
  kept); the max always survives. p <= 0: no-op.
* temperature (llama_sampler_init_temp): ``logit /= t`` for t > 0; t <= 0
  keeps the first max logit and sets all others to -inf (size unchanged).
  (common_sampler uses temp_ext, which equals temp when dynatemp_range == 0.)
"""

from __future__ import annotations

import ctypes
import math
import warnings
from collections.abc import Iterable, Sequence

import llama_cpp as _ll
import numpy as np

__all__ = ["llama_cpp_logits_after", "llama_cpp_probs", "llama_cpp_candidates"]

# numpy mirror of struct llama_token_data {int32 id; float logit; float p;}
_TD_DTYPE = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TD_DTYPE.itemsize == ctypes.sizeof(_ll.llama_token_data)


def _build_samplers(n_vocab: int, *, bias, repeat_last_n, repeat_penalty,
                    frequency_penalty, presence_penalty, top_k, typical_p,
                    top_p, min_p, temperature):
    """Return [(name, sampler_ptr)] in common_sampler order, neutral stages omitted."""
    out = []
    bias = list(bias)
    if bias:
        arr = (_ll.llama_logit_bias * len(bias))()
        for i, (tok, val) in enumerate(bias):
            tok = int(tok)
            if not 0 <= tok < n_vocab:
                raise ValueError(f"bias token {tok} outside vocab of {n_vocab}")
            arr[i].token = tok
            arr[i].bias = float(val)
        out.append(("logit_bias",
                    _ll.llama_sampler_init_logit_bias(n_vocab, len(bias), arr)))
    if int(repeat_last_n) != 0 and not (float(repeat_penalty) == 1.0
                                       and float(frequency_penalty) == 0.0
                                       and float(presence_penalty) == 0.0):
        out.append(("penalties", _ll.llama_sampler_init_penalties(
            n_vocab, int(repeat_last_n), float(repeat_penalty),
            float(frequency_penalty), float(presence_penalty))))
    if int(top_k) > 0:
        out.append(("top_k", _ll.llama_sampler_init_top_k(int(top_k))))
    if float(typical_p) < 1.0:
        out.append(("typical", _ll.llama_sampler_init_typical(float(typical_p), 1)))
    if float(top_p) < 1.0:
        out.append(("top_p", _ll.llama_sampler_init_top_p(float(top_p), 1)))
    if float(min_p) > 0.0:
        out.append(("min_p", _ll.llama_sampler_init_min_p(float(min_p), 1)))
    if float(temperature) != 1.0:
        out.append(("temp", _ll.llama_sampler_init_temp(float(temperature))))
    for name, s in out:
        if not s:
            raise RuntimeError(f"llama_sampler_init for {name} returned NULL")
    return out


def _warn_if_typical_nan(buf, cur):
    if ctypes.cast(cur.data, ctypes.c_void_p).value != buf.ctypes.data:
        return
    lg = buf["logit"][: int(cur.size)]
    if lg.size and np.any(np.exp(lg - lg.max(), dtype=np.float32) == 0):
        warnings.warn("typical_p input has a candidate with float32 p == 0: llama.cpp's "
                      "entropy becomes NaN and its typical_p result is unreliable",
                      RuntimeWarning, stacklevel=3)


def llama_cpp_candidates(logits, *, bias: Iterable[tuple[int, float]] = (),
                         window: Sequence[int] = (), repeat_last_n: int = 64,
                         repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
                         presence_penalty: float = 0.0, top_k: int = 0,
                         typical_p: float = 1.0, top_p: float = 1.0,
                         min_p: float = 0.0, temperature: float = 1.0):
    """Run the chain; return (ids int32 [n], logits float32 [n]) of the surviving
    candidates, in the order llama.cpp left them (data[:size])."""
    row = np.ascontiguousarray(np.asarray(logits, dtype=np.float32).reshape(-1))
    n_vocab = int(row.shape[0])
    if n_vocab == 0:
        raise ValueError("empty logits row")
    buf = np.zeros(n_vocab, dtype=_TD_DTYPE)
    buf["id"] = np.arange(n_vocab, dtype=np.int32)
    buf["logit"] = row
    cur = _ll.llama_token_data_array(
        data=ctypes.cast(buf.ctypes.data, _ll.llama_token_data_p),
        size=n_vocab, selected=-1, sorted=False)

    samplers = _build_samplers(
        n_vocab, bias=bias, repeat_last_n=repeat_last_n, repeat_penalty=repeat_penalty,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        top_k=top_k, typical_p=typical_p, top_p=top_p, min_p=min_p,
        temperature=temperature)
    try:
        for name, s in samplers:
            if name == "penalties":
                for tok in window:
                    tok = int(tok)
                    if not 0 <= tok < n_vocab:
                        raise ValueError(f"window token {tok} outside vocab of {n_vocab}")
                    _ll.llama_sampler_accept(s, tok)
            if name == "typical":
                _warn_if_typical_nan(buf, cur)
            _ll.llama_sampler_apply(s, ctypes.byref(cur))
        size = int(cur.size)
        if size > n_vocab:
            raise RuntimeError(f"sampler chain grew the array ({size} > {n_vocab})")
        addr = ctypes.cast(cur.data, ctypes.c_void_p).value
        if addr == buf.ctypes.data:
            res = buf[:size].copy()
        else:  # a sampler swapped the data pointer: copy from where it points now
            raw = ctypes.string_at(addr, size * _TD_DTYPE.itemsize)
            res = np.frombuffer(raw, dtype=_TD_DTYPE).copy()
    finally:
        for _, s in samplers:
            _ll.llama_sampler_free(s)
    return res["id"].astype(np.int32), res["logit"].astype(np.float32)


def llama_cpp_logits_after(logits, **kw) -> np.ndarray:
    """float32 [V]: candidates' logits as llama.cpp left them, -inf for removed
    tokens (a token kept with logit -inf, e.g. from a -inf bias, also reads -inf)."""
    v = int(np.asarray(logits).reshape(-1).shape[0])
    ids, lg = llama_cpp_candidates(logits, **kw)
    out = np.full(v, -np.inf, dtype=np.float32)
    if len(np.unique(ids)) != len(ids):
        raise RuntimeError("duplicate token ids in llama.cpp's candidate array")
    out[ids] = lg
    return out


def llama_cpp_probs(logits, *, bias=(), window=(), repeat_last_n=64, repeat_penalty=1.0,
                    frequency_penalty=0.0, presence_penalty=0.0, top_k=0, typical_p=1.0,
                    top_p=1.0, min_p=0.0, temperature=1.0) -> np.ndarray:
    """The distribution llama.cpp's sampler chain draws from for one logits row (float32 [V]):
    stages in llama.cpp's common_sampler default order: logit_bias (pairs (token, value)),
    penalties (llama_sampler_init_penalties(repeat_last_n, repeat_penalty, frequency_penalty,
    presence_penalty), after accepting each token of `window` in order), top_k, typical_p,
    top_p, min_p, temperature (llama_sampler_init_temp). Each stage is only added when not
    neutral (top_k 0, typical_p 1, top_p 1, min_p 0, no bias, penalties neutral). min_keep = 1
    for the truncating stages. Returns float64 [V]: probabilities (softmax of the surviving
    candidates' logits as llama.cpp left them after temperature), 0 for removed tokens."""
    lg = llama_cpp_logits_after(
        logits, bias=bias, window=window, repeat_last_n=repeat_last_n,
        repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, top_k=top_k, typical_p=typical_p,
        top_p=top_p, min_p=min_p, temperature=temperature).astype(np.float64)
    finite = np.isfinite(lg)
    if np.isnan(lg).any():
        raise FloatingPointError("llama.cpp left NaN logits")
    if not finite.any():
        raise FloatingPointError("no candidate with a finite logit survived")
    out = np.zeros_like(lg)
    m = lg[finite].max()
    e = np.exp(lg[finite] - m)
    out[finite] = e / e.sum()
    assert math.isfinite(float(out.sum()))
    return out
