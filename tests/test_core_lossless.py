"""Losslessness of tree verification on a toy target with known next-token distributions.

The toy target has a vocabulary of 8 and a next-token distribution fixed by the last two tokens.
Sampling through random draft trees (several laps until 3 tokens are out) must give first-token
and 3-token distributions that pass a chi-square test against the exact target distribution; a
deliberately biased verifier (accept a drafted child with its target probability, no residual
correction: the classic mistake) run through the same harness must fail it.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import pytest
from scipy import stats

from edgespec.tree import core

VOCAB = 8
TRIALS = 100_000
TABLE = np.random.default_rng(2024).normal(0.0, 1.5, size=(VOCAB, VOCAB, VOCAB)).astype(np.float32)
GREEDY_DRAFT = TABLE.argmax(axis=2)  # a draft that often agrees with the target
CONTEXT = (3, 5)
ROOT_POS = 10


def target_probs(row: np.ndarray, cfg: core.SamplerConfig) -> np.ndarray:
    """Exact distribution of the draw: softmax at the temperature (a -inf logit, a token the
    sampler chain dropped, weighs 0)."""
    x = row.astype(np.float64)
    w = np.exp((x - x.max()) / cfg.temperature)
    return w / w.sum()


def truncated_table() -> np.ndarray:
    """``TABLE`` through the sampler chain's truncation (top-k 6, then top-p 0.9): the rows a
    last stage draws from, dropped tokens at -inf."""
    from edgespec.node.sampler import truncate
    from edgespec.sampling import SamplerSettings

    s = SamplerSettings((("temperature", 0.7), ("top_k", 6), ("top_p", 0.9)))
    return np.stack([truncate(row, s) for row in TABLE.reshape(-1, VOCAB)]).reshape(TABLE.shape)


def draft_tree(rnd: random.Random, ctx: tuple[int, int]):
    """A random draft tree (up to depth 3, 0-2 children per node) as add_nodes arguments."""
    parents, tokens, logprobs = [], [], []
    frontier = [(0, ctx, 0)]  # (parent reference, last two tokens, depth)
    while frontier:
        ref, (a, b), depth = frontier.pop()
        if depth == 3:
            continue
        for _ in range(rnd.randrange(3)):
            tok = int(GREEDY_DRAFT[a, b]) if rnd.random() < 0.5 else rnd.randrange(VOCAB)
            parents.append(ref)
            tokens.append(tok)
            logprobs.append(-rnd.random() * 2.0)
            frontier.append((-len(parents), (b, tok), depth + 1))
    return parents, tokens, logprobs


def lap_rows(tree: core.TokenTree, ctx: tuple[int, int]) -> np.ndarray:
    """The toy target's logits for every row of the ordered tree."""
    tokens, parents = tree.structure()
    prev = np.where(parents >= 0, tokens[np.maximum(parents, 0)], ctx[0])
    prev[0] = ctx[0]
    return TABLE[prev, tokens]


def speculative(cfg: core.SamplerConfig, rnd: random.Random, n_tokens: int) -> list[int]:
    """Tokens out of repeated laps through random trees, with the C++ verifier."""
    out: list[int] = []
    ctx, pos = CONTEXT, ROOT_POS
    tree = core.TokenTree(ctx[1], pos)
    while len(out) < n_tokens:
        parents, tokens, logprobs = draft_tree(rnd, ctx)
        tree.add_nodes(np.asarray(parents, np.int32), np.asarray(tokens, np.int32), logprobs)
        tree.order()
        ver = core.Verification(cfg, tree.root_pos, *tree.structure())
        d = ver.feed(lap_rows(tree, ctx), 0)
        new = [*d.tokens.tolist(), d.bonus]
        out += new
        full = [*ctx, *new]
        ctx = (full[-2], full[-1])
        tree.commit(d)
        pos += len(new)
    return out[:n_tokens]


def biased(cfg: core.SamplerConfig, rnd: random.Random, n_tokens: int) -> list[int]:
    """The classic wrong rule: accept a drafted child c with probability p(c), else draw from p."""
    out: list[int] = []
    ctx = CONTEXT
    while len(out) < n_tokens:
        parents, tokens, _ = draft_tree(rnd, ctx)
        node, a, b = 0, *ctx
        ids = [0]  # node index per entry (root 0); children by parent node
        children: dict[int, list[tuple[int, int]]] = {}
        for j, (p, t) in enumerate(zip(parents, tokens, strict=True)):
            pnode = ids[-p] if p < 0 else 0
            ids.append(j + 1)
            children.setdefault(pnode, []).append((t, j + 1))
        while True:
            p = target_probs(TABLE[a, b], cfg)
            nxt = None
            for t, child in children.get(node, []):
                if rnd.random() < p[t]:
                    nxt = (t, child)
                    break
            if nxt is None:
                x = int(np.searchsorted(np.cumsum(p), rnd.random() * p.sum(), side="right"))
                out.append(min(x, VOCAB - 1))
                a, b = b, out[-1]
                break
            out.append(nxt[0])
            node, a, b = nxt[1], b, nxt[0]
        ctx = (a, b)
    return out[:n_tokens]


def exact_distributions(cfg: core.SamplerConfig) -> tuple[np.ndarray, np.ndarray]:
    p1 = target_probs(TABLE[CONTEXT], cfg)
    p3 = np.zeros((VOCAB,) * 3)
    for x in range(VOCAB):
        p2 = target_probs(TABLE[CONTEXT[1], x], cfg)
        for y in range(VOCAB):
            p3[x, y] = p1[x] * p2[y] * target_probs(TABLE[x, y], cfg)
    return p1, p3.ravel()


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells expected below 5 are pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert obs.sum() == counts.sum()
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def run_harness(method, cfg_args: dict, trials: int) -> tuple[float, float]:
    seeds = np.random.default_rng(7).integers(0, 2**63, size=trials)
    rnd = random.Random(11)
    first, triple = np.zeros(VOCAB, np.int64), np.zeros(VOCAB**3, np.int64)
    for s in seeds.tolist():
        cfg = core.SamplerConfig(seed=s, **cfg_args)
        x, y, z = method(cfg, rnd, 3)
        first[x] += 1
        triple[(x * VOCAB + y) * VOCAB + z] += 1
    p1, p3 = exact_distributions(core.SamplerConfig(**cfg_args))
    return chi_square_p(first, p1), chi_square_p(triple, p3)


@pytest.mark.parametrize(
    ("cfg_args", "truncated"),
    [({"temperature": 1.0}, False), ({"temperature": 0.7}, True)],
    ids=["plain", "topk-topp"],
)
def test_tree_sampling_matches_the_target(cfg_args, truncated, monkeypatch):
    if truncated:  # drafts of dropped tokens are never accepted, the rest stays exact
        monkeypatch.setattr(sys.modules[__name__], "TABLE", truncated_table())
    p_first, p_three = run_harness(speculative, cfg_args, TRIALS)
    assert p_first > 1e-3 and p_three > 1e-3, (p_first, p_three)


def test_biased_verifier_fails_the_same_test():
    p_first, p_three = run_harness(biased, {"temperature": 1.0}, TRIALS)
    assert p_first < 1e-6 and p_three < 1e-6, (p_first, p_three)


def test_output_equals_plain_sampling_with_the_same_seed():
    """Draws keyed by position: through any tree the tokens are those of plain sampling."""
    rnd = random.Random(5)
    for seed in range(2000):
        cfg = core.SamplerConfig(temperature=0.9, seed=seed)
        got = speculative(cfg, rnd, 6)
        ctx, want = list(CONTEXT), []
        for k in range(6):
            row = TABLE[ctx[-2], ctx[-1]][None, :]
            x = int(core._core.sample_rows(row, np.asarray([ROOT_POS + k], np.int32), cfg)[0])
            want.append(x)
            ctx.append(x)
        assert got == want
