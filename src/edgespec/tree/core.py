"""Typed facade over the C++ speculative core ``edgespec._core``.

One lap of speculative decoding, as the head and the stages see it::

    tree = TokenTree(root_token, root_pos)        # root: last committed token, not yet in KV
    ids = tree.add_children(0, tokens, logprobs)  # drafters add candidates (any order, merged)
    tree.select(budget)                           # best-first top-`budget` (SpecExec/EAGLE-2)
    ordered = tree.order()                        # rows in descending score, seq ids, setup ops
    segs = tree.segments(count=4)                 # FlowSpec segments (or one: tree.layout())
    # stages: apply ordered.ops, then decode each segment (tokens, pos, seq_ids, n_seq)
    ver = Verifier(temperature=0.8, seed=7).start(tree)   # last stage, from tree.structure()
    d = ver.feed(logits_of_segment, seg.start)   # ACCEPTED(path, bonus) or PENDING(need_row)
    plan = tree.commit(d) if d.accepted else tree.prune(d)  # KV ops + survivors for every stage

Contracts (identical in tests/ref_core.py, checked side by side):

* **Rows.** ``order()`` places pending nodes as rows in key order (cumulative draft log-prob
  descending, then depth ascending, then index), which is parents-first. Row numbers never change
  within a lap; pruning marks rows dead. Nodes added after ``order()`` are *pending* and get the
  next rows at the next ``order()`` (FlowSpec dynamic expansion: a further segment).
  ``select()`` and ``order()`` renumber pending nodes only and return the old->new map.
* **Seq ids.** Seq 0 is the committed prefix. Every live leaf owns one seq id in 1..max_seqs
  (lowest free first); a row carries the seqs of all live leaves below it, ascending. A new leaf
  under a fresh tree gets ``CP(0 -> s, -1, -1)``; the first new leaf under an earlier leaf row
  inherits that row's seq; any other new leaf under an earlier row ``a`` gets
  ``CP(x -> s, -1, pos(a) + 1)``, x the seq of the lowest-row earlier leaf below ``a``.
* **Ops** are int32 rows ``(code, seq, p0, p1, arg)`` of :class:`edgespec.tree.kvop.KvOpCode`:
  ``CP`` = llama_memory_seq_cp(seq, arg, p0, p1), ``RM`` = llama_memory_seq_rm(seq, p0, p1),
  ``KEEP`` = llama_memory_seq_keep(seq) (``KvOp.rows`` reads them). Apply them in order before
  decoding any later row.
* **Verification** draws the target's token at each visited node (argmax, or a seeded draw at a
  temperature from logits the sampler chain truncated, ``edgespec.node.sampler``; on a ring the
  last stage draws and ``feed_targets`` takes them; the draw for sequence position p uses
  ``uniform(seed, p)``, so the
  output equals plain sampling with the same seed whatever the tree). Child holding it: descend;
  an unprocessed child holding it: PENDING; none: ACCEPTED with it as the bonus token.
* **Plans.** ``commit`` (ACCEPTED): ``CP(x -> 0, root_pos, pos(n) + 1)``, ``KEEP(0)``; the
  tree restarts at the bonus token. ``prune`` (PENDING): ``RM`` for each rejected leaf seq;
  survivors = accepted path + subtree of its deepest node; stages drop in-flight rows whose row
  is not a survivor. A lap's rows in flight after a commit are dropped by the stages.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from edgespec._native import core as _core
from edgespec.tree.kvop import KvOpCode

# The C++ core numbers its plan ops as KvOpCode does (csrc/tree.hpp); a stale build would not.
if (_core.KV_RM, _core.KV_CP, _core.KV_KEEP) != (KvOpCode.RM, KvOpCode.CP, KvOpCode.KEEP):
    raise ImportError("edgespec._core numbers KV operations differently from edgespec.tree.kvop: "
                      "rebuild it (pip install -e .)")

ACCEPTED: int = _core.ACCEPTED
PENDING: int = _core.PENDING
MAX_SEQS: int = _core.MAX_SEQS

Decision = _core.Decision
"""Verdict of a lap: ``status`` (ACCEPTED/PENDING), ``accepted``, ``path`` (rows, root first),
``tokens`` (accepted draft tokens, path[1:]), ``bonus`` (-1 if pending), ``need_row`` (-1 if
accepted), ``n_processed``. ``Decision(status, path, bonus=-1, tokens=None)`` rebuilds one that
came over the wire."""

Verification = _core.Verification
"""Step-wise verifier of one lap. ``feed(logits[k, vocab] float32, start, rows=None)``: the
logits of rows ``start..start+k-1``, or of the ascending row ids ``rows`` (stages drop pruned
rows; rows skipped that way must not be on the accepted path). ``feed_targets(targets, start,
rows=None)`` takes target tokens already drawn (``argmax_rows``/``Verifier.sample_rows``).
``extend(tokens, parents, start)`` appends rows of a dynamic expansion. ``decision``."""

SamplerConfig = _core.SamplerConfig
uniform = _core.uniform


class Ordered(NamedTuple):
    """Result of ``TokenTree.order()``."""

    remap: np.ndarray  # int32, old node index -> new index
    start: int  # first row placed by this call
    stop: int  # one past the last
    ops: np.ndarray  # int32 [k, 5] KV ops to apply before decoding these rows


class Layout(NamedTuple):
    """Batch layout of rows ``[start, start + len(tokens))``: one llama_batch."""

    start: int
    tokens: np.ndarray  # int32 [n]
    pos: np.ndarray  # int32 [n]
    seq_ids: np.ndarray  # int32 [n, width], -1 padded
    n_seq: np.ndarray  # int32 [n], seq ids used per row
    parents: np.ndarray  # int32 [n], global rows, -1 for the root
    depths: np.ndarray  # int32 [n]

    @property
    def stop(self) -> int:
        return self.start + len(self.tokens)


class KvPlan(NamedTuple):
    """KV rollback plan after a decision (see module docstring)."""

    ops: np.ndarray  # int32 [k, 5]
    survivors: np.ndarray  # int32 rows still alive (ascending)
    remap: np.ndarray  # int32 old row -> index among survivors, -1 rejected
    path: np.ndarray  # int32 accepted rows, root first
    tokens: np.ndarray  # int32 accepted draft tokens
    next_root_token: int  # commit only, else -1
    next_root_pos: int  # commit only, else -1


class TokenTree(_core.TokenTree):
    """Drafted candidates under the last committed token (row 0, at ``root_pos``).

    ``add(parent, token, logprob) -> node``; ``add_nodes(parents, tokens, logprobs) -> nodes``
    where a negative parent ``-(j + 1)`` names the node made by entry ``j`` of the same call;
    ``select(budget) -> remap``; ``scores()``, ``tokens()``, ``parents()``, ``depths()``,
    ``seqs()``, ``alive()`` (all nodes); ``size``, ``n_rows``, ``n_free_seqs``, ``n_live_leaves``.
    """

    def __init__(self, root_token: int, root_pos: int, max_seqs: int = MAX_SEQS) -> None:
        super().__init__(root_token, root_pos, max_seqs)

    def add_children(self, parent: int, tokens: Any, logprobs: Any) -> np.ndarray:
        """Adds siblings under ``parent``; returns their node indices (merged duplicates reuse)."""
        tokens = np.asarray(tokens, np.int32)
        return self.add_nodes(np.full(len(tokens), parent, np.int32), tokens, logprobs)

    def order(self) -> Ordered:
        """Places pending nodes as rows (descending score) and assigns their leaf seqs."""
        remap, start, stop, ops = self._order()
        return Ordered(remap, start, stop, ops)

    def layout(self, start: int = 0, stop: int | None = None) -> Layout:
        """Batch layout of rows ``[start, stop)`` (default: all placed rows)."""
        stop = self.n_rows if stop is None else stop
        return Layout(start, *self._layout(start, stop))

    def segment_bounds(
        self,
        size: int | None = None,
        count: int | None = None,
        start: int | None = None,
        stop: int | None = None,
    ) -> np.ndarray:
        """Row boundaries cutting ``[start, stop)`` (default: the rows of the last ``order()``)
        into segments of ``size`` rows or into ``count`` near-equal segments."""
        start = self.last_start if start is None else start
        stop = self.n_rows if stop is None else stop
        return self._segment_bounds(start, stop, size or 0, count or 0)

    def segments(
        self,
        size: int | None = None,
        count: int | None = None,
        start: int | None = None,
        stop: int | None = None,
    ) -> list[Layout]:
        """Layouts of the FlowSpec segments (same arguments as ``segment_bounds``)."""
        b = self.segment_bounds(size, count, start, stop).tolist()
        return [self.layout(b[k], b[k + 1]) for k in range(len(b) - 1)]

    def structure(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, parents) of the placed rows: what the verifying stage needs of the tree."""
        n = self.n_rows
        return self.tokens()[:n], self.parents()[:n]

    def commit(self, decision: Decision) -> KvPlan:
        """Plan for an ACCEPTED decision; the tree restarts at the bonus token."""
        return KvPlan(**_core.plan_commit(self, decision))

    def prune(self, decision: Decision) -> KvPlan:
        """Plan for a PENDING decision (FlowSpec): rejected rows die, their leaf seqs go."""
        return KvPlan(**_core.plan_prune(self, decision))


class Verifier:
    """Verification settings: greedy (temperature 0) or a seeded draw at a temperature from
    logits the sampler chain already truncated (``edgespec.node.sampler``)."""

    def __init__(self, temperature: float = 0.0, seed: int = 0) -> None:
        self.config = SamplerConfig(temperature, seed)

    def start(self, tree: TokenTree) -> Verification:
        """A step-wise verification of the placed rows of ``tree``."""
        tokens, parents = tree.structure()
        return Verification(self.config, tree.root_pos, tokens, parents)

    def verify(self, tree: TokenTree, logits: np.ndarray) -> Decision:
        """Whole-tree verification: ``logits[r]`` is the target's row for tree row ``r``."""
        return self.start(tree).feed(logits, 0)

    def sample_rows(self, logits: np.ndarray, positions: Any) -> np.ndarray:
        """The target's token after each row (row r's node sits at ``positions[r]``)."""
        return _core.sample_rows(logits, np.asarray(positions, np.int32), self.config)


def mask_rows(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """Set to -inf, in place, every token of float32 ``logits`` [k, vocab] whose bit is clear
    in its row of ``bitmask`` (int32 [k, words], llguidance's layout: bit t % 32 of word
    t // 32; words past the bitmask's end count as clear)."""
    _core.mask_rows(logits, bitmask)


def argmax_rows(logits: np.ndarray) -> np.ndarray:
    """Argmax of each float32 row (lowest id among ties), GIL released, one thread."""
    return _core.argmax_rows(logits)
