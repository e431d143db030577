"""One request's output (``OutputProcessor``): the one place that turns accepted tokens into
text and decides where the answer ends: an end-of-generation token (unless ``ignore_eos``), a
stop string, ``max_tokens``, or the caller's cancel. The engine only decodes; it is closed as
soon as this says the answer is complete."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from edgespec.params import GenerationParams


class Detokenizer:
    """Incremental detokenizer that never emits half a UTF-8 character."""

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        self.piece = piece
        self.buf = b""

    def push(self, token: int) -> str:
        self.buf += self.piece(token)
        try:
            text, self.buf = self.buf.decode("utf-8"), b""
            return text
        except UnicodeDecodeError as e:
            if len(self.buf) - e.start > 4:  # not a truncated character: give up on it
                text, self.buf = self.buf.decode("utf-8", errors="replace"), b""
                return text
            text = self.buf[: e.start].decode("utf-8")
            self.buf = self.buf[e.start:]
            return text


@dataclass(frozen=True)
class TokenLogprob:
    """A token of the answer with its log probability and the most likely tokens' there (the
    last stage's ``TargetScores`` row), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class OutputProcessor:
    """Feed it accepted tokens (``feed``) and stream the text it returns; once ``done``, the
    answer is ``text`` / ``tokens`` and ``finish`` says why it ended ("stop": end of
    generation or a stop string; "length": ``max_tokens``; "cancelled": ``cancelled()``
    before either)."""

    def __init__(self, tokenizer, params: GenerationParams) -> None:
        self._is_eog = (lambda _t: False) if params.ignore_eos else tokenizer.is_eog
        self._detok = Detokenizer(lambda t: tokenizer.piece(t, special=False))
        self.max_tokens = params.max_tokens
        self.stops = list(params.stop)
        # Text that could still be the start of a stop string is held back until it is not.
        self._holdback = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.tokens: list[int] = []
        #: With ``feed(..., scores)``: one ``TokenLogprob`` per token of ``tokens``.
        self.logprobs: list[TokenLogprob] = []
        self.emitted = 0
        self.finish = "length"
        self.done = False

    def feed(self, chunk: Iterable[int], scores: Sequence[Any] | None = None) -> str:
        """Take the tokens of one step (and their ``(logprob, top)`` scores, when asked
        for); the new text that is safe to show."""
        for i, t in enumerate(chunk):
            if self.done:
                break
            if self._is_eog(t):
                self.finish, self.done = "stop", True
                break
            self.tokens.append(t)
            if scores is not None:
                lp, top = scores[i]
                self.logprobs.append(TokenLogprob(int(t), lp, tuple(top)))
            self.text += self._detok.push(t)
            hit = min((i for i in (self.text.find(s, max(0, self.emitted - len(s)))
                                   for s in self.stops) if i >= 0), default=-1)
            if hit >= 0:
                self.text = self.text[:hit]
                self.finish, self.done = "stop", True
                break
            if len(self.tokens) >= self.max_tokens:
                self.finish, self.done = "length", True
                break
        if self.done:
            return self.flush()
        safe = len(self.text) - self._holdback if self.stops else len(self.text)
        if safe > self.emitted:
            piece, self.emitted = self.text[self.emitted:safe], safe
            return piece
        return ""

    def cancelled(self) -> None:
        """The caller stopped the request before its natural end."""
        if not self.done:
            self.finish, self.done = "cancelled", True

    def flush(self) -> str:
        """Whatever text is still held back (the answer is complete)."""
        piece, self.emitted = self.text[self.emitted:], len(self.text)
        return piece
