"""Helpers for ring tests: the unsplit model's greedy output as the reference."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def unsplit_greedy(model_path: Path, prompt: Sequence[int], n_tokens: int) -> list[int]:
    """Greedy continuation by the whole model in one llama.cpp context (no split, no spec).

    Batch shapes follow the ring's (prompt minus its last token in one batch, then one token
    per call): llama.cpp's results depend slightly on batch shape, and "identical" is only
    promised for identical shapes.
    """
    from edgespec.node.runtime import StageRuntime

    out: list[int] = []
    with StageRuntime(model_path, n_ctx=1024, n_seq_max=1, n_threads=1) as rt:
        if len(prompt) > 1:
            rt.forward(np.asarray(prompt[:-1], np.int32), 0)
        logits = rt.forward(np.asarray(prompt[-1:], np.int32), len(prompt) - 1)
        tok = int(np.argmax(logits[-1]))
        pos = len(prompt)
        for _ in range(n_tokens):
            out.append(tok)
            logits = rt.forward(np.array([tok], np.int32), pos)
            pos += 1
            tok = int(np.argmax(logits[-1]))
    return out


#: Largest logit gap a batch-shape change was seen to cause on the quantized real model
#: (llama.cpp's CPU kernels round differently for other batch shapes and KV cell layouts:
#: 0.24-0.37 measured here). Two greedy runs may only part at a near-tie within this gap.
NEAR_TIE = 0.5


def assert_same_greedy(got: Sequence[int], ref: Sequence[int], model_path: Path,
                       prompt: Sequence[int], what: str = "") -> None:
    """``got`` must equal ``ref``, or part from it only where the unsplit model itself is
    torn between the two tokens (a near-tie that batch-shape rounding can flip)."""
    if list(got) == list(ref):
        return
    k = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
             min(len(got), len(ref)))
    assert k < min(len(got), len(ref)), f"{what}: outputs differ in length only"
    from edgespec.node.runtime import StageRuntime

    seq = list(prompt) + list(ref[:k])
    with StageRuntime(model_path, n_ctx=1024, n_seq_max=1, n_threads=1) as rt:
        rt.forward(np.asarray(seq[:-1], np.int32), 0)
        logits = rt.forward(np.asarray(seq[-1:], np.int32), len(seq) - 1)[-1].copy()
    gap = float(logits[ref[k]] - logits[got[k]])
    assert abs(gap) < NEAR_TIE, (
        f"{what}: diverged at token {k} ({got[k]} instead of {ref[k]}) where the model's "
        f"logit gap is {gap:.3f}, not a near-tie: a real error, not rounding")
