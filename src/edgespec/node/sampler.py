"""The sampler chain, at the last stage: every target token of the ring is drawn here
(docs/design.md 6.11).

One chain, in llama.cpp's ``common_sampler`` order: logit bias, penalties over the last
``repeat_last_n`` generated tokens, the grammar's mask, then top-k, typical-p, top-p, min-p,
temperature and a seeded draw (the C++ core's ``sample_rows``: the token at position p is
drawn with ``uniform(seed, p)``, so a sampled answer is the same whatever tree or mode
produced it). Log probabilities are read from the same chain, after the mask: the model's
distribution under the request's bias, penalties and grammar (temperature and truncation
only shape the draw, as OpenAI reports them).

Rows of a tree are drawn exactly as plain rows: each wanted row's own distribution, along
its own path (the request's generated text, then the row's path below the step's root), so
the C++ verifier, walking the drafted tree with these targets, accepts a draft token only
where the chain would have drawn it (lossless: the accepted tokens' distribution is the
chain's).

A request registers its ``SamplerSettings`` once, keyed by the request (``SamplerRef``);
``SamplerStates`` keeps one ``RequestSampler`` per key: settings, the generated text (only
where a grammar or penalty reads it), one llguidance matcher walking the rows' paths. Each
batch brings the tokens gained since the previous step; the request's end releases the
state (its matcher goes to a small pool for the next request of the same grammar).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from edgespec.batch import SamplerRef, TargetScores
from edgespec.sampling import PLAIN_GREEDY, SamplerSettings

log = logging.getLogger("edgespec")


class RequestSampler:
    """One request's chain: its settings, its generated text, its grammar matcher."""

    def __init__(self, settings: SamplerSettings, follower: Any = None) -> None:
        self.settings = settings
        self.text: list[int] = []
        self.follower = follower  # edgespec.grammar.Follower, where there is a grammar
        s = settings
        self._bias_ids = np.fromiter((t for t, _ in s.bias), np.int64, len(s.bias))
        self._bias_values = np.fromiter((v for _, v in s.bias), np.float32, len(s.bias))
        self._draw = None if s.greedy else _core().Verifier(s.temperature, s.seed)

    def take_text(self, ref: SamplerRef) -> None:
        """Bring the generated text up to ``ref.text_len`` with the tokens the batch carries
        (``ref.added`` ends there); ValueError where they leave a gap or contradict it."""
        at = ref.text_len - len(ref.added)
        if at > len(self.text):
            raise ValueError(f"request {ref.key}: the last stage has {len(self.text)} of its "
                             f"generated tokens, the batch continues from {at}")
        have = self.text[at:ref.text_len]
        if list(ref.added[:len(have)]) != have:
            raise ValueError(f"request {ref.key}: the batch's text contradicts the text "
                             "registered before")
        self.text.extend(ref.added[len(have):])

    def draw(self, logits: np.ndarray, pos: np.ndarray, nodes: np.ndarray, ref: SamplerRef
             ) -> tuple[np.ndarray, TargetScores | None]:
        """Targets of ``logits`` (wanted rows x vocabulary), at positions ``pos``, rows of
        tree nodes ``nodes``; with their ``TargetScores`` when the request asked."""
        s = self.settings
        paths = (ref.paths(self.text[:ref.text_len], nodes.tolist()) if s.follows_text
                 else None)
        z = self.shape(logits, paths, ref.text_len)
        if self._draw is None:
            targets = _core().argmax_rows(z)
        else:
            kept = np.stack([truncate(row, s) for row in z]) if _truncates(s) else z
            targets = self._draw.sample_rows(np.ascontiguousarray(kept, dtype=np.float32), pos)
        if s.logprobs < 0:
            return targets, None
        return targets, TargetScores.of(z, targets, s.logprobs)

    def shape(self, logits: np.ndarray, paths: list[list[int]] | None, n_text: int = 0
              ) -> np.ndarray:
        """The chain's first stages on ``logits`` (rows x vocabulary): the bias, then each
        row's penalties and grammar mask after its own text (``paths``: the generated text
        each row follows, its first ``n_text`` tokens already drawn; None where neither
        reads it). A new float32 array where anything changes."""
        s = self.settings
        z = logits
        if len(self._bias_ids) or s.follows_text:
            z = np.array(logits, dtype=np.float32, copy=True)
        if len(self._bias_ids):
            if int(self._bias_ids.max()) >= z.shape[1]:
                raise ValueError(f"logit_bias names token {int(self._bias_ids.max())}, outside "
                                 f"the vocabulary of {z.shape[1]} tokens")
            z[:, self._bias_ids] += self._bias_values
        if s.follows_text:
            assert paths is not None
            if s.penalized:
                for i, path in enumerate(paths):
                    penalize(z[i], path, s)
            if s.grammar is not None:
                self._mask(z, paths, n_text)
        return np.ascontiguousarray(z, dtype=np.float32)

    def _mask(self, z: np.ndarray, paths: list[list[int]], n_text: int) -> None:
        """The grammar's mask on each row after its path. A row whose path leaves the grammar
        (a draft it does not allow) keeps its logits: its parent's target was drawn under the
        mask, so it can never equal that row's token, and the row is never on an accepted
        path. The generated text itself was drawn under the mask: where the grammar cannot
        follow it (llguidance's limits), the batch fails rather than go on unconstrained."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        follower = self.follower
        mask = allocate_token_bitmask(len(paths), z.shape[1])
        # Tree order is parents first: walking the rows in it moves the matcher least.
        for i in sorted(range(len(paths)), key=lambda i: len(paths[i])):
            followed = follower.move(paths[i])
            if followed < n_text and not follower.matcher.is_stopped():
                raise ValueError(f"the grammar cannot follow the generated text at token "
                                 f"{followed}: {follower.matcher.get_error() or 'refused'}")
            if followed < len(paths[i]):
                mask[i] = -1  # outside the grammar: never accepted, any target will do
                continue
            fill_next_token_bitmask(follower.matcher, mask, i)
        _core().mask_rows(z, mask)


def _core():
    from edgespec.tree import core  # the C++ core, loaded where a draw first needs it

    return core


# ----------------------------------------------------------------------------- the stages

def penalize(row: np.ndarray, text: Sequence[int], s: SamplerSettings) -> None:
    """llama.cpp's penalties on one row of logits, in place, for the tokens among the last
    ``repeat_last_n`` of the generated ``text`` (-1: all of it): a positive logit divided
    by ``repeat_penalty``, a negative one multiplied, then ``frequency_penalty`` subtracted
    once per occurrence and ``presence_penalty`` once. The prompt is not penalised."""
    window = text if s.repeat_last_n < 0 else text[len(text) - s.repeat_last_n:]
    if not len(window):
        return
    ids, counts = np.unique(np.asarray(window, np.int64), return_counts=True)
    keep = ids < row.shape[0]
    ids, counts = ids[keep], counts[keep]
    vals = row[ids]
    if s.repeat_penalty != 1.0:
        vals = np.where(vals <= 0, vals * np.float32(s.repeat_penalty),
                        vals / np.float32(s.repeat_penalty))
    row[ids] = vals - (counts * np.float32(s.frequency_penalty)
                       + np.float32(s.presence_penalty)).astype(np.float32)


def probabilities(row: np.ndarray, s: SamplerSettings) -> np.ndarray:
    """The distribution the draw takes a row's target from (float64 over the vocabulary),
    ``row`` being its logits after bias, penalties and mask: the truncating stages, then
    temperature (greedy: all on the argmax)."""
    z = np.asarray(row, np.float32)
    out = np.zeros(len(z))
    if s.greedy:
        out[int(np.argmax(z))] = 1.0
        return out
    kept = truncate(z, s) if _truncates(s) else z
    ids = np.flatnonzero(kept > -np.inf)
    w = np.exp((kept[ids].astype(np.float64) - float(kept[ids].max())) / s.temperature)
    out[ids] = w / w.sum()
    return out


def _truncates(s: SamplerSettings) -> bool:
    return s.top_k > 0 or s.typical_p < 1.0 or s.top_p < 1.0 or s.min_p > 0.0


def truncate(row: np.ndarray, s: SamplerSettings) -> np.ndarray:
    """``row`` (float32 logits, masked tokens -inf) with every token the truncating stages
    drop set to -inf: top-k, typical-p, top-p, min-p, in that order, each over the tokens
    the one before kept, at least one token kept. Temperature comes after them (the draw)."""
    ids = np.flatnonzero(row > -np.inf)
    if len(ids) == 0:
        raise ValueError("logits row has no finite value")
    z = row[ids]
    for stage in _STAGES:
        ids, z = stage(ids, z, s)
    out = np.full_like(row, -np.inf)
    out[ids] = z
    return out


def _top_k(ids: np.ndarray, z: np.ndarray, s: SamplerSettings):
    k = s.top_k
    if k <= 0 or k >= len(z):
        return ids, z
    keep = np.argpartition(-z, k - 1)[:k]
    return ids[keep], z[keep]


def _probs(z: np.ndarray) -> np.ndarray:
    e = np.exp(z.astype(np.float64) - float(z.max()))
    return e / e.sum()


def _prefix_by(order_key: np.ndarray, mass: np.ndarray, need: float, strict: bool
               ) -> np.ndarray:
    """Indices of the shortest prefix, in ascending ``order_key``, whose ``mass`` reaches
    ``need`` (``strict``: exceeds it); every index when none does. Sorts only as much as
    it needs: the m smallest keys first, m growing 8-fold."""
    n = len(order_key)
    m = 64
    while True:
        m = min(m, n)
        part = np.argpartition(order_key, m - 1)[:m] if m < n else np.arange(n)
        part = part[np.argsort(order_key[part], kind="stable")]
        cum = np.cumsum(mass[part])
        hit = np.flatnonzero(cum > need if strict else cum >= need)
        if len(hit):
            return part[: int(hit[0]) + 1]
        if m == n:
            return part
        m *= 8


def _typical_p(ids: np.ndarray, z: np.ndarray, s: SamplerSettings):
    if s.typical_p >= 1.0 or len(z) == 1:
        return ids, z
    p = _probs(z)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(p)
        entropy = -float(np.nansum(p * logp))
        shifted = np.abs(-logp - entropy)
    keep = _prefix_by(shifted, p, s.typical_p, strict=True)
    return ids[keep], z[keep]


def _top_p(ids: np.ndarray, z: np.ndarray, s: SamplerSettings):
    if s.top_p >= 1.0 or len(z) == 1:
        return ids, z
    keep = _prefix_by(-z, _probs(z), s.top_p, strict=False)
    return ids[keep], z[keep]


def _min_p(ids: np.ndarray, z: np.ndarray, s: SamplerSettings):
    if s.min_p <= 0.0:
        return ids, z
    keep = z >= np.float32(z.max()) + np.float32(np.log(s.min_p))
    return ids[keep], z[keep]


#: The truncating stages, in the chain's order (``FIELDS``' order).
_STAGES: tuple[Callable, ...] = (_top_k, _typical_p, _top_p, _min_p)


# ------------------------------------------------------------------------------ the registry

class SamplerStates:
    """The requests' samplers of one last stage, keyed by request (``SamplerRef.key``).

    ``tokenizer``: makes llguidance's view of the stage's vocabulary (grammars compile
    against it). At most ``MAX_REQUESTS`` are kept: a request's end releases its own, and
    beyond the cap (a head that went away without releasing) the least recently used goes."""

    MAX_REQUESTS = 64
    #: Matchers of released requests kept per grammar text, and grammars kept at all: a
    #: request of the same grammar takes one instead of compiling it again.
    IDLE_PER_GRAMMAR = 2
    IDLE_GRAMMARS = 16

    def __init__(self, tokenizer: Callable[[], Any] | None) -> None:
        self._tokenizer = tokenizer
        self._states: collections.OrderedDict[int, RequestSampler] = collections.OrderedDict()
        self._idle: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
        self._lock = threading.Lock()  # releases come from the node's reader threads
        self._greedy = RequestSampler(PLAIN_GREEDY)

    def __len__(self) -> int:
        return len(self._states)

    def sampler(self, ref: SamplerRef) -> RequestSampler:
        """The sampler that draws a batch's targets: registered now (``ref.register``, which
        replaces an earlier registration of the key: a replayed request), or before."""
        if ref.key == 0:
            return self._greedy
        if ref.register is not None:
            self._register(ref.key, ref.register)
        with self._lock:
            state = self._states.get(ref.key)
            if state is None:
                raise ValueError(f"request {ref.key} has no sampler registered at the last "
                                 "stage (it ended, or the stage restarted)")
            self._states.move_to_end(ref.key)
        if state.settings.follows_text:
            state.take_text(ref)
        return state

    def _register(self, key: int, settings: SamplerSettings) -> None:
        follower = None
        if settings.grammar is not None:
            follower = self._take_idle(settings.grammar)
            if follower is None:
                from edgespec.grammar import Follower

                if self._tokenizer is None:
                    raise ValueError("this stage cannot follow grammars (no vocabulary)")
                follower = Follower(self._tokenizer(), settings.grammar)
        with self._lock:
            old = self._states.pop(key, None)
            self._states[key] = RequestSampler(settings, follower)
            while len(self._states) > self.MAX_REQUESTS:
                gone, _ = self._states.popitem(last=False)
                log.warning("sampler of request %d dropped: more than %d requests registered",
                            gone, self.MAX_REQUESTS)
        if old is not None:
            self._keep_idle(old)

    def release(self, keys: Iterable[int]) -> None:
        """Free the samplers of requests that ended (unknown keys are ignored)."""
        for key in keys:
            with self._lock:
                state = self._states.pop(int(key), None)
            if state is not None:
                self._keep_idle(state)

    def _keep_idle(self, state: RequestSampler) -> None:
        if state.follower is None:
            return
        grammar = state.settings.grammar
        with self._lock:
            pool = self._idle.setdefault(grammar, [])
            self._idle.move_to_end(grammar)
            if len(pool) < self.IDLE_PER_GRAMMAR:
                pool.append(state.follower)
            while len(self._idle) > self.IDLE_GRAMMARS:
                self._idle.popitem(last=False)

    def _take_idle(self, grammar: str) -> Any:
        with self._lock:
            pool = self._idle.get(grammar)
            follower = pool.pop() if pool else None
        if follower is not None:
            follower.move([])  # back to the grammar's start
        return follower
