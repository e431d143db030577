"""Node-side stage execution: a ``StageWorker`` runs batches through the windows one process
hosts, in ring order, dropping rows of pruned tree nodes; the last stage picks the target
tokens (``pick_targets``). Used by a node's stage slots (``edgespec.node.slots``) and by the
head's in-process ``edgespec.head.chain.LocalChain``. The ``Chain`` contract these serve is
described in ``edgespec.head.chain``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from edgespec.batch import Batch, Sampling
from edgespec.laps import cpu_now, now
from edgespec.tree.kvop import KvOp, KvOpCode

# ------------------------------------------------------------------------- target picking

def pick_targets(logits: np.ndarray, pos: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Target token after each logits row: argmax, or a seeded draw from the target's
    distribution (temperature / top-k / top-p).

    The draw for the token at sequence position p uses the C++ core's ``uniform(seed, p)``, so a
    sampled generation is the same whatever tree or mode produced it, and each accepted token is
    an exact draw from the target's conditional (SpecExec / FlowSpec verification).
    """
    from edgespec.tree import core

    if sampling.greedy:
        return core.argmax_rows(np.ascontiguousarray(logits, dtype=np.float32))
    verifier = core.Verifier(sampling.temperature, sampling.top_k, sampling.top_p,
                             sampling.seed & 0xFFFFFFFFFFFFFFFF)
    return verifier.sample_rows(np.ascontiguousarray(logits, dtype=np.float32), pos)


# ----------------------------------------------------------------------- stage execution

class StageWorker:
    """Runs batches through the windows one process hosts, in ring order.

    Shared by ``LocalChain`` (all windows in one process) and ``edgespec.node`` (the windows
    of one node). Keeps the set of pruned tree nodes of the current lap so rows still in flight
    are dropped before they cost compute.
    """

    #: Laps whose pruned rows are remembered (a decided lap's batches may still arrive).
    PRUNE_MEMORY = 16

    def __init__(self, runtimes: Sequence, is_last: bool) -> None:
        self.runtimes = list(runtimes)
        self.is_last = is_last
        self._pruned: collections.OrderedDict[int, set[int]] = collections.OrderedDict()
        self._pending_ops: list[KvOp] = []
        self._lock = threading.Lock()  # prune() comes from another thread on a node
        self.stamp_windows = False  # LocalChain: stamp every window (edgespec.laps)

    def prune(self, lap: int, nodes: Iterable[int], ops: Sequence[KvOp]) -> None:
        with self._lock:
            self._pruned.setdefault(lap, set()).update(int(n) for n in nodes)
            self._pruned.move_to_end(lap)
            while len(self._pruned) > self.PRUNE_MEMORY:
                self._pruned.popitem(last=False)
            self._pending_ops.extend(ops)

    def apply_ops(self, ops: Sequence[KvOp]) -> None:
        for rt in self.runtimes:
            apply_kv_ops(rt, ops)

    def _flush_pending(self) -> None:
        with self._lock:
            ops, self._pending_ops = self._pending_ops, []
        if ops:
            self.apply_ops(ops)

    def run(self, batch: Batch, hidden: np.ndarray | None) -> tuple[Batch, np.ndarray | None]:
        """Process one batch: pending prune ops, then ``pre_ops``, then drop pruned rows and
        run the remaining rows through every hosted window. Returns the (possibly filtered)
        batch and the hidden states for the next hop, or target tokens on the last stage."""
        self._flush_pending()
        self.apply_ops(batch.pre_ops)
        with self._lock:
            dead_set = self._pruned.get(batch.lap)
            pruned = np.fromiter(dead_set, dtype=np.int32) if dead_set else None
        if pruned is not None:
            # Rows of rejected tree nodes are dropped here. A rejected node's descendants are
            # rejected too, so what remains never depends on a dropped row. (Which rows are
            # still in flight when a prune lands depends on timing; on quantized weights the
            # changed batch shape can move logits by float rounding, never the KV contents.)
            keep = ~np.isin(batch.nodes, pruned)
            if not keep.all():
                if hidden is not None:
                    hidden = hidden[keep]
                batch = batch.select(keep)
                if len(batch) == 0:
                    return batch, None
        t_prev, cpu_prev = now(), cpu_now()
        x = hidden
        for i, rt in enumerate(self.runtimes):
            last_window = self.is_last and i == len(self.runtimes) - 1
            want = np.flatnonzero(batch.want) if last_window else None
            if last_window and len(want) == 0:
                # Nothing wanted (a prefill chunk): llama.cpp needs one output row; asking
                # for the last alone keeps the output head off every other row.
                rt_forward(rt, batch, x, want_rows=[len(batch) - 1])
                return batch, np.zeros(0, dtype=np.int32)
            x = rt_forward(rt, batch, x, want_rows=want)
            if self.stamp_windows:  # in-process windows: one lap-timing stamp each
                t, cpu = now(), cpu_now()
                batch.timing.append([i, t_prev, t_prev, t, cpu - cpu_prev])
                t_prev, cpu_prev = t, cpu
        if self.is_last:
            return batch, pick_targets(x, batch.pos[batch.want], batch.sampling)
        return batch, x


def rt_forward(rt, batch: Batch, hidden: np.ndarray | None, want_rows):
    """One window's forward pass (token ids into a first window, hidden states otherwise)."""
    inputs = batch.tokens if hidden is None else hidden
    return rt.forward(inputs, batch.pos, batch.seq_ids, want_rows=want_rows)


def apply_kv_ops(rt, ops: Sequence[KvOp]) -> None:
    """Apply wire-level KV operations to one window's llama.cpp memory."""
    for op in ops:
        code = KvOpCode(op.code)
        if code == KvOpCode.CP:
            rt.kv_seq_cp(op.seq, op.arg, op.p0, op.p1)
        elif code == KvOpCode.RM:
            rt.kv_seq_rm(op.seq, op.p0, op.p1)
        elif code == KvOpCode.KEEP:
            rt.kv_seq_keep(op.seq)
        else:
            raise ValueError(f"unsupported KV operation {code.name}")
