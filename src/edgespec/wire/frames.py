"""Chain batches and results as wire messages (the one place that maps one onto the other).

A batch enters the ring as a TOKENS frame (head -> first stage) and moves on as HIDDEN frames
(stage -> stage); the last stage answers with a RESULT frame (target token per wanted row).
Rows carry their tree node ids (NODES) so that pruning can drop them anywhere on the way, and
the KV operations to apply before the batch (KV_OPS). The ``SamplerRef`` and the wanted rows
ride in META.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgespec._native import core as _core
from edgespec.batch import Batch, Result, SamplerRef, SeqIds, TargetScores
from edgespec.laps import now, stamps_from_meta
from edgespec.tree.kvop import KvOp, KvOpCode
from edgespec.wire.codec import (
    HIDDEN_ENCODINGS,
    FieldTag,
    Message,
    json_bytes,
    json_object,
    kv_ops_list,
)
from edgespec.wire.header import Kind, WireError
from edgespec.wire.messages import seq_matrix


def _want_meta(want: np.ndarray) -> str | list[int]:
    if len(want) == 1:  # a decode lap: no numpy call at all (design.md 8.3)
        return "all" if want[0] else "none"
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


def send_batch(conn: Any, batch: Batch, hidden: np.ndarray | None = None,
               encoding: str = "f32", stage: int = 0, timing: list | None = None) -> None:
    """Send ``batch`` as a TOKENS (no hidden states) or HIDDEN frame on ``conn`` (a
    ``Connection``), with ``timing`` (lap-timing stamps) in META when given.

    The payload comes from the C++ core in one call where it can (float32 hidden states, the
    common case; docs/design.md 8.3), byte for byte what ``batch_message`` and the codec make
    of it; anything else, including a batch the codec would refuse, goes through them."""
    payload = _fast_payload(batch, hidden, encoding, stage, timing)
    if payload is not None:
        kind = Kind.TOKENS if hidden is None else Kind.HIDDEN
        conn.send_payload(kind, payload, lap_id=batch.lap, segment_id=batch.segment)
        return
    msg = batch_message(batch, hidden, encoding, stage=stage)
    if timing is not None:
        msg.meta["timing"] = timing
    conn.send(msg)


def _fast_payload(batch: Batch, hidden: np.ndarray | None, encoding: str, stage: int,
                  timing: list | None) -> bytes | None:
    if hidden is not None and (encoding != "f32" or hidden.dtype != np.float32):
        return None
    meta = {"sampling": batch.sampling.as_meta(), "want": _want_meta(batch.want),
            "stage": stage}
    if timing is not None:
        meta["timing"] = timing
    try:
        meta_raw = json_bytes(meta)
        kv = np.array(batch.pre_ops, np.int32).reshape(-1, 5) if batch.pre_ops else None
    except (TypeError, ValueError, OverflowError):
        return None  # the codec names the fault
    sid = batch.seq_ids
    return _core.build_batch_payload(
        None if hidden is not None else batch.tokens, batch.pos, np.ascontiguousarray(sid.ids),
        sid.counts, batch.nodes, None if hidden is None else np.ascontiguousarray(hidden), kv,
        meta_raw)


def frame_batch(frame: Any) -> tuple[Batch, np.ndarray | None, int, dict]:
    """(batch, hidden or None, stage, META) of a received TOKENS or HIDDEN frame (a
    ``Frame``). The C++ core reads a canonical payload in one call; anything else is decoded
    by the codec, which also names what is wrong with a bad one (``WireError``)."""
    kind = frame.header.kind
    parsed = (_core.parse_batch_payload(frame.payload, int(kind))
              if kind in (Kind.TOKENS, Kind.HIDDEN) else None)
    if parsed is None:
        msg = frame.decode()
        batch, hidden, stage = message_batch(msg)
        return batch, hidden, stage, msg.meta
    tokens, pos, ids, counts, nodes, hidden, kv, meta_raw = parsed
    meta = json_object(meta_raw) if meta_raw is not None else {}
    n = len(pos)
    try:
        want = _want(meta, n)
        ops = [KvOp(KvOpCode(c), s, a, b, x) for c, s, a, b, x in kv.tolist()] if kv is not None else []
        batch = Batch(np.zeros(n, np.int32) if tokens is None else tokens, pos,
                      SeqIds._of(ids, counts), np.arange(n, dtype=np.int32) if nodes is None
                      else nodes, want, lap=frame.header.lap_id,
                      segment=frame.header.segment_id, pre_ops=ops,
                      sampling=SamplerRef.from_meta(meta.get("sampling", {})))
        stage = int(meta.get("stage", 0))
    except (ValueError, TypeError, AttributeError) as e:  # a hostile META
        raise WireError(f"bad batch: {e}") from None
    return batch, (hidden if kind == Kind.HIDDEN else None), stage, meta


def _want(meta: dict, n: int) -> np.ndarray:
    want_meta = meta.get("want", "all")
    if want_meta == "all":
        return np.ones(n, bool)
    if want_meta == "none":
        return np.zeros(n, bool)
    want = np.zeros(n, bool)
    idx = np.asarray(want_meta, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError("META.want names rows outside the batch")
    want[idx] = True
    return want


def message_batch(msg: Message) -> tuple[Batch, np.ndarray | None, int]:
    """(batch, hidden or None, stage) from a TOKENS or HIDDEN message."""
    meta = msg.meta
    n = len(msg[FieldTag.POSITIONS])
    want = _want(meta, n)
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
                  sampling=SamplerRef.from_meta(meta.get("sampling", {})))
    hidden = msg.fields.get(FieldTag.HIDDEN) if msg.kind == Kind.HIDDEN else None
    return batch, hidden, int(meta.get("stage", 0))


def result_message(batch: Batch, targets: np.ndarray) -> Message:
    """RESULT message: the target token of each wanted (and surviving) row, and their log
    probabilities where the request asked (``batch.scores``)."""
    wanted = batch.nodes[batch.want] if len(batch) else np.zeros(0, np.int32)
    fields: dict[FieldTag, Any] = {FieldTag.TARGETS: np.asarray(targets, np.int32),
                                   FieldTag.NODES: np.asarray(wanted, np.int32)}
    if batch.scores is not None and len(targets):
        fields[FieldTag.LOGPROBS] = batch.scores.logprobs
        fields[FieldTag.TOP_IDS] = batch.scores.top_ids
    return Message(Kind.RESULT, fields, lap_id=batch.lap, segment_id=batch.segment)


def message_result(msg: Message) -> Result:
    targets = np.asarray(msg[FieldTag.TARGETS], np.int32)
    nodes = np.asarray(msg.fields.get(FieldTag.NODES, np.zeros(0, np.int32)), np.int32)
    if len(nodes) != len(targets):
        raise ValueError("RESULT: NODES and TARGETS differ in length")
    scores = None
    if FieldTag.LOGPROBS in msg.fields:
        lp = np.asarray(msg[FieldTag.LOGPROBS], np.float32)
        top = np.asarray(msg.fields.get(FieldTag.TOP_IDS, np.zeros((len(lp), 0), np.int32)),
                         np.int32)
        if lp.shape[0] != len(targets) or top.shape != (len(targets), lp.shape[1] - 1):
            raise ValueError("RESULT: LOGPROBS and TOP_IDS do not match TARGETS")
        scores = TargetScores(lp, top)
    return Result(msg.lap_id, msg.segment_id, nodes, targets,
                  stamps_from_meta(msg.meta.get("timing")), now(), scores)
