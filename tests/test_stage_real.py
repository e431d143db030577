"""The real Qwen2.5-Coder-0.5B split into 2, 3 and 4 windows and into 2 processes x 2 windows:
same logits and the same 64 greedy tokens as the unsplit model; a 15-node tree in one batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pipeline_fixtures import LocalPipeline
from stage_fixtures import TREE_PARENTS, check_tree, real_shards, two_by_two  # noqa: F401 - fixtures

from edgespec.llm.llamacpp import load_model
from edgespec.llm.tokenizer import Tokenizer
from edgespec.node.runtime import StageRuntime

pytestmark = pytest.mark.real_model

KW = dict(n_ctx=1024, n_batch=128, n_threads=1, n_seq_max=8)
PROMPTS = ["def quicksort(arr):", "# Check whether a number is prime\ndef is_prime(n):",
           "class Stack:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def prompts(real_model_path: Path) -> list[list[int]]:
    with load_model(real_model_path, vocab_only=True) as m:
        tok = Tokenizer(m)
        return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def unsplit(real_model_path: Path):
    with LocalPipeline([StageRuntime(real_model_path, **KW)]) as p:
        yield p


@pytest.fixture(scope="module")
def reference(unsplit: LocalPipeline, prompts: list[list[int]]) -> dict:
    logits = []
    for p in prompts:
        unsplit.reset()
        logits.append(unsplit.prefill(p))
    unsplit.reset()
    greedy = unsplit.generate_greedy(prompts, 64)
    return {"logits": logits, "greedy": greedy}


@pytest.mark.parametrize("layout", ["2", "3", "4", "2procx2"])
def test_real_split_equals_unsplit(layout: str, real_shards: dict[int, list[Path]],  # noqa: F811
                                   prompts: list[list[int]], reference: dict) -> None:
    if layout == "2procx2":
        pipe, _ = two_by_two(real_shards[4], **KW)
    else:
        pipe = LocalPipeline.from_shards(real_shards[int(layout)], **KW)
    with pipe:
        for p, want in zip(prompts, reference["logits"], strict=True):
            pipe.reset()
            assert np.abs(pipe.prefill(p) - want).max() <= 1e-3
        pipe.reset()
        got = pipe.generate_greedy(prompts, 64)
    assert got == reference["greedy"]
    assert all(len(set(g)) > 5 for g in got)


def test_real_token_tree(real_shards: dict[int, list[Path]], unsplit: LocalPipeline,  # noqa: F811
                         prompts: list[list[int]], reference: dict) -> None:
    # Plausible tokens: the greedy continuation for the trunk, other ids for side branches.
    cont = reference["greedy"][0]
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(200, 20000, len(TREE_PARENTS))]
    tokens[0], tokens[1], tokens[4], tokens[9], tokens[13] = cont[:5]
    with LocalPipeline.from_shards(real_shards[2], **KW) as split:
        r = check_tree(split, unsplit, prompts[0], tokens, TREE_PARENTS, commit_leaf=13,
                       commit_depth=3, n_after=32)
    assert r["max_diff"] <= 1e-3, str(r["diffs"])
    assert r["n_past"] == r["expected_n_past"] and r["leaf_seq_len"] == 0
    assert r["after_commit"] == r["reference"], str((r["after_commit"], r["reference"]))
