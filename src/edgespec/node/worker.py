"""Node-side stage execution: a ``StageWorker`` runs batches through the windows one process
hosts, in ring order, dropping rows of pruned tree nodes; the last stage picks the target
tokens. Used by a node's hosted stages (``edgespec.node.datapath``) and by the
head's in-process ``edgespec.head.chain.LocalChain``. The ``Chain`` contract these serve is
described in ``edgespec.head.chain``. The last stage's targets come from the requests' sampler
chains (``edgespec.node.sampler``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from edgespec.batch import Batch, TargetScores
from edgespec.laps import cpu_now, now
from edgespec.node.merge import concat_batches
from edgespec.node.sampler import SamplerStates
from edgespec.tree.kvop import KvOp, KvOpCode

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
        # The requests' samplers (grammars compile against the last window's vocabulary).
        # The vocabulary comes from the window, not through this worker: no cycle keeps the
        # samplers (and their matchers) alive after the worker is dropped.
        self.samplers = (SamplerStates(_vocabulary_of(self.runtimes[-1]) if self.runtimes
                                       else None) if is_last else None)

    def draw(self, batch: Batch, logits: np.ndarray) -> tuple[np.ndarray, TargetScores | None]:
        """The targets of a batch's wanted rows (``logits``, one row each), drawn by the
        sampler its ``SamplerRef`` names."""
        sampler = self.samplers.sampler(batch.sampling)
        return sampler.draw(logits, batch.pos[batch.want], batch.nodes[batch.want],
                            batch.sampling)

    def release(self, keys) -> None:
        """Free the samplers of requests that ended (their ``SamplerRef.key``)."""
        if self.samplers is not None and keys:
            self.samplers.release(keys)

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
        batch, hidden = self._drop_pruned(batch, hidden)
        if len(batch) == 0:
            return batch, None
        return self._forward(batch, hidden)

    def _drop_pruned(self, batch: Batch, hidden: np.ndarray | None
                     ) -> tuple[Batch, np.ndarray | None]:
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
        return batch, hidden

    def _forward(self, batch: Batch, hidden: np.ndarray | None
                 ) -> tuple[Batch, np.ndarray | None]:
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
            targets, batch.scores = self.draw(batch, x)
            return batch, targets
        return batch, x

    def run_many(self, items: Sequence[tuple[Batch, np.ndarray | None]]
                 ) -> list[tuple[Batch, np.ndarray | None] | BaseException]:
        """Process several batches (of other laps, admitted by a ``MergeFence``) as ONE decode
        per window: pending prune ops, each batch's ``pre_ops`` in order, each batch's pruned
        rows dropped, then the surviving rows concatenated through every hosted window. The
        outputs are split back: per batch what ``run`` returns (hidden rows, or on the last
        stage the targets of its wanted rows drawn by its own sampler), or the
        exception that batch failed with (its pre_ops, or its rows when run alone).

        Equivalent to ``run`` on each in turn because the fence admits a batch only when its
        rows and its ``pre_ops`` touch no sequence of an earlier batch's rows: moving its ops
        before their decode changes nothing they read, and attention never crosses sequences.
        If the merged decode fails (the runtime rolled it back: nothing changed), each batch
        is decoded alone, so only the batch at fault fails."""
        self._flush_pending()
        out: list = [None] * len(items)
        live: list[tuple[int, Batch, np.ndarray | None]] = []
        for i, (batch, hidden) in enumerate(items):
            try:
                self.apply_ops(batch.pre_ops)
            except Exception as e:  # as run() would fail it; the others go on
                out[i] = e
                continue
            batch, hidden = self._drop_pruned(batch, hidden)
            if len(batch) == 0:
                out[i] = (batch, None)
            else:
                live.append((i, batch, hidden))
        if len(live) == 1:
            i, batch, hidden = live[0]
            out[i] = self._forward_caught(batch, hidden, copy=False)
        elif live:
            try:
                parts = self._forward_merged([(b, h) for _, b, h in live])
            except Exception:
                parts = [self._forward_caught(b, h, copy=True) for _, b, h in live]
            for (i, _, _), part in zip(live, parts, strict=True):
                out[i] = part
        return out

    def _forward_caught(self, batch: Batch, hidden: np.ndarray | None, copy: bool):
        try:
            batch, x = self._forward(batch, hidden)
        except Exception as e:
            return e
        if copy and not self.is_last:  # decodes follow: each reuses the buffer ``x`` views
            x = np.array(x, copy=True)
        return batch, x

    def _forward_merged(self, parts: list[tuple[Batch, np.ndarray | None]]
                        ) -> list[tuple[Batch, np.ndarray] | Exception]:
        batches = [b for b, _ in parts]
        merged = concat_batches(batches)
        x = None if parts[0][1] is None else np.concatenate([h for _, h in parts])
        bounds = np.cumsum([0] + [len(b) for b in batches])
        for i, rt in enumerate(self.runtimes):
            last_window = self.is_last and i == len(self.runtimes) - 1
            want = np.flatnonzero(merged.want) if last_window else None
            if last_window and len(want) == 0:  # all prefill chunks: see _forward
                rt_forward(rt, merged, x, want_rows=[len(merged) - 1])
                return [(b, np.zeros(0, dtype=np.int32)) for b in batches]
            x = rt_forward(rt, merged, x, want_rows=want)
        if not self.is_last:
            # Views of the window's output buffer, as ``run`` returns: valid until its next
            # decode (the caller forwards them first, or copies).
            return [(b, x[bounds[k]:bounds[k + 1]]) for k, b in enumerate(batches)]
        # Logits rows come in batch order of the wanted rows: split them per batch, and pick
        # each batch's targets with its own sampling. The decode is done (its KV written):
        # a batch whose targets cannot be drawn (its sampling refused) fails alone, here,
        # and is never decoded again.
        res: list = []
        r = 0
        for b in batches:
            k = int(np.count_nonzero(b.want))
            try:
                if k:
                    targets, b.scores = self.draw(b, x[r:r + k])
                else:
                    targets = np.zeros(0, dtype=np.int32)
                res.append((b, targets))
            except Exception as e:
                res.append(e)
            r += k
        return res


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
        elif code == KvOpCode.PARK:
            rt.kv_seq_park(op.seq)
        elif code == KvOpCode.RESTORE:
            rt.kv_seq_restore(op.seq)
        else:
            raise ValueError(f"unsupported KV operation {code.name}")


def _vocabulary_of(runtime: Any) -> Callable[[], Any]:
    """llguidance's view of ``runtime``'s vocabulary, made on first use (``SamplerStates``)."""

    def tokenizer() -> Any:
        from edgespec.grammar import vocab_tokenizer

        return vocab_tokenizer(runtime.model)

    return tokenizer
