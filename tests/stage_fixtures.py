"""Fixtures and checks shared by the stage / shard / pipeline tests.

Import the fixtures into a test module (``from stage_fixtures import tiny_qwen2  # noqa: F401``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from pipeline_fixtures import LocalPipeline, StageProcess
from tinygguf import make_tiny_gguf

# Ranges used on the real 24-layer model: the 3-window chain reuses shards of the 2- and
# 4-window sets, so only 6 shards are written per session.
REAL_SPLITS = {
    2: [(0, 12), (12, 24)],
    3: [(0, 12), (12, 18), (18, 24)],
    4: [(0, 6), (6, 12), (12, 18), (18, 24)],
}

# A 15-node token tree in topological (descending-score) order: parent index per node.
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 9, 10]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_dir: Path) -> Path:
    """4-layer qwen2 tiny model (untied head, q/k/v biases, byte-level BPE)."""
    return make_tiny_gguf(tiny_dir / "tiny-qwen2.gguf", arch="qwen2", n_layer=4, n_embd=64, seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir: Path) -> Path:
    """4-layer llama tiny model (tied head, rope_freqs, SentencePiece vocabulary)."""
    return make_tiny_gguf(tiny_dir / "tiny-llama.gguf", arch="llama", n_layer=4, n_embd=64, seed=1)


@pytest.fixture(scope="module")
def real_shards(real_model_path: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[dict[int, list[Path]]]:
    """Shard paths of the real model for 2, 3 and 4 windows (see REAL_SPLITS), removed when
    the module ends (1.3 GB)."""
    from edgespec.llm.shards import shard_model

    base = tmp_path_factory.mktemp("real-shards")
    two = shard_model(real_model_path, base / "two", ranges=REAL_SPLITS[2], progress=False)
    four = shard_model(real_model_path, base / "four", ranges=REAL_SPLITS[4], progress=False)
    p2 = two.shard_paths(base / "two")
    p4 = four.shard_paths(base / "four")
    yield {2: p2, 3: [p2[0], p4[2], p4[3]], 4: p4}
    shutil.rmtree(base, ignore_errors=True)


def two_by_two(paths: list[Path], **kw) -> tuple[LocalPipeline, list[StageProcess]]:
    """Windows 0 and 2 in one process, 1 and 3 in the other, chained in layer order."""
    pa = StageProcess([paths[0], paths[2]], **kw)
    try:
        pb = StageProcess([paths[1], paths[3]], **kw)
    except BaseException:
        pa.close()
        raise
    chain = [pa.windows[0], pb.windows[0], pa.windows[1], pb.windows[1]]
    return LocalPipeline(chain, owned=[pa, pb]), [pa, pb]


def tree_seq_ids(parents: Sequence[int]) -> tuple[list[list[int]], list[int], list[int]]:
    """For a tree in topological order: per-node seq ids (the leaves below it, numbered from 1),
    the leaves (node indices; leaf k has seq k+1) and each node's depth."""
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    depth = [0] * n
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise ValueError("parents must come before children")
            children[p].append(i)
            depth[i] = depth[p] + 1
    leaves = [i for i in range(n) if not children[i]]
    seqs: list[list[int]] = [[] for _ in range(n)]
    for k, leaf in enumerate(leaves):
        node = leaf
        while node >= 0:
            seqs[node].append(k + 1)
            node = parents[node]
    return [sorted(s) for s in seqs], leaves, depth


def path_to(parents: Sequence[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def check_tree(pipe: LocalPipeline, ref: LocalPipeline, prompt: Sequence[int], tokens: Sequence[int],
               parents: Sequence[int], commit_leaf: int, commit_depth: int, n_after: int) -> dict:
    """Decode a token tree in one batch on ``pipe`` and compare every node's logits with ``ref``
    decoding the root-to-node path alone (in a batch of the same shape, and truly alone); then
    commit a path and compare the next greedy tokens with a context that only ever saw the
    committed path. Returns the measured figures."""
    seqs, leaves, depth = tree_seq_ids(parents)
    n_prompt = len(prompt)
    pipe.reset()
    pipe.prefill(prompt)
    for k in range(len(leaves)):
        pipe.kv_seq_cp(0, k + 1)
    pos = [n_prompt + d for d in depth]
    tree_logits = np.array(pipe.forward(np.asarray(tokens, np.int32), pos, seqs))

    ref.reset()
    ref.prefill(prompt)
    scratch = ref.n_seq_max - 1  # holds filler rows, never read by the path rows
    diffs, diffs_unpadded = [], []
    for node in range(len(tokens)):
        on_path = path_to(parents, node)
        path = [tokens[i] for i in on_path]
        # The path alone, in a batch of the tree's shape: the path's rows keep their row index
        # and position, every other row is filler in a sequence of its own. llama.cpp then runs
        # the same kernels on the same rows (quantized matmul tiles round differently per batch
        # size and row slot), so any difference left would come from the tree's attention masks.
        others = [i for i in range(len(tokens)) if i not in on_path]
        pos = [0] * len(tokens)
        seq = [0] * len(tokens)
        for i in on_path:
            pos[i] = n_prompt + depth[i]
        for k, i in enumerate(others):
            pos[i], seq[i] = k, scratch
        ref.truncate(n_prompt)
        ref.kv_seq_rm(scratch)
        alone = ref.forward(np.asarray(tokens, np.int32), pos, seq, want_rows=[node])[0]
        diffs.append(float(np.abs(alone - tree_logits[node]).max()))
        # And truly alone (a batch of just the path), for the record.
        ref.truncate(n_prompt)
        ref.kv_seq_rm(scratch)
        diffs_unpadded.append(float(np.abs(ref.prefill(path) - tree_logits[node]).max()))
    ref.kv_seq_rm(scratch)

    # Accept the first commit_depth+1 nodes of the path to commit_leaf.
    leaf_seq = leaves.index(commit_leaf) + 1
    accepted = path_to(parents, commit_leaf)[:commit_depth + 1]
    pipe.commit_path(leaf_seq, n_prompt, n_prompt + len(accepted))
    state = {"n_past": pipe.n_past(0), "leaf_seq_len": pipe.n_past(leaf_seq)}
    nxt = int(np.argmax(tree_logits[accepted[-1]]))
    got = [nxt]
    for _ in range(n_after - 1):
        got.append(int(np.argmax(pipe.prefill([got[-1]]))))

    ref.reset()
    committed = list(prompt) + [tokens[i] for i in accepted]
    want = ref.generate_greedy(committed, n_after)
    return {"max_diff": max(diffs), "diffs": diffs, "max_diff_unpadded": max(diffs_unpadded),
            "after_commit": got, "reference": want, **state,
            "expected_n_past": n_prompt + len(accepted)}
