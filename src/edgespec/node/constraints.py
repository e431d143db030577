"""At the last stage: each wanted row's own distribution where it depends on the text before
it (``Sampling.follows_text``): the penalties of the generated text along the row's path, and
the grammar's mask after that path (docs/design.md 6.10).

Rows of one tree share their prefix, so one llguidance matcher per grammar walks them in tree
order, rolling back to where each row's path leaves the previous one (a token's consume or
rollback costs a few microseconds; a mask 7-50). A row whose path leaves the grammar (a draft
the grammar does not allow) keeps its logits unmasked: its parent's target was drawn under
the mask, so it can never equal that row's token, and the row is never on an accepted path.
The generated text itself was drawn under the mask: where the grammar cannot follow it
(llguidance's limits), the batch fails with a ValueError instead of going on unconstrained.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import numpy as np

from edgespec.batch import NO_PENALTIES, Sampling

log = logging.getLogger("edgespec")


class RowConstraints:
    """The grammar masks and penalties of one last stage (``runtime``: its last window, whose
    model's vocabulary grammars are compiled against)."""

    #: Matchers kept per grammar text (requests of a ring's slots decoding the same one), and
    #: grammars kept at all.
    FOLLOWERS_PER_GRAMMAR = 4
    GRAMMARS = 16

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self._followers: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()

    def apply(self, logits: np.ndarray, nodes: np.ndarray, sampling: Sampling) -> np.ndarray:
        """``logits`` (wanted rows x vocabulary, float32) with each row's penalties and mask;
        a new array (the runtime's output buffer is left alone)."""
        out = np.array(logits, dtype=np.float32, copy=True)
        paths = sampling.paths(nodes.tolist())
        if sampling.penalties != NO_PENALTIES:
            for i, path in enumerate(paths):
                penalize(out[i], path, sampling.penalties)
        if sampling.grammar is not None:
            self._mask(out, paths, sampling.grammar, len(sampling.text))
        return out

    def _mask(self, out: np.ndarray, paths: list[list[int]], grammar: str, n_text: int
              ) -> None:
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        from edgespec.tree import core

        follower = self._follower(grammar, paths[0] if paths else [])
        mask = allocate_token_bitmask(len(paths), out.shape[1])
        # Tree order is parents first: walking the rows in it moves the matcher least.
        for i in sorted(range(len(paths)), key=lambda i: len(paths[i])):
            followed = follower.move(paths[i])
            if followed < n_text and not follower.matcher.is_stopped():
                # Every generated token was drawn under the mask: a grammar that cannot follow
                # them hit one of llguidance's limits. The request fails rather than go on
                # unconstrained.
                raise ValueError(f"the grammar cannot follow the generated text at token "
                                 f"{followed}: {follower.matcher.get_error() or 'refused'}")
            if followed < len(paths[i]):
                mask[i] = -1  # outside the grammar: never accepted, any target will do
                continue
            fill_next_token_bitmask(follower.matcher, mask, i)
        core.mask_rows(out, mask)

    def _follower(self, grammar: str, text: list[int]) -> Any:
        """A matcher of ``grammar``: the one whose text shares the longest prefix with
        ``text``, or a new one while fewer than ``FOLLOWERS_PER_GRAMMAR`` exist."""
        from edgespec.grammar import Follower, vocab_tokenizer

        pool = self._followers.get(grammar)
        if pool is None:
            pool = self._followers[grammar] = []
            while len(self._followers) > self.GRAMMARS:
                self._followers.popitem(last=False)
        self._followers.move_to_end(grammar)

        def shared(f: Any) -> int:
            n, limit = 0, min(len(f.text), len(text))
            while n < limit and f.text[n] == text[n]:
                n += 1
            return n

        best = max(pool, key=shared, default=None)
        if best is not None and (shared(best) > 0 or len(pool) >= self.FOLLOWERS_PER_GRAMMAR
                                 or not text):
            pool.remove(best)
            pool.append(best)  # most recently used last
            return best
        follower = Follower(vocab_tokenizer(self.runtime.model), grammar)
        pool.append(follower)
        if len(pool) > self.FOLLOWERS_PER_GRAMMAR:
            pool.pop(0)
        return follower


def penalize(row: np.ndarray, text: list[int], penalties: tuple[float, float, float]) -> None:
    """Apply (frequency, presence, repetition) penalties to one row of logits in place, for
    the generated ``text`` before it: OpenAI's frequency and presence over all of it, and
    llama.cpp's repetition penalty over its last ``Sampling.REPEAT_WINDOW`` tokens (a
    positive logit divided by it, a negative one multiplied), applied first as llama.cpp
    does. Only generated text counts: the prompt is not penalised."""
    frequency, presence, repeat = penalties
    if not text:
        return
    if repeat != 1.0:
        recent = np.unique(np.asarray(text[-Sampling.REPEAT_WINDOW:], np.int64))
        recent = recent[recent < row.shape[0]]
        vals = row[recent]
        row[recent] = np.where(vals > 0, vals / repeat, vals * repeat)
    if frequency or presence:
        ids, counts = np.unique(np.asarray(text, np.int64), return_counts=True)
        keep = ids < row.shape[0]
        ids, counts = ids[keep], counts[keep]
        row[ids] -= (counts * frequency + presence).astype(np.float32)
