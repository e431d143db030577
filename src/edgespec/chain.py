"""The engine's view of a ring of stages: batches go in at stage 0, target tokens come out.

A ``Chain`` hides where the stages run: ``LocalChain`` runs them in this process (tests, the
one-machine path); ``edgespec.ring.RemoteChain`` runs them on nodes over the network. Both obey
the same contract, which is what lets the speculative engine stay ignorant of sockets:

- ``submit(batch)``: enqueue a batch; it flows through every stage in submission order.
  ``batch.pre_ops`` (KV operations) are applied by every stage just before that batch, so a
  plan can never overtake the rows it depends on.
- ``next_result()``: the last stage's answer for the next batch, in submission order: for each
  wanted row, the target model's token there (argmax when greedy, a draw from the target
  distribution when sampling). Only token ids travel back, never distributions.
- ``prune(nodes, ops)``: FlowSpec pruning. It may overtake batches in flight: every stage drops
  rows of pruned tree nodes from batches it has not computed yet, then applies ``ops``.
- ``kv(ops)``: KV operations ordered after everything submitted so far (commit, reset).
- ``abandon()``: give up on everything in flight (after a failure); nothing of it is
  returned by ``next_result`` any more.

A stage that cannot run this head's work makes ``next_result`` raise ``StageFailure``; a lost
node raises ``NodeLost`` (``edgespec.errors``).

Rows of a batch are tree nodes (``batch.nodes``, unique within one lap); results name the
nodes they answer for, so a result stays meaningful after rows were pruned on the way.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edgespec.errors import StageFailure
from edgespec.laps import now
from edgespec.wire import KvOp, KvOpCode


@dataclass(frozen=True)
class Sampling:
    """How the last stage picks the target token of a row. temperature 0 = greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def as_meta(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "seed": self.seed}

    @classmethod
    def from_meta(cls, meta: dict) -> Sampling:
        return cls(float(meta.get("temperature", 0.0)), int(meta.get("top_k", 0)),
                   float(meta.get("top_p", 1.0)), int(meta.get("seed", 0)))


@dataclass
class Batch:
    """One message into the ring: rows of tokens with positions and seq ids."""

    tokens: np.ndarray  # int32 [n]
    pos: np.ndarray  # int32 [n]
    seq_ids: list[list[int]]  # per row: the llama.cpp sequences the row belongs to
    nodes: np.ndarray  # int32 [n]: tree node per row (prefill rows: any unique ids)
    want: np.ndarray  # bool [n]: rows whose target token the head needs
    lap: int = 0
    segment: int = 0
    pre_ops: list[KvOp] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    # Lap-timing stamps of the stages it went through (edgespec.laps; rides in META).
    timing: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)
        self.pos = np.ascontiguousarray(self.pos, dtype=np.int32)
        self.nodes = np.ascontiguousarray(self.nodes, dtype=np.int32)
        self.want = np.ascontiguousarray(self.want, dtype=bool)
        n = len(self.tokens)
        if not (len(self.pos) == len(self.seq_ids) == len(self.nodes) == len(self.want) == n):
            raise ValueError("batch fields disagree on the number of rows")

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, keep: np.ndarray) -> Batch:
        """The same batch restricted to rows where ``keep`` is true (pruning in flight)."""
        idx = np.flatnonzero(keep)
        return Batch(self.tokens[idx], self.pos[idx], [self.seq_ids[i] for i in idx],
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
    received: float = 0.0  # when the head had it off the wire (edgespec.laps.now)


class Chain(Protocol):
    """What the speculative engine needs from a ring (see the module docstring)."""

    n_vocab: int
    n_stages: int

    def submit(self, batch: Batch) -> None: ...
    def next_result(self, timeout: float | None = None) -> Result: ...
    # Whether next_result() would return (or raise) without waiting.
    def has_result(self) -> bool: ...
    def prune(self, nodes: Iterable[int], ops: Sequence[KvOp] = (), lap: int = 0) -> None: ...
    def kv(self, ops: Sequence[KvOp]) -> None: ...
    def abandon(self) -> None: ...
    def close(self) -> None: ...


# ------------------------------------------------------------------------- target picking

def pick_targets(logits: np.ndarray, pos: np.ndarray, sampling: Sampling) -> np.ndarray:
    """Target token after each logits row: argmax, or a seeded draw from the target's
    distribution (temperature / top-k / top-p).

    The draw for the token at sequence position p uses the C++ core's ``uniform(seed, p)``, so a
    sampled generation is the same whatever tree or mode produced it, and each accepted token is
    an exact draw from the target's conditional (SpecExec / FlowSpec verification).
    """
    from edgespec import core

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
        t_prev, cpu_prev = now(), time.thread_time()
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
                t, cpu = now(), time.thread_time()
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


class LocalChain:
    """All stages in this process. Batches are computed lazily, when their result is asked
    for, so FlowSpec pruning still catches rows "in flight" exactly as on a real ring."""

    def __init__(self, runtimes: Sequence, n_vocab: int) -> None:
        self.worker = StageWorker(runtimes, is_last=True)
        self.worker.stamp_windows = True
        self.n_vocab = n_vocab
        self.n_stages = len(runtimes)
        self._queue: collections.deque[Batch | list[KvOp]] = collections.deque()

    def submit(self, batch: Batch) -> None:
        self._queue.append(batch)

    def kv(self, ops: Sequence[KvOp]) -> None:
        self._queue.append(list(ops))

    def prune(self, nodes: Iterable[int], ops: Sequence[KvOp] = (), lap: int = 0) -> None:
        self.worker.prune(lap, nodes, ops)

    def next_result(self, timeout: float | None = None) -> Result:
        while self._queue:
            item = self._queue.popleft()
            if isinstance(item, list):
                self.worker.apply_ops(item)
                continue
            try:
                batch, targets = self.worker.run(item, None)
            except Exception as e:
                raise StageFailure(f"stage failed: {type(e).__name__}: {e}", "stage_failed",
                                   item.lap) from e
            wanted = batch.nodes[batch.want] if len(batch) else np.zeros(0, np.int32)
            if targets is None:
                targets = np.zeros(0, dtype=np.int32)
            return Result(item.lap, item.segment, wanted, targets, batch.timing, now())
        raise RuntimeError("next_result() with nothing submitted")

    def has_result(self) -> bool:
        return False  # nothing is computed before it is asked for (see the class docstring)

    def abandon(self) -> None:
        self._queue.clear()

    def close(self) -> None:
        self._queue.clear()
