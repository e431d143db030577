"""Hybrid drafter: retrieval proposes first (free), the draft model fills the rest of the budget.

Retrieval costs microseconds and is often right on repetitive text (code, quoted prompts); the
draft model costs a decode per ``width`` nodes. So retrieval spends the budget first, then the
draft model is told which nodes already exist (``note_proposed``) and adds only *other* nodes,
best-first by its own scores. The two drafters see the same history.
"""

from __future__ import annotations

from collections.abc import Sequence

from edgespec.drafters.base import Drafter, DraftTree, Path, check_request


def merge_trees(first: DraftTree, second: DraftTree) -> DraftTree:
    """Union of two trees under the same root, ``first``'s nodes first; duplicates dropped.

    A node of ``second`` whose path is already present keeps ``first``'s log-probability.
    """
    index: dict[Path, int] = {}
    rows: list[tuple[int, int, float]] = []
    for tree in (first, second):
        for path, lp in zip(tree.paths(), tree.logprobs.tolist(), strict=True):
            if path in index:
                continue
            index[path] = len(rows)
            rows.append((index[path[:-1]] if len(path) > 1 else -1, path[-1], lp))
    return DraftTree.from_nodes(rows)


class HybridDrafter(Drafter):
    """Retrieval first, then a draft model for the remaining budget.

    Args:
        retrieval: the retrieval drafter (its proposals come first).
        model: the draft-model drafter (any :class:`Drafter`; usually ``DraftModelDrafter``).
        max_retrieval_nodes: cap on retrieval's share of one proposal (None = whole budget).
    """

    def __init__(
        self, retrieval: Drafter, model: Drafter, *, max_retrieval_nodes: int | None = None
    ) -> None:
        super().__init__()
        if max_retrieval_nodes is not None and max_retrieval_nodes < 0:
            raise ValueError(f"max_retrieval_nodes must be >= 0, got {max_retrieval_nodes}")
        self.retrieval = retrieval
        self.model = model
        self.max_retrieval_nodes = max_retrieval_nodes
        self.last_split: tuple[int, int] = (0, 0)  # (retrieval nodes, model nodes) last call

    def close(self) -> None:
        """Close both drafters (the model drafter frees its llama.cpp context)."""
        self.retrieval.close()
        self.model.close()

    @property
    def history(self) -> Sequence[int]:
        return self.retrieval.history

    def begin(self, prompt_tokens: Sequence[int]) -> None:
        self.retrieval.begin(prompt_tokens)
        self.model.begin(prompt_tokens)
        self._ledger.clear()

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        check_request(budget, max_depth)
        self._check_root(root)
        self._ledger.clear()
        first = self.retrieval.propose(root, self._retrieval_budget(budget), max_depth)
        # Opens the model's step (and catches its KV up) even when retrieval used the budget.
        self.model.propose(root, 0, max_depth)
        return self._fill((), first, budget, max_depth)

    def propose_under(self, path: Sequence[int], budget: int, max_depth: int) -> DraftTree:
        check_request(budget, max_depth)
        under = tuple(int(t) for t in path)
        first = self.retrieval.propose_under(under, self._retrieval_budget(budget), max_depth)
        return self._fill(under, first, budget, max_depth)

    def accept(self, accepted_tokens: Sequence[int]) -> None:
        self.retrieval.accept(accepted_tokens)
        self.model.accept(accepted_tokens)
        self._ledger.clear()

    def idle(self) -> None:
        self.retrieval.idle()
        self.model.idle()

    def note_proposed(self, tree: DraftTree, under: Sequence[int] = ()) -> None:
        super().note_proposed(tree, under)
        self.retrieval.note_proposed(tree, under)
        self.model.note_proposed(tree, under)

    # -- internals ------------------------------------------------------------------------------

    def _retrieval_budget(self, budget: int) -> int:
        cap = self.max_retrieval_nodes
        return budget if cap is None else min(budget, cap)

    def _fill(self, under: Path, first: DraftTree, budget: int, max_depth: int) -> DraftTree:
        n_first = sum(1 for p in first.paths() if under + p not in self._ledger)
        self._ledger.add_tree(first, under)
        self.model.note_proposed(first, under)
        second = DraftTree.empty()
        if budget > n_first:
            second = self.model.propose_under(under, budget - n_first, max_depth)
            self._ledger.add_tree(second, under)
            self.retrieval.note_proposed(second, under)
        merged = merge_trees(first, second)
        self.last_split = (n_first, len(merged) - len(first))
        return merged
