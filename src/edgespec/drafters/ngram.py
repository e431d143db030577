"""Retrieval drafter: proposes what followed earlier occurrences of the current suffix.

No model: an n-gram index over the prompt, the accepted text and an optional corpus maps every
n-gram (``min_n <= n <= max_n``) to the positions that followed it. A proposal looks up the
longest suffix of the text that occurred before, gathers what followed its most recent
occurrences into a trie, and proposes the trie's most frequent nodes: a branch appears wherever
different continuations were seen. Scores are log of normalised match frequency.

Pure Python: appending a token costs one dict update per n, a proposal costs
O(max_matches * max_depth) dict operations (tens to hundreds of microseconds; measured by
``bench/drafter_bench.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

from edgespec.drafters.base import (
    Drafter,
    DraftTree,
    Path,
    check_request,
    select_new,
)

_SEPARATOR = -1  # between corpus documents: never part of an n-gram or a continuation


class _NgramIndex:
    """Token buffer plus, for each n, a map from n-gram to the positions that followed it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self.follow: dict[tuple[int, ...], list[int]] = {}

    def clear(self) -> None:
        self.tokens = []
        self.follow = {}

    def append(self, token: int) -> None:
        toks = self.tokens
        pos = len(toks)
        # Index every n-gram that ends just before `pos`: its continuation starts at `pos`.
        for n in range(self.min_n, min(self.max_n, pos) + 1):
            key = tuple(toks[pos - n : pos])
            if _SEPARATOR in key:
                break  # longer n-grams would cross the same document boundary
            self.follow.setdefault(key, []).append(pos)
        toks.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(int(t))

    def continuations(self, key: tuple[int, ...], depth: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` continuations of ``key`` (most recent occurrence first)."""
        positions = self.follow.get(key)
        if not positions:
            return []
        toks = self.tokens
        out: list[list[int]] = []
        for p in reversed(positions[-limit:]):
            cont = toks[p : p + depth]
            if _SEPARATOR in cont:
                cont = cont[: cont.index(_SEPARATOR)]
            if cont:
                out.append(cont)
        return out


class RetrievalDrafter(Drafter):
    """Suffix-match drafter over prompt + accepted text + an optional corpus of token sequences.

    Args:
        corpus: token sequences to search besides the current text (e.g. earlier answers, files).
        min_n: shortest suffix that counts as a match (1 allows single-token matches).
        max_n: longest suffix tried; the longest one that occurred before wins.
        max_matches: how many of the most recent occurrences feed the trie.
        discount: add-``discount`` smoothing of the frequencies, so that a continuation seen
            once is scored log(1/2) rather than certain (0); 0 gives raw frequencies.
    """

    def __init__(
        self,
        corpus: Iterable[Sequence[int]] = (),
        *,
        min_n: int = 1,
        max_n: int = 6,
        max_matches: int = 32,
        discount: float = 1.0,
    ) -> None:
        super().__init__()
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        if discount < 0:
            raise ValueError(f"discount must be >= 0, got {discount}")
        self.min_n, self.max_n = min_n, max_n
        self.max_matches = max_matches
        self.discount = float(discount)
        self._text = _NgramIndex(min_n, max_n)
        self._corpus = _NgramIndex(min_n, max_n)
        self.add_corpus(corpus)

    # -- corpus and history ---------------------------------------------------------------

    def add_corpus(self, sequences: Iterable[Sequence[int]]) -> None:
        """Index more token sequences (kept across generations)."""
        for seq in sequences:
            toks = [int(t) for t in seq]
            if any(t < 0 for t in toks):
                raise ValueError("corpus token ids must be >= 0")
            if self._corpus.tokens:
                self._corpus.append(_SEPARATOR)
            self._corpus.extend(toks)

    @property
    def history(self) -> Sequence[int]:
        return self._text.tokens

    # -- Drafter ----------------------------------------------------------------------------

    def begin(self, prompt_tokens: Sequence[int]) -> None:
        toks = [int(t) for t in prompt_tokens]
        if not toks:
            raise ValueError("begin() needs at least one prompt token (the first root)")
        if any(t < 0 for t in toks):
            raise ValueError("token ids must be >= 0")
        self._text.clear()
        self._text.extend(toks)
        self._ledger.clear()

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        check_request(budget, max_depth)
        self._check_root(root)
        self._ledger.clear()  # a new step starts at a new root
        return self._propose((), budget, max_depth)

    def propose_under(self, path: Sequence[int], budget: int, max_depth: int) -> DraftTree:
        check_request(budget, max_depth)
        if not self._text.tokens:
            raise RuntimeError("propose_under() called before begin()")
        return self._propose(tuple(int(t) for t in path), budget, max_depth)

    def accept(self, accepted_tokens: Sequence[int]) -> None:
        if not self._text.tokens:
            raise RuntimeError("accept() called before begin()")
        toks = [int(t) for t in accepted_tokens]
        if any(t < 0 for t in toks):
            raise ValueError("token ids must be >= 0")
        self._text.extend(toks)
        self._ledger.clear()

    # -- internals ------------------------------------------------------------------------------

    def candidates(
        self, under: Path, max_depth: int
    ) -> Iterator[tuple[Path, int, float]]:
        """Trie nodes below ``under`` as ``(path, token, logprob)``, best score first (lazy)."""
        if max_depth == 0:
            return
        tail = self._text.tokens[-self.max_n :] + list(under)
        conts: list[list[int]] = []
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            key = tuple(tail[-n:])
            conts = self._text.continuations(key, max_depth, self.max_matches)
            if len(conts) < self.max_matches:
                conts += self._corpus.continuations(
                    key, max_depth, self.max_matches - len(conts)
                )
            if conts:
                break
        if not conts:
            return
        # Trie of continuations as flat arrays (node id -> count, parent, depth); dict lookups on
        # (parent id, token) avoid building a tuple per visited node.
        child: dict[tuple[int, int], int] = {}
        count: list[int] = []
        parent: list[int] = []
        depth: list[int] = []
        token: list[int] = []
        for cont in conts:
            node = -1
            for t in cont:
                key2 = (node, t)
                nxt = child.get(key2)
                if nxt is None:
                    nxt = len(count)
                    child[key2] = nxt
                    count.append(1)
                    parent.append(node)
                    depth.append(1 if node < 0 else depth[node] + 1)
                    token.append(t)
                else:
                    count[nxt] += 1
                node = nxt
        total = len(conts)
        disc = self.discount
        # Nodes were created parents first, so one pass computes every cumulative score.
        logprob = [0.0] * len(count)
        score = [0.0] * len(count)
        for i, p in enumerate(parent):
            logprob[i] = math.log(count[i] / ((count[p] if p >= 0 else total) + disc))
            score[i] = logprob[i] + (score[p] if p >= 0 else 0.0)
        # Descending score; a child never outscores its parent, and ties go to the shallower
        # node, then to the more recent occurrence: the order is parents-first.
        order = sorted(range(len(count)), key=lambda i: (-score[i], depth[i], i))
        paths: dict[int, Path] = {-1: ()}
        for i in order:
            path = paths[parent[i]] + (token[i],)
            paths[i] = path
            yield path, token[i], logprob[i]

    def _propose(self, under: Path, budget: int, max_depth: int) -> DraftTree:
        if budget == 0 or max_depth == 0:
            return DraftTree.empty()
        tree = select_new(self.candidates(under, max_depth), under, self._ledger, budget)
        self._ledger.add_tree(tree, under)
        return tree
