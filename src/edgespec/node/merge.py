"""Merged decodes (docs/design.md 5.7): batches of several requests waiting at one stage
run as ONE llama.cpp batch. Which queued batches may join (``MergeFence``, ``gather``) and how
their rows are joined (``concat_batches``); ``StageWorker.run_many`` runs them and splits the
outputs, ``edgespec.node.datapath`` takes them off a stage's inbox and forwards each on.
"""

from __future__ import annotations

import collections
import queue
from collections.abc import Sequence

import numpy as np

from edgespec.batch import Batch, SeqIds
from edgespec.tree.kvop import KvOp, KvOpCode

#: Rows one merged decode may carry when the runtime does not say its ``n_batch``.
MERGE_MAX_ROWS = 512


def row_seqs(batch: Batch) -> set[int]:
    """The llama.cpp sequences a batch's rows use."""
    s = batch.seq_ids
    return set(s.ids[s.used()].tolist())


def op_seqs(ops: Sequence[KvOp]) -> set[int] | None:
    """The sequences KV operations read or change; None when they reach every sequence (an
    RM of seq -1) or sequences they do not name (KEEP drops every other one)."""
    seqs: set[int] = set()
    for op in ops:
        code = KvOpCode(op.code)
        if code == KvOpCode.KEEP or op.seq < 0:
            return None
        seqs.add(int(op.seq))
        if code == KvOpCode.CP:
            seqs.add(int(op.arg))
    return seqs


class MergeFence:
    """Which queued batches may join the first one's decode (``StageWorker.run_many``).

    A batch is admitted when neither its rows nor its ``pre_ops`` touch a sequence that the
    rows admitted before it use. Two batches of one sequence (prefill chunks of one prompt,
    flow-mode segments of one tree) are never merged: the second continues the first's KV.
    With slots (seq ids partitioned between requests) batches of different requests pass.

    A batch passed over (``skip``) stays behind, to run next in its order; a later batch may
    still join, moving ahead of it, only if the two touch no common sequence either way (so a
    request's decode rides along with another's prefill chunk instead of waiting behind all
    of its chunks, docs/design.md 5.7). Nothing may move past KV operations that reach every
    sequence: ``skip`` says False then, and the scan stops.
    """

    def __init__(self, first: Batch | None) -> None:
        self.rows = row_seqs(first) if first is not None else set()
        self.skipped: set[int] = set()  # sequences of batches passed over

    def admit(self, batch: Batch) -> bool:
        touched = op_seqs(batch.pre_ops)
        if touched is None:
            return False
        rows = row_seqs(batch)
        mine = rows | touched
        if not self.rows.isdisjoint(mine) or not self.skipped.isdisjoint(mine):
            return False
        self.rows |= rows
        return True

    def skip(self, batch: Batch) -> bool:
        """``batch`` stays behind; False when nothing may move past it (its KV operations
        reach sequences it does not name)."""
        touched = op_seqs(batch.pre_ops)
        if touched is None:
            return False
        self.skipped |= row_seqs(batch) | touched
        return True


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """One batch of the rows of several, in order (what one llama.cpp decode runs). Lap,
    pre_ops, sampling and timing stay with the batches; only the rows are joined."""
    k = max(b.seq_ids.ids.shape[1] for b in batches)
    ids = np.full((sum(len(b) for b in batches), k), -1, np.int32)
    r = 0
    for b in batches:
        m = b.seq_ids.ids
        ids[r:r + len(b), :m.shape[1]] = m
        r += len(b)
    seq = SeqIds(ids, np.concatenate([b.seq_ids.counts for b in batches]))
    return Batch(np.concatenate([b.tokens for b in batches]),
                 np.concatenate([b.pos for b in batches]), seq,
                 np.concatenate([b.nodes for b in batches]),
                 np.concatenate([b.want for b in batches]))


#: Queued items one ``gather`` looks through for batches that may join a decode.
MERGE_LOOKAHEAD = 32
#: A batch of at most this many rows is small (a plain lap, a tree segment, a prompt's chunk
#: beside running answers); a bigger one is a prompt's chunk or a whole tree.
SMALL_ROWS = 16


def wants_rows(batch: Batch) -> bool:
    """Whether a batch asks for targets (a decode: a plain lap, a tree, a prompt's last
    chunk); one that asks for none only fills KV (a prefill chunk)."""
    return bool(batch.want.any())


def gather(inbox: queue.Queue, first: tuple, cap: int, behind: collections.deque,
           decodes_first: bool = True) -> list[tuple]:
    """The batch items to run as one decode, ``first`` (a ``("batch", batch, hidden)`` item
    just taken off ``inbox`` or ``behind``) and those waiting after it that may share its
    decode (``MergeFence``), rows within ``cap``. ``behind`` holds items taken off the inbox
    earlier but not run yet; they come first, in order. Items passed over go (back) into
    ``behind`` in their order, to run next. The scan stops at KV operations, the stop signal
    None, a batch whose KV operations reach every sequence, or after MERGE_LOOKAHEAD items.

    Decodes first (``decodes_first``, docs/design.md 5.7): when ``first`` is a prefill chunk
    (no row wanted) and decodes of other sequences (at most SMALL_ROWS rows each) wait after
    it, those run now, as one decode, and ``first`` goes back to the front of ``behind``: a
    prompt beside running answers delays each of their tokens by the chunk computing at a
    stage at most, not by the chunks queued there. The caller passes ``decodes_first=False``
    when ``first`` was put back so once: a chunk yields once, and then runs (taking along
    whatever may join it), so a busy ring still fills the prompt's KV.

    A decode takes along only decodes: on a CPU a row costs about the same in any batch
    (docs/experiments.md 18), so a chunk's rows in a decode would only delay its answers."""
    batch = first[1]
    if decodes_first and not wants_rows(batch):
        fence = MergeFence(None)
        if fence.skip(batch):
            decodes = _scan(inbox, fence, cap, 0, behind, SMALL_ROWS, decodes=True)
            if decodes:
                behind.appendleft(first)
                return decodes
    if len(batch) >= cap:
        return [first]
    # One batch bigger than SMALL_ROWS per decode at most: a prompt's rows are compute-bound
    # and gain nothing from sharing a decode, while two prompts decoded one after the other
    # are pipelined (the next stage starts on the first while this one computes the second).
    return [first, *_scan(inbox, MergeFence(batch), cap, len(batch), behind, cap,
                          big=int(len(batch) <= SMALL_ROWS), decodes=wants_rows(batch))]


def _scan(inbox: queue.Queue, fence: MergeFence, cap: int, rows: int,
          behind: collections.deque, max_rows: int, big: int = 0,
          decodes: bool = False) -> list[tuple]:
    """Batch items (``behind`` first, then the inbox) of at most ``max_rows`` rows each that
    pass ``fence``, within ``cap`` rows together with ``rows``, at most ``big`` of them
    bigger than SMALL_ROWS, and (``decodes``) only those that want rows; the others go into
    ``behind``, in order (see ``gather``)."""
    items: list[tuple] = []
    ahead = list(behind)  # what the scan looks at: ``behind``, then the inbox
    behind.clear()
    looked = 0
    while looked < MERGE_LOOKAHEAD:
        if looked == len(ahead):
            try:
                ahead.append(inbox.get_nowait())
            except queue.Empty:
                break
        nxt = ahead[looked]
        looked += 1
        if (nxt is not None and nxt[0] == "batch" and len(nxt[1]) <= max_rows
                and (len(nxt[1]) <= SMALL_ROWS or big > 0)
                and (not decodes or wants_rows(nxt[1]))
                and rows + len(nxt[1]) <= cap and fence.admit(nxt[1])):
            items.append(nxt)
            rows += len(nxt[1])
            big -= len(nxt[1]) > SMALL_ROWS
            continue
        behind.append(nxt)  # stays behind, in order
        if nxt is None or nxt[0] != "batch" or not fence.skip(nxt[1]):
            break
    behind.extend(ahead[looked:])  # not looked at: still in order
    return items
