"""The head's side of a request's sampler (docs/design.md 6.11): the chain itself runs at the
last stage (``edgespec.node.sampler``); the head registers the request's settings there once,
then names them by key in every batch and sends the generated text in pieces, the tokens
gained since the previous step, so what a batch carries does not grow with the answer."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from edgespec.batch import SamplerRef
from edgespec.sampling import PLAIN_GREEDY, SamplerSettings


class SamplerHandle:
    """One request's sampler as the head addresses it: ``key`` (0 where the settings are the
    plain greedy draw: nothing is registered), and how much of the generated text the last
    stage has been sent."""

    def __init__(self, settings: SamplerSettings) -> None:
        self.settings = settings
        self.key = 0 if settings == PLAIN_GREEDY else 1 + secrets.randbits(62)
        self._base = 0  # text length of the previous step: the last stage has this much
        self._n = 0  # text length of the current step

    def register(self, text: Sequence[int]) -> SamplerRef:
        """The batch that registers the settings (a generation's first wanted row, again on
        a rebuilt ring's replay), with the generated text so far (a replay's)."""
        if self.key == 0:
            return SamplerRef()
        follows = self.settings.follows_text
        self._base = self._n = len(text) if follows else 0
        return SamplerRef(self.key, self.settings, self._n,
                          tuple(int(t) for t in text) if follows else ())

    def ref(self, history: Sequence[int], start: int, root: int,
            tree: tuple[Sequence[int], Sequence[int]] = ((), ())) -> SamplerRef:
        """What a batch of the step below ``root`` carries: the key, and where the sampler
        reads the text (``history[start:]`` then ``root``), the tokens gained since the
        previous step and the step's ``tree`` (parents, tokens)."""
        if self.key == 0:
            return SamplerRef()
        if not self.settings.follows_text:
            return SamplerRef(self.key)
        n = len(history) - start + 1
        if n != self._n:  # a new step: what the previous one sent has arrived
            self._base, self._n = self._n, n
        added = [*history[start + self._base:], root][: n - self._base]
        parents, tokens = tree
        return SamplerRef(self.key, None, n, tuple(int(t) for t in added),
                          (tuple(int(p) for p in parents), tuple(int(t) for t in tokens)))
