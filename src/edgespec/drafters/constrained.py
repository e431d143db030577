"""Drafting under a grammar (docs/design.md 6.10): the tokens the grammar forces come first,
as free drafts (jump-forward: the constrained target can only draw them, or another
tokenization of the same bytes), and the wrapped drafter's guesses hang below them, with
every guess the grammar does not allow dropped before it costs a row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from edgespec.drafters.base import Drafter, DraftTree, check_request
from edgespec.grammar import Follower, vocab_tokenizer


class ConstrainedDrafter(Drafter):
    """``inner``'s drafts for one generation under a grammar. ``follower``: a matcher of the
    grammar on the head's vocabulary; ``text``: the generated tokens so far (a resumed
    generation's), to which every accepted token is added."""

    def __init__(self, inner: Drafter, follower: Follower, text: Sequence[int] = ()) -> None:
        super().__init__()
        self.inner = inner
        self.follower = follower
        self.text = [int(t) for t in text]
        self.forced_drafted = 0  # forced tokens put in trees, for the statistics

    @property
    def history(self) -> Sequence[int]:
        return self.inner.history

    def begin(self, prompt_tokens: Sequence[int]) -> None:
        self.inner.begin(prompt_tokens)

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        check_request(budget, max_depth)
        chain = self._forced((), min(budget, max_depth))
        # Opens the wrapped drafter's step whatever follows.
        first = self.inner.propose(root, 0 if chain else budget, max_depth)
        if not chain:
            return self._allowed(first, ())
        below = self.inner.propose_under(chain, budget - len(chain), max_depth - len(chain))
        return _below_chain(chain, self._allowed(below, tuple(chain)))

    def propose_under(self, path: Sequence[int], budget: int, max_depth: int) -> DraftTree:
        check_request(budget, max_depth)
        under = tuple(int(t) for t in path)
        if self.follower.move(self.text + list(under)) < len(self.text) + len(under):
            return DraftTree.empty()  # the grammar never reaches this node
        chain = self._forced(under, min(budget, max_depth))
        below = self.inner.propose_under([*under, *chain], budget - len(chain),
                                         max_depth - len(chain))
        return _below_chain(chain, self._allowed(below, under + tuple(chain)))

    def accept(self, accepted_tokens: Sequence[int]) -> None:
        self.inner.accept(accepted_tokens)
        self.text.extend(int(t) for t in accepted_tokens)

    def idle(self) -> None:
        self.inner.idle()

    def note_proposed(self, tree: DraftTree, under: Sequence[int] = ()) -> None:
        super().note_proposed(tree, under)
        self.inner.note_proposed(tree, under)

    # -- internals ------------------------------------------------------------------------

    def _forced(self, under: tuple[int, ...], limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after the text and ``under``."""
        if limit <= 0 or self.follower.move(self.text + list(under)) < len(self.text) + len(under):
            return []
        chain = self.follower.forced()[:limit]
        self.forced_drafted += len(chain)
        return chain

    def _allowed(self, tree: DraftTree, under: tuple[int, ...]) -> DraftTree:
        """``tree`` (hanging below ``under``) without the nodes the grammar does not allow
        (nor their descendants)."""
        if len(tree) == 0:
            return tree
        base = self.text + list(under)
        keep = np.zeros(len(tree), bool)
        new_index = np.full(len(tree), -1, np.int64)
        paths = tree.paths()
        rows = []
        for i, (parent, path) in enumerate(zip(tree.parents.tolist(), paths, strict=True)):
            if parent >= 0 and not keep[parent]:
                continue
            full = base + list(path)
            if self.follower.move(full) < len(full):
                continue
            keep[i] = True
            new_index[i] = len(rows)
            rows.append((int(new_index[parent]) if parent >= 0 else -1, int(tree.tokens[i]),
                         float(tree.logprobs[i])))
        return tree if keep.all() else DraftTree.from_nodes(rows)


def constrained_drafter(inner: Drafter, vocab: Any, grammar: str, text: Sequence[int]
                        ) -> ConstrainedDrafter:
    """``inner`` drafting under ``grammar`` (llguidance's text) on the vocabulary of the
    llama.cpp model ``vocab``, after the generated ``text``."""
    return ConstrainedDrafter(inner, Follower(vocab_tokenizer(vocab), grammar), text)


def _below_chain(chain: list[int], tree: DraftTree) -> DraftTree:
    """The forced ``chain`` (probability 1 each), with ``tree`` hanging below its end."""
    n = len(chain)
    rows = [(i - 1, t, 0.0) for i, t in enumerate(chain)]
    rows += [(int(p) + n if p >= 0 else n - 1, int(t), float(lp))
             for p, t, lp in zip(tree.parents.tolist(), tree.tokens.tolist(),
                                 tree.logprobs.tolist(), strict=True)]
    return DraftTree.from_nodes(rows)
