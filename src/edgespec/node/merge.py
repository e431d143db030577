"""Merged decodes (docs/design.md 5.7): batches of several requests waiting at one stage
run as ONE llama.cpp batch. Which queued batches may join (``MergeFence``, ``gather``) and how
their rows are joined (``concat_batches``); ``StageWorker.run_many`` runs them and splits the
outputs, ``edgespec.node.slots`` takes them off a stage's inbox and forwards each on.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence

import numpy as np

from edgespec.batch import Batch, SeqIds
from edgespec.tree.kvop import KvOp, KvOpCode

#: Rows one merged decode may carry when the runtime does not say its ``n_batch``.
MERGE_MAX_ROWS = 512
#: What ``gather`` hands back when it took nothing past the batches it merged.
NOTHING = ("nothing", None, None)


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
    With slots (seq ids partitioned between requests) batches of different requests pass;
    the caller stops at the first batch refused, so the order of work never changes.
    """

    def __init__(self, first: Batch) -> None:
        self.rows = row_seqs(first)

    def admit(self, batch: Batch) -> bool:
        touched = op_seqs(batch.pre_ops)
        if touched is None:
            return False
        rows = row_seqs(batch)
        if not self.rows.isdisjoint(rows) or not self.rows.isdisjoint(touched):
            return False
        self.rows |= rows
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


def gather(inbox: queue.Queue, first: tuple, cap: int) -> tuple[list[tuple], tuple | None]:
    """``first`` (a ``("batch", batch, hidden)`` item just taken off ``inbox``) and the batch
    items already waiting behind it that may share its decode: taken in order while they pass
    the ``MergeFence`` and keep the rows within ``cap``. Stops at the first item that is not
    such a batch (KV operations, the stop signal None, a batch refused), which is handed back
    to run next (``NOTHING`` when the inbox ran empty): nothing is reordered."""
    items: list[tuple] = [first]
    rows = len(first[1])
    if rows >= cap:
        return items, NOTHING
    fence = MergeFence(first[1])
    while True:
        try:
            nxt = inbox.get_nowait()
        except queue.Empty:
            return items, NOTHING
        if (nxt is None or nxt[0] != "batch" or rows + len(nxt[1]) > cap
                or not fence.admit(nxt[1])):
            return items, nxt
        items.append(nxt)
        rows += len(nxt[1])
