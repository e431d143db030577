"""The engine's view of a ring of stages: batches go in at stage 0, target tokens come out.

A ``Chain`` hides where the stages run: ``LocalChain`` runs them in this process (tests, the
one-machine path); ``edgespec.head.remote.RemoteChain`` runs them on nodes over the network. Both obey
the same contract, which is what lets the speculative engine stay ignorant of sockets:

- ``submit(batch)``: enqueue a batch; it flows through every stage in submission order.
  ``batch.pre_ops`` (KV operations) are applied by every stage just before that batch, so a
  plan can never overtake the rows it depends on.
- ``next_result()``: the last stage's answer for the next batch, in submission order: for each
  wanted row, the target model's token there (argmax when greedy, a draw from the target
  distribution when sampling). Only token ids travel back, never distributions.
- ``prune(nodes, lap)``: FlowSpec pruning. It may overtake batches in flight: every stage
  drops rows of lap ``lap``'s pruned tree nodes from batches it has not computed yet. (The
  KV operations that free their seqs go with the next batch's ``pre_ops``, in ring order.)
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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgespec.batch import Batch, Result
from edgespec.errors import StageFailure
from edgespec.laps import now

# The one head -> node import (docs/design.md 7): LocalChain runs the node-side
# StageWorker in the head's own process.
from edgespec.node.worker import StageWorker
from edgespec.seqs import N_SEQ
from edgespec.tree.kvop import KvOp


class Chain(Protocol):
    """What the speculative engine needs from a ring (see the module docstring)."""

    n_vocab: int
    n_stages: int

    def submit(self, batch: Batch) -> None: ...
    def next_result(self, timeout: float | None = None) -> Result: ...
    # Whether next_result() would return (or raise) without waiting.
    def has_result(self) -> bool: ...
    def prune(self, nodes: Iterable[int], lap: int = 0) -> None: ...
    # KV operations, in order with the batches; ``release``: requests that ended, whose
    # samplers the last stage frees (``SamplerRef.key``).
    def kv(self, ops: Sequence[KvOp], release: Sequence[int] = ()) -> None: ...
    def abandon(self) -> None: ...
    def close(self) -> None: ...


class LocalChain:
    """All stages in this process. Batches are computed lazily, when their result is asked
    for, so FlowSpec pruning still catches rows "in flight" exactly as on a real ring.

    It runs the node-side ``StageWorker`` (``edgespec.node.worker``) in the head's process:
    the one import from head/ into node/ (docs/design.md 7)."""

    def __init__(self, runtimes: Sequence, n_vocab: int) -> None:
        self.worker = StageWorker(runtimes, is_last=True)
        self.worker.stamp_windows = True
        self.n_vocab = n_vocab
        self.n_stages = len(runtimes)
        self.n_seq_max = min(rt.n_seq_max for rt in runtimes)  # sequences every stage holds
        self._queue: collections.deque[Batch | tuple[list[KvOp], list[int]]] = collections.deque()

    def submit(self, batch: Batch) -> None:
        self._queue.append(batch)

    def kv(self, ops: Sequence[KvOp], release: Sequence[int] = ()) -> None:
        if release and not self._queue:  # a request's end: nothing behind it to wait for
            self.worker.apply_ops(ops)
            self.worker.release(release)
        else:
            self._queue.append((list(ops), list(release)))

    def prune(self, nodes: Iterable[int], lap: int = 0) -> None:
        self.worker.prune(lap, nodes, ())

    def next_result(self, timeout: float | None = None) -> Result:
        while self._queue:
            item = self._queue.popleft()
            if isinstance(item, tuple):
                ops, release = item
                self.worker.apply_ops(ops)
                self.worker.release(release)
                continue
            try:
                batch, targets = self.worker.run(item, None)
            except Exception as e:
                raise StageFailure(f"stage failed: {type(e).__name__}: {e}", "stage_failed",
                                   item.lap) from e
            wanted = batch.nodes[batch.want] if len(batch) else np.zeros(0, np.int32)
            if targets is None:
                targets = np.zeros(0, dtype=np.int32)
            return Result(item.lap, item.segment, wanted, targets, batch.timing, now(),
                          batch.scores)
        raise RuntimeError("next_result() with nothing submitted")

    def has_result(self) -> bool:
        return False  # nothing is computed before it is asked for (see the class docstring)

    def abandon(self) -> None:
        self._queue.clear()

    def close(self) -> None:
        self._queue.clear()


def open_window(model_path: Path, layers: tuple[int, int], fp: str, shard_dir: Path, *,
                n_ctx: int, n_threads: int | None) -> Any:
    """One window of the model for a ``LocalChain``: its shard cut (or found) under
    ``shard_dir``, loaded into a node-side ``StageRuntime`` in this process (the head -> node
    import this module is allowed, see ``LocalChain``)."""
    from edgespec.llm.shards import cut_window, shard_file_name
    from edgespec.node.runtime import StageRuntime

    a, b = layers
    path = cut_window(model_path, (a, b), shard_dir / shard_file_name(a, b, fp, model_path.stem))
    return StageRuntime(path, n_ctx=n_ctx, n_seq_max=N_SEQ, n_threads=n_threads)
