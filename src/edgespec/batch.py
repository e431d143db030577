"""The data that travels the ring: a ``Batch`` of rows into stage 0, the last stage's
``Result``, and the ``SamplerRef`` naming the sampler that picks its target tokens. Neutral ground: the head
(``edgespec.head``), the wire (``edgespec.wire.frames``) and the nodes (``edgespec.node``) all
read these types, and none of them owns them (docs/design.md 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edgespec.sampling import MAX_TEXT, SamplerSettings
from edgespec.tree.kvop import KvOp


@dataclass(frozen=True)
class SamplerRef:
    """Which sampler draws a batch's targets, and the context its rows add (docs/design.md
    6.11). A request's sampling is registered once at the last stage, keyed by ``key``
    (``edgespec.node.sampler``): the batch that first wants a target of it carries the
    settings (``register``); every batch carries only the key and the text its rows follow.

    ``text_len``: the request's generated tokens up to and including the step's root, which
    the rows follow; ``added``: the last of them (``text[text_len - len(added):text_len]``),
    those the last stage may not have yet: the tokens gained since the previous step (all of
    them in a registration), so bytes per batch stay the same however long the answer grows.
    ``tree``: (parents, tokens) of the step's tree nodes 0..m-1 (node 0 the root, its parent
    -1); a wanted row whose node is 0 or not in it (a plain lap, a prefill) follows the text
    alone. Text and tree travel only where the request's distribution depends on the text
    (``SamplerSettings.follows_text``). Key 0 is the plain greedy draw: nothing registered."""

    key: int = 0
    register: SamplerSettings | None = None
    text_len: int = 0
    added: tuple[int, ...] = ()
    tree: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    #: Limits on what a received META may carry (the widest tree).
    MAX_TREE = 4096

    def paths(self, text: Sequence[int], nodes: Sequence[int]) -> list[list[int]]:
        """The text each of these tree nodes' targets follows: ``text`` (the generated text
        up to the root) and the node's path below the root."""
        parents, tokens = self.tree
        out = []
        for n in nodes:
            n, path = int(n), []
            while 0 < n < len(parents):  # up to the root (parents come before children)
                path.append(tokens[n])
                n = parents[n]
            out.append([*text, *reversed(path)])
        return out

    def as_meta(self) -> dict:
        if self.key == 0:
            return {}
        meta: dict = {"key": self.key}
        if self.register is not None:
            meta["register"] = self.register.as_meta()
        if self.text_len:
            meta["n"] = self.text_len
            meta["added"] = list(self.added)
        if self.tree[0]:
            meta["tree"] = [list(self.tree[0]), list(self.tree[1])]
        return meta

    @classmethod
    def from_meta(cls, meta: dict) -> SamplerRef:
        if not isinstance(meta, dict):
            raise ValueError("META.sampling must be an object")
        key = meta.get("key", 0)
        if type(key) is not int or not 0 <= key < 1 << 63:
            raise ValueError("META.sampling.key must be a 63-bit request key")
        register = meta.get("register")
        if register is not None:
            register = SamplerSettings.from_meta(register)
        n, added = meta.get("n", 0), meta.get("added", [])
        if (type(n) is not int or not 0 <= n <= MAX_TEXT or not isinstance(added, list)
                or len(added) > n or not _token_ids(added)):
            raise ValueError("META.sampling: n and added must be a text length and at most "
                             "that many token ids")
        tree = meta.get("tree", [[], []])
        if (not isinstance(tree, list) or len(tree) != 2 or not isinstance(tree[0], list)
                or not isinstance(tree[1], list) or len(tree[0]) != len(tree[1])
                or len(tree[0]) > cls.MAX_TREE or not _token_ids(tree[1])
                or any(type(p) is not int or not -1 <= p < i for i, p in enumerate(tree[0]))):
            raise ValueError("META.sampling.tree must be [parents, tokens], each parent "
                             "before its node")
        if key == 0 and (register is not None or n or tree[0]):
            raise ValueError("META.sampling: settings and text need a request key")
        return cls(key, register, n, tuple(added), (tuple(tree[0]), tuple(tree[1])))


def _token_ids(values: list) -> bool:
    return all(type(t) is int and 0 <= t < 1 << 31 for t in values)


@dataclass
class TargetScores:
    """Log probabilities where targets are drawn, one row per wanted row: of the target, and
    of the ``n`` most likely tokens, under the model's distribution with the request's bias
    (``log_softmax`` of the biased logits: temperature and truncation only shape the draw).
    A few bytes per token travel back with the ids (RESULT's LOGPROBS and TOP_IDS)."""

    logprobs: np.ndarray  # float32 [k, 1 + n]: the target's, then the top n's
    top_ids: np.ndarray  # int32 [k, n], most likely first

    @classmethod
    def of(cls, logits: np.ndarray, targets: np.ndarray, n: int) -> TargetScores:
        # float32 throughout (the exponentials summed in float64): 0.14 ms a row for Qwen's
        # 151936 tokens, 0.36 ms with 5 alternatives, 7x less than in float64.
        z = np.asarray(logits, dtype=np.float32)
        peak = z.max(axis=1, keepdims=True)
        total = np.exp(z - peak).sum(axis=1, keepdims=True, dtype=np.float64)
        lse = peak + np.log(total).astype(np.float32)
        chosen = z[np.arange(len(z)), np.asarray(targets, np.int64)] - lse[:, 0]
        n = min(n, z.shape[1])
        if n > 0:
            part = np.argpartition(z, -n, axis=1)[:, -n:]
            vals = np.take_along_axis(z, part, axis=1)
            order = np.argsort(-vals, axis=1, kind="stable")
            top = np.take_along_axis(part, order, axis=1)
            top_lp = np.take_along_axis(vals, order, axis=1) - lse
        else:
            top = np.zeros((len(z), 0), np.int64)
            top_lp = np.zeros((len(z), 0), np.float32)
        return cls(np.concatenate([chosen[:, None], top_lp], axis=1).astype(np.float32),
                   top.astype(np.int32))

    def entry(self, i: int) -> tuple[float, list[tuple[int, float]]]:
        """Row ``i``: (the target's log probability, [(token, log probability)] most likely
        first)."""
        lp = self.logprobs[i]
        return float(lp[0]), [(int(t), float(v)) for t, v in zip(self.top_ids[i], lp[1:],
                                                                  strict=True)]


class SeqIds:
    """The llama.cpp sequences of each row, in the one form that travels from the engine to a
    stage (docs/design.md 5.1): ``ids`` int32 [rows, k] (row i uses ``ids[i, :counts[i]]``;
    what lies past a row's count is padding, -1 from the C++ core, and is never read) and
    ``counts`` int32 [rows]. It is the C++ layout's form and llama_batch's, so neither end
    converts; the wire's bool matrix is made and read here with numpy alone. Values are not
    checked (the wire and the stage runtime refuse bad ids with their own errors); k is trimmed
    to the widest row so a layout's padding never widens the batch. One id per row (plain
    decoding, prefill) takes shorter paths: there a hop's fixed numpy cost is what counts.

    Treated as immutable: one made from a received frame's matrix remembers it, so a batch
    forwarded unchanged goes on with the very matrix it came with (``to_bool_matrix``); a
    changed one (``select``) is a new SeqIds that remembers nothing.
    """

    __slots__ = ("ids", "counts", "_matrix")

    def __init__(self, ids: np.ndarray, counts: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int32)
        counts = np.asarray(counts, dtype=np.int32)
        if ids.ndim != 2 or counts.shape != (ids.shape[0],):
            raise ValueError(f"seq ids must be [rows, k] with counts [rows], got {ids.shape} / "
                             f"{counts.shape}")
        k = max(int(counts.max()), 1) if counts.size else 1
        if k > ids.shape[1]:
            raise ValueError(f"seq id counts must be in 0..{ids.shape[1]}")
        self.ids = ids[:, :k] if ids.shape[1] > k else ids
        self.counts = counts
        self._matrix = None

    @classmethod
    def _of(cls, ids: np.ndarray, counts: np.ndarray, matrix: np.ndarray | None = None) -> SeqIds:
        """Built here from arrays already right (int32, k = the widest row): no checks.
        ``matrix``: read-only, exactly what ``to_bool_matrix()`` would make of them."""
        self = object.__new__(cls)
        self.ids, self.counts, self._matrix = ids, counts, matrix
        return self

    @classmethod
    def single(cls, n: int, seq: int = 0) -> SeqIds:
        """``n`` rows, each in sequence ``seq`` alone (prefill, plain decoding)."""
        return cls._of(np.full((n, 1), seq, np.int32), np.ones(n, np.int32))

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]]) -> SeqIds:
        """From per-row lists of ids (callers and tests that think in lists)."""
        rows = [r if isinstance(r, (list, tuple)) else list(r) for r in rows]
        counts = np.fromiter((len(r) for r in rows), dtype=np.int32, count=len(rows))
        k = max(int(counts.max()), 1) if len(rows) else 1
        ids = np.full((len(rows), k), -1, np.int32)
        if counts.size and counts.sum():
            flat = np.fromiter((int(x) for r in rows for x in r), dtype=np.int64)
            ids[np.repeat(np.arange(len(rows)), counts), _within(counts)] = flat
        return cls._of(ids, counts)

    @classmethod
    def from_bool_matrix(cls, matrix: np.ndarray, remember: bool = False) -> SeqIds:
        """From the wire's bool [rows, sequences] matrix; each row's ids come out ascending.

        ``remember``: keep the matrix for ``to_bool_matrix`` (a received frame's, on its way to
        the next stage: saves making and packing it again). Kept as is when read-only (the
        codec decodes SEQ_IDS so), else as a read-only copy."""
        m = np.asarray(matrix, dtype=bool)
        if m.ndim == 2 and m.shape[1] == 1:  # one sequence column: a row's flag is its count
            counts = m[:, 0].astype(np.int32)
            ids = np.zeros((m.shape[0], 1), np.int32)
            return cls._of(ids, counts, _read_only(m) if remember else None)
        counts = m.sum(axis=1, dtype=np.int32)
        k = (max(counts.tolist(), default=1) if len(counts) <= 64  # numpy's fixed cost, again
             else int(counts.max()))
        if k <= 1 and m.shape[1]:  # one id per row (or none): its column
            ids = m.argmax(axis=1).astype(np.int32).reshape(-1, 1)
        else:
            ids = np.full((m.shape[0], k), -1, np.int32)
            r, c = np.nonzero(m)  # row-major: columns ascend within a row
            ids[r, _within(counts)] = c
        # to_bool_matrix() makes it (largest id + 1) wide: remember only a matrix that is.
        canonical = remember and m.shape[1] > 1 and bool(m[:, -1].any())
        return cls._of(ids, counts, _read_only(m) if canonical else None)

    def used(self) -> np.ndarray:
        """Bool [rows, k]: which entries of ``ids`` are real."""
        return np.arange(self.ids.shape[1])[None, :] < self.counts[:, None]

    def _pairs(self) -> tuple[np.ndarray | None, np.ndarray]:
        """(row, id) of every real entry, row by row; row None: one id in every row."""
        if self.ids.shape[1] == 1:
            if np.count_nonzero(self.counts) == len(self.counts):
                return None, self.ids[:, 0]
            rows = np.flatnonzero(self.counts)
            return rows, self.ids[rows, 0]
        used = self.used()
        return np.nonzero(used)[0], self.ids[used]

    def to_bool_matrix(self, width: int | None = None) -> np.ndarray:
        """The wire's bool [rows, width] matrix (width: largest id + 1 unless given).
        ValueError for an id outside 0..width-1. A remembered matrix (``from_bool_matrix``)
        comes back as it is, read-only."""
        m = self._matrix
        if m is not None and (width is None or width == m.shape[1]):
            return m
        rows, vals = self._pairs()
        if len(vals) <= 64:  # Python's min/max beat numpy's fixed cost on a few ids
            listed = vals.tolist()
            top, low = max(listed, default=-1), min(listed, default=0)
        else:
            top, low = (int(vals.max()), int(vals.min())) if vals.size else (-1, 0)
        width = top + 1 if width is None else width
        if top >= width:
            raise ValueError(f"sequence id {top} does not fit n_seq={width}")
        if low < 0:
            raise ValueError("sequence ids must be >= 0")
        if rows is None:
            return vals[:, None] == np.arange(max(width, 1))
        m = np.zeros((len(self.counts), max(width, 1)), dtype=bool)
        m[rows, vals] = True
        return m

    def max_id(self) -> int:
        """The largest id any row uses (-1 when none)."""
        vals = self._pairs()[1]
        return int(vals.max()) if vals.size else -1

    def select(self, idx: np.ndarray) -> SeqIds:
        """The rows ``idx`` (k shrinks to the widest of them)."""
        return SeqIds(self.ids[idx], self.counts[idx])

    def tolist(self) -> list[list[int]]:
        return [self.ids[i, :c].tolist() for i, c in enumerate(self.counts.tolist())]

    def __len__(self) -> int:
        return len(self.counts)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SeqIds):
            return self.tolist() == other.tolist()
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SeqIds({self.tolist()})"


def _read_only(m: np.ndarray) -> np.ndarray:
    if m.flags.writeable:
        m = m.copy()
        m.flags.writeable = False
    return m


def _within(counts: np.ndarray) -> np.ndarray:
    """Column of each entry when rows of ``counts`` entries are laid out one after another."""
    starts = np.cumsum(counts) - counts
    return np.arange(int(counts.sum())) - np.repeat(starts, counts)


@dataclass
class Batch:
    """One message into the ring: rows of tokens with positions and seq ids."""

    tokens: np.ndarray  # int32 [n]
    pos: np.ndarray  # int32 [n]
    seq_ids: SeqIds  # per row: the llama.cpp sequences it belongs to (lists are converted)
    nodes: np.ndarray  # int32 [n]: tree node per row (prefill rows: any unique ids)
    want: np.ndarray  # bool [n]: rows whose target token the head needs
    lap: int = 0
    segment: int = 0
    pre_ops: list[KvOp] = field(default_factory=list)
    sampling: SamplerRef = field(default_factory=SamplerRef)
    # Lap-timing stamps of the stages it went through (edgespec.laps; rides in META).
    timing: list = field(default_factory=list)
    # What the last stage measured of its wanted rows' targets (``SamplerSettings.logprobs``).
    scores: TargetScores | None = None

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)
        self.pos = np.ascontiguousarray(self.pos, dtype=np.int32)
        self.nodes = np.ascontiguousarray(self.nodes, dtype=np.int32)
        self.want = np.ascontiguousarray(self.want, dtype=bool)
        if not isinstance(self.seq_ids, SeqIds):
            self.seq_ids = SeqIds.from_lists(self.seq_ids)
        n = len(self.tokens)
        if not (len(self.pos) == len(self.seq_ids) == len(self.nodes) == len(self.want) == n):
            raise ValueError("batch fields disagree on the number of rows")

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, keep: np.ndarray) -> Batch:
        """The same batch restricted to rows where ``keep`` is true (pruning in flight)."""
        idx = np.flatnonzero(keep)
        return Batch(self.tokens[idx], self.pos[idx], self.seq_ids.select(idx),
                     self.nodes[idx], self.want[idx], self.lap, self.segment, self.pre_ops,
                     self.sampling, self.timing)


@dataclass
class Result:
    """The last stage's answer to one batch."""

    lap: int
    segment: int
    nodes: np.ndarray  # int32 [k]: the wanted rows that survived pruning
    targets: np.ndarray  # int32 [k]: the target model's token at each of those nodes
    timing: list | None = None  # the stages' lap-timing stamps (edgespec.laps)
    received: int = 0  # when the head had it off the wire (edgespec.laps.now, microseconds)
    scores: TargetScores | None = None  # per target, when the request asked (logprobs)
