"""Retrieval drafter and the DraftTree contract (no model needed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgespec.drafters import DraftTree, RetrievalDrafter
from edgespec.drafters.hybrid import merge_trees


def assert_well_formed(tree: DraftTree, budget: int, max_depth: int) -> None:
    """Budget, depth, parents-first order and no duplicate (parent, token) pairs."""
    assert len(tree) <= budget
    assert tree.parents.dtype == np.int32 and tree.tokens.dtype == np.int32
    assert tree.logprobs.dtype == np.float32
    assert all(p < i for i, p in enumerate(tree.parents.tolist()))
    if len(tree):
        assert int(tree.depths().max()) <= max_depth
        assert np.all(tree.logprobs <= 0.0)
    pairs = list(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True))
    assert len(set(pairs)) == len(pairs)


def test_draft_tree_rejects_children_before_parents() -> None:
    with pytest.raises(ValueError, match="parents-first"):
        DraftTree(np.array([1, -1]), np.array([5, 6]), np.array([-0.1, -0.2]))
    with pytest.raises(ValueError, match="equal length"):
        DraftTree(np.array([-1]), np.array([5, 6]), np.array([-0.1]))


def test_proposes_the_continuation_of_a_repeated_pattern() -> None:
    pattern = [11, 12, 13, 14, 15, 16]
    d = RetrievalDrafter()
    d.begin([1, 2] + pattern + [3, 4] + pattern[:2])
    tree = d.propose(pattern[1], budget=8, max_depth=4)
    assert tree.best_chain() == pattern[2:6]
    assert_well_formed(tree, 8, 4)


def test_branches_where_several_continuations_were_seen_scored_by_frequency() -> None:
    # "7 8" was followed by 1 twice and by 2 once.
    d = RetrievalDrafter(discount=0.0)
    d.begin([7, 8, 1, 5, 7, 8, 2, 5, 7, 8, 1, 6, 0, 7, 8])
    tree = d.propose(8, budget=10, max_depth=1)
    got = dict(zip(tree.tokens.tolist(), tree.logprobs.tolist(), strict=True))
    assert set(got) == {1, 2}
    assert got[1] == pytest.approx(math.log(2 / 3), abs=1e-6)
    assert got[2] == pytest.approx(math.log(1 / 3), abs=1e-6)
    # Most frequent first: the order is also descending score.
    assert tree.tokens.tolist() == [1, 2]


def test_discount_keeps_a_single_match_from_being_certain() -> None:
    d = RetrievalDrafter(discount=1.0)
    d.begin([4, 5, 6, 4, 5])
    tree = d.propose(5, budget=1, max_depth=1)
    assert tree.tokens.tolist() == [6]
    assert tree.logprobs[0] == pytest.approx(math.log(1 / 2), abs=1e-6)


def test_respects_budget_and_depth_on_random_text() -> None:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 20, size=2000).tolist()
    d = RetrievalDrafter(max_matches=64)
    d.begin(toks)
    for budget, depth in [(1, 1), (5, 2), (16, 8), (64, 3), (0, 4), (7, 0)]:
        tree = d.propose(toks[-1], budget, depth)
        assert_well_formed(tree, budget, depth)
        if budget and depth:
            assert len(tree) >= 1  # 2000 tokens over 20 ids: the suffix occurred before
        # descending cumulative score is a valid parents-first order
        scores = tree.scores()
        assert np.all(np.diff(scores) <= 1e-6)


def test_accept_grows_the_index() -> None:
    d = RetrievalDrafter()
    d.begin([100, 101, 102])
    assert len(d.propose(102, 4, 4)) == 0  # nothing after 102 yet
    d.accept([103, 100, 101, 102])
    tree = d.propose(102, 4, 4)
    assert tree.best_chain() == [103, 100, 101, 102]
    assert list(d.history) == [100, 101, 102, 103, 100, 101, 102]


def test_corpus_is_searched_and_documents_do_not_run_together() -> None:
    d = RetrievalDrafter(corpus=[[1, 2, 3, 4], [9, 9, 1, 2, 8]], discount=0.0)
    d.begin([50, 1, 2])
    tree = d.propose(2, 10, 3)
    paths = set(tree.paths())
    assert (3, 4) in paths and (8,) in paths
    # the first document's end (4) is not followed by the second document's start (9)
    assert all(len(p) < 3 for p in paths if p[:2] == (3, 4)) and (3, 4, 9) not in paths
    # Prompt text wins over the corpus only by frequency: each was seen once here.
    assert tree.logprobs[0] == pytest.approx(math.log(1 / 2), abs=1e-6)


def test_root_must_be_the_last_accepted_token() -> None:
    d = RetrievalDrafter()
    with pytest.raises(RuntimeError, match="before begin"):
        d.propose(1, 4, 4)
    d.begin([1, 2, 3])
    with pytest.raises(ValueError, match="last accepted token"):
        d.propose(7, 4, 4)
    with pytest.raises(ValueError, match="budget"):
        d.propose(3, -1, 4)


def test_propose_under_adds_only_new_nodes_below_the_path() -> None:
    pattern = [20, 21, 22, 23, 24, 25, 26, 27]
    d = RetrievalDrafter()
    d.begin(pattern + [0] + pattern[:2])
    first = d.propose(21, budget=3, max_depth=3)
    assert first.best_chain() == [22, 23, 24]
    more = d.propose_under([22], budget=2, max_depth=5)
    # Rooted at 22: the known 23 -> 24 connect the two new nodes 25 -> 26.
    assert more.paths() == [(23,), (23, 24), (23, 24, 25), (23, 24, 25, 26)]
    # Nothing new is left below (22,) within depth 2.
    assert len(d.propose_under([22], budget=4, max_depth=2)) == 0
    # accept() ends the round: the same nodes can be proposed again under the new root.
    d.accept([22, 23])
    assert d.propose(23, 2, 2).best_chain() == [24, 25]


def test_merge_trees_unions_by_path() -> None:
    a = DraftTree.from_nodes([(-1, 5, -0.1), (0, 6, -0.2)])
    b = DraftTree.from_nodes([(-1, 5, -0.9), (0, 7, -0.3), (-1, 8, -1.0)])
    m = merge_trees(a, b)
    assert m.paths() == [(5,), (5, 6), (5, 7), (8,)]
    assert m.logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, -1.0])
