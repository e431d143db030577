"""Helpers for ring tests: the unsplit model's output as the reference, and what rounding
per batch shape may change in a greedy or seeded sampled output."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def unsplit_greedy(model_path: Path, prompt: Sequence[int], n_tokens: int,
                   prefill_chunk: int = 256) -> list[int]:
    """Greedy continuation by the whole model in one llama.cpp context (no split, no spec).

    Batch shapes follow the ring's (``SpecEngine._prefill``: the prompt but its last token in
    chunks of ``prefill_chunk``, the last token riding in the last chunk when it fits, its row
    wanted; then one token per call): llama.cpp's results depend slightly on batch shape, and
    "identical" is only promised for identical shapes.
    """
    from edgespec.node.runtime import StageRuntime

    todo = [int(t) for t in prompt[:-1]]
    chunks = [todo[i:i + prefill_chunk] for i in range(0, len(todo), prefill_chunk)]
    if chunks and len(chunks[-1]) < prefill_chunk:
        chunks[-1].append(int(prompt[-1]))
    else:
        chunks.append([int(prompt[-1])])
    out: list[int] = []
    with StageRuntime(model_path, n_ctx=1024, n_seq_max=1, n_threads=1) as rt:
        pos = 0
        for part in chunks:
            logits = rt.forward(np.asarray(part, np.int32), pos)
            pos += len(part)
        tok = int(np.argmax(logits[-1]))
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


def _first_difference(got: Sequence[int], ref: Sequence[int], what: str) -> int:
    k = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
             min(len(got), len(ref)))
    assert k < min(len(got), len(ref)), f"{what}: outputs differ in length only"
    return k


def _unsplit_logits(model_path: Path, seq: Sequence[int]) -> np.ndarray:
    """The whole model's logits after ``seq`` (all but its last token in one batch)."""
    from edgespec.node.runtime import StageRuntime

    with StageRuntime(model_path, n_ctx=1024, n_seq_max=1, n_threads=1) as rt:
        rt.forward(np.asarray(seq[:-1], np.int32), 0)
        return rt.forward(np.asarray(seq[-1:], np.int32), len(seq) - 1)[-1].copy()


def assert_same_greedy(got: Sequence[int], ref: Sequence[int], model_path: Path,
                       prompt: Sequence[int], what: str = "") -> None:
    """``got`` must equal ``ref``, or part from it only where the unsplit model itself is
    torn between the two tokens (a near-tie that batch-shape rounding can flip)."""
    if list(got) == list(ref):
        return
    k = _first_difference(got, ref, what)
    logits = _unsplit_logits(model_path, list(prompt) + list(ref[:k]))
    gap = float(logits[ref[k]] - logits[got[k]])
    assert abs(gap) < NEAR_TIE, (
        f"{what}: diverged at token {k} ({got[k]} instead of {ref[k]}) where the model's "
        f"logit gap is {gap:.3f}, not a near-tie: a real error, not rounding")


# How far rounding may move every logit at once in assert_same_sampled. The same rows in
# another batch shape differ by up to 0.27 in single logits (the unsplit model, ad hoc), but
# mostly far less and not all the same way; a move of the whole distribution by 0.1 is the
# bound taken here. It moves the seeded draw over tokens within a few percent of probability
# mass of the uniform, and no further.
TILT = 0.1


def _tilted(logits: np.ndarray, cut: int, delta: float) -> np.ndarray:
    """``logits`` with every id <= ``cut`` raised by ``delta`` and every id above lowered."""
    z = logits.copy()
    z[: cut + 1] += delta
    z[cut + 1:] -= delta
    return z


def assert_same_sampled(got: Sequence[int], ref: Sequence[int], model_path: Path,
                        prompt: Sequence[int], seed: int, temperature: float,
                        what: str = "") -> None:
    """``got`` must equal ``ref``, or part only where the seeded draw is torn between the two
    tokens: a move of the logits that rounding per batch shape and KV layout can make turns
    the unsplit model's draw with the same seed and position (the stages' own sampler) into
    each of them. Two such moves: one logit by less than ``NEAR_TIE``, or every logit by at
    most ``TILT``."""
    from edgespec.tree import core

    if list(got) == list(ref):
        return
    k = _first_difference(got, ref, what)
    seq = list(prompt) + list(ref[:k])
    logits = _unsplit_logits(model_path, seq)
    sampler = core.Verifier(temperature, seed & 0xFFFFFFFFFFFFFFFF)
    pos = np.array([len(seq) - 1], np.int32)

    def draw(z: np.ndarray) -> int:
        return int(sampler.sample_rows(z[None, :].astype(np.float32), pos)[0])

    def reachable(tok: int) -> bool:
        base = draw(logits)
        if tok == base:
            return True
        for delta in np.linspace(0.0, NEAR_TIE, 26)[1:]:
            for sign in (1.0, -1.0):
                z = logits.copy()
                z[tok] += sign * delta
                if draw(z) == tok:
                    return True
        # The sampler walks the cumulative distribution in id order (csrc/verify.cpp). Raising
        # every id <= tok and lowering the rest raises every cumulative sum, most of all the
        # one up to tok, so the draw moves down through every id in between as the move grows:
        # tok is drawn on the way iff the largest such move takes the draw to tok or below.
        # Upwards likewise, with the cut below tok.
        if tok < base:
            return draw(_tilted(logits, tok, TILT)) <= tok
        return draw(_tilted(logits, tok - 1, -TILT)) >= tok

    for tok in (got[k], ref[k]):
        assert reachable(tok), (
            f"{what}: sampled {got[k]} instead of {ref[k]} at token {k}, where no logit move "
            f"of rounding's size (one by {NEAR_TIE}, all by {TILT}) draws {tok}: not rounding")
