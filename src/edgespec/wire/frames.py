"""Chain batches and results as wire messages (the one place that maps one onto the other).

A batch enters the ring as a TOKENS frame (head -> first stage) and moves on as HIDDEN frames
(stage -> stage); the last stage answers with a RESULT frame (target token per wanted row).
Rows carry their tree node ids (NODES) so that pruning can drop them anywhere on the way, and
the KV operations to apply before the batch (KV_OPS). Sampling settings and the wanted rows
ride in META.
"""

from __future__ import annotations

import numpy as np

from edgespec.batch import Batch, Result, Sampling, SeqIds
from edgespec.laps import now, stamps_from_meta
from edgespec.wire.codec import HIDDEN_ENCODINGS, FieldTag, Message, kv_ops_list
from edgespec.wire.header import Kind
from edgespec.wire.messages import seq_matrix


def _want_meta(want: np.ndarray) -> str | list[int]:
    wanted = np.count_nonzero(want)  # one count, not all() and any(): this runs every hop
    if wanted == len(want):
        return "all"
    if not wanted:
        return "none"
    return np.flatnonzero(want).tolist()


def batch_message(batch: Batch, hidden: np.ndarray | None = None, encoding: str = "f32",
                  stage: int = 0) -> Message:
    """TOKENS (no hidden states yet) or HIDDEN message for ``batch`` addressed to ``stage``."""
    fields: dict[FieldTag, object] = {
        FieldTag.POSITIONS: batch.pos,
        FieldTag.SEQ_IDS: seq_matrix(batch.seq_ids),
        FieldTag.NODES: batch.nodes,
        FieldTag.META: {"sampling": batch.sampling.as_meta(), "want": _want_meta(batch.want),
                        "stage": stage},
    }
    if batch.pre_ops:
        fields[FieldTag.KV_OPS] = list(batch.pre_ops)
    if hidden is None:
        fields[FieldTag.TOKENS] = batch.tokens
        return Message(Kind.TOKENS, fields, lap_id=batch.lap, segment_id=batch.segment)
    fields[FieldTag.HIDDEN] = hidden
    return Message(Kind.HIDDEN, fields, lap_id=batch.lap, segment_id=batch.segment,
                   hidden_encoding=HIDDEN_ENCODINGS[encoding])


def message_batch(msg: Message) -> tuple[Batch, np.ndarray | None, int]:
    """(batch, hidden or None, stage) from a TOKENS or HIDDEN message."""
    meta = msg.meta
    n = len(msg[FieldTag.POSITIONS])
    want_meta = meta.get("want", "all")
    if want_meta == "all":
        want = np.ones(n, bool)
    elif want_meta == "none":
        want = np.zeros(n, bool)
    else:
        want = np.zeros(n, bool)
        idx = np.asarray(want_meta, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise ValueError("META.want names rows outside the batch")
        want[idx] = True
    tokens = msg.fields.get(FieldTag.TOKENS)
    if tokens is None:
        tokens = np.zeros(n, np.int32)
    nodes = msg.fields.get(FieldTag.NODES)
    if nodes is None:
        nodes = np.arange(n, dtype=np.int32)
    ops = kv_ops_list(msg.fields[FieldTag.KV_OPS]) if FieldTag.KV_OPS in msg.fields else []
    batch = Batch(np.asarray(tokens), np.asarray(msg[FieldTag.POSITIONS]),
                  SeqIds.from_bool_matrix(msg[FieldTag.SEQ_IDS], remember=True), np.asarray(nodes), want,
                  lap=msg.lap_id, segment=msg.segment_id, pre_ops=ops,
                  sampling=Sampling.from_meta(meta.get("sampling", {})))
    hidden = msg.fields.get(FieldTag.HIDDEN) if msg.kind == Kind.HIDDEN else None
    return batch, hidden, int(meta.get("stage", 0))


def result_message(batch: Batch, targets: np.ndarray) -> Message:
    """RESULT message: the target token of each wanted (and surviving) row."""
    wanted = batch.nodes[batch.want] if len(batch) else np.zeros(0, np.int32)
    return Message(Kind.RESULT, {FieldTag.ACCEPTED: np.asarray(targets, np.int32),
                                 FieldTag.NODES: np.asarray(wanted, np.int32)},
                   lap_id=batch.lap, segment_id=batch.segment)


def message_result(msg: Message) -> Result:
    targets = np.asarray(msg[FieldTag.ACCEPTED], np.int32)
    nodes = np.asarray(msg.fields.get(FieldTag.NODES, np.zeros(0, np.int32)), np.int32)
    if len(nodes) != len(targets):
        raise ValueError("RESULT: NODES and ACCEPTED differ in length")
    return Result(msg.lap_id, msg.segment_id, nodes, targets,
                  stamps_from_meta(msg.meta.get("timing")), now())
