"""The draft model's llama.cpp context: one per drafter, or one shared by a ring's slots.

A ring with ``S`` slots drafts for up to ``S`` requests at once (docs/design.md 5.8). With a
context per slot, each drafter runs its own ``llama_decode`` calls and the draft model's
weights are read once per call; on a host with fewer cores than busy slots that reading is
most of the cost. A ``DraftContext`` shared by the slots instead takes the rows of every
slot that is decoding at that moment in one call (flat combining: whoever finds the context
idle decodes everything queued, its own rows and the others'; nobody waits for company, so a
request alone decodes exactly as before). The saving: docs/experiments.md 8.

Seq ids are partitioned as the stages' are (``edgespec.seqs``: slot ``i`` owns
``[i*W, (i+1)*W)``, ``W = 256 // S``), through its ``DraftSeqs`` view, which maps the drafter's
local ids (0: committed text, 1..W-1: tree sequences) onto them. A view never touches another
slot's sequences: "keep only sequence 0" becomes a removal of the view's own tree sequences.
Between requests a view parks its committed cells in host memory (``KvParking``), so an idle
slot's conversation costs the busy slots' attention nothing and its next turn still reuses it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgespec.llm import capi
from edgespec.llm.kv_park import KvParking
from edgespec.llm.llamacpp import Closing, new_context
from edgespec.llm.shared_model import acquire_model, release_model
from edgespec.seqs import N_SEQ, SeqRange, slot_width

__all__ = ["DraftContext", "DraftSeqs"]

#: llama.cpp's compile-time limit on sequence ids per context.

Row = tuple[int, int, int, bool]  # (token, pos, seq, wants logits)
Copy = tuple[int, int, int, int]  # seq_cp(src, dst, p0, p1)


@dataclass(eq=False)
class _Call:
    """One view's ``decode`` waiting for (or riding in) a combined batch."""

    rows: list[Row]  # seq ids already mapped onto the context
    copies: list[Copy]  # applied just before the batch (they give its rows their paths)
    logits: np.ndarray | None = None
    error: BaseException | None = None
    done: bool = False
    n_out: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_out = sum(1 for r in self.rows if r[3])


class DraftContext(Closing):
    """One llama.cpp context of the draft model at ``model_path`` for ``parallel`` drafters
    (views), each with ``width`` sequences (at most ``256 // parallel``).

    ``n_ctx`` cells in all (kv_unified: the views' sequences share them), ``n_batch`` rows at
    most per ``llama_decode``; every view's own calls must fit ``n_batch`` (the drafter splits
    longer ones). The weights are loaded once per process (``edgespec.llm.shared_model``).
    The context closes with its last view (or with ``close()``)."""

    def __init__(self, model_path: str | os.PathLike[str], *, parallel: int = 1,
                 width: int | None = None, n_ctx: int = 4096, n_batch: int = 512,
                 n_threads: int = 1) -> None:
        super().__init__()
        self._ctx = None
        self._batch: capi.llama_batch | None = None
        self._cond = threading.Condition()
        self._busy = False  # a decode or a KV operation runs on the context
        self._parking = KvParking()
        self.parallel = parallel
        self.width = min(width or N_SEQ, slot_width(parallel))
        if self.width < 2:
            raise ValueError("a draft view needs 2 sequences at least")
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self.model = acquire_model(model_path)
        try:
            self.n_vocab = self.model.n_vocab
            n_seq = self.width * parallel
            # llama.cpp aborts (an assertion on its output buffer) when a context has fewer
            # cells than sequences.
            self._ctx = new_context(self.model, n_ctx=max(n_ctx, n_seq), n_batch=n_batch,
                                    n_seq_max=n_seq, kv_unified=True, n_threads=n_threads)
            self.mem = self._ctx.memory
            self.n_ctx = self._ctx.n_ctx  # llama.cpp may round it up
            self._batch = capi.llama_batch_init(n_batch, 0, 1)
        except BaseException:
            self.close()
            raise
        self._queue: list[_Call] = []
        self._views = 0  # open views: the last one to close closes the context
        self.n_combined = 0  # decode calls that carried more than one view's rows

    @property
    def closed(self) -> bool:
        return self._ctx is None

    def parked_bytes(self) -> int:
        """Bytes of committed text that idle views keep in host memory."""
        with self._cond:
            return self._parking.nbytes()

    def view(self, index: int) -> DraftSeqs:
        """The sequences of drafter ``index`` (0 <= index < parallel); close it when done."""
        if not 0 <= index < self.parallel:
            raise ValueError(f"view {index} outside 0..{self.parallel - 1}")
        with self._cond:
            self._views += 1
        return DraftSeqs(self, index)

    def _release(self) -> None:
        with self._cond:
            self._views -= 1
            last = self._views <= 0
        if last:
            self.close()

    def close(self) -> None:
        """Free the batch and the context, and give the model back (idempotent)."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            if self._batch is not None:
                capi.llama_batch_free(self._batch)
                self._batch = None
            if self._ctx is not None:
                self._ctx.close()
                self._ctx = None
            self._parking.clear()
            model, self.model = getattr(self, "model", None), None
        if model is not None:
            release_model(model)

    # -- one llama.cpp call at a time -------------------------------------------------------

    def exclusive(self):
        """The context to itself for a KV operation (no decode runs meanwhile)."""
        return _Exclusive(self)

    def decode(self, rows: list[Row], copies: Sequence[Copy] = ()) -> np.ndarray:
        """Decode ``rows`` (context seq ids), in one batch with whatever other views queued
        meanwhile, after the sequence ``copies`` (queued with them, so a view adding tree
        sequences waits for no other view's decode); returns the logits of the rows that
        want them, in order."""
        if not rows or len(rows) > self.n_batch:
            raise ValueError(f"a decode takes 1..{self.n_batch} rows, got {len(rows)}")
        call = _Call(rows, list(copies))
        with self._cond:
            self._queue.append(call)
            while True:
                if call.done:
                    break
                if self._busy:
                    self._cond.wait()
                    continue
                # The context is idle: decode what is queued (this call is among it).
                self._busy = True
                take, n = [], 0
                while self._queue and n + len(self._queue[0].rows) <= self.n_batch:
                    n += len(self._queue[0].rows)
                    take.append(self._queue.pop(0))
                self._cond.release()
                try:
                    self._run(take)
                finally:
                    self._cond.acquire()
                    for c in take:  # interrupted (KeyboardInterrupt): nobody waits forever
                        if not c.done:
                            c.error, c.done = RuntimeError("draft decode interrupted"), True
                    self._busy = False
                    self._cond.notify_all()
        if call.error is not None:
            raise call.error
        assert call.logits is not None
        return call.logits

    def _run(self, calls: list[_Call]) -> None:
        """The calls' copies, then one ``llama_decode`` for them all; a batch of several that
        fails is retried call by call, so only a call that cannot fit fails."""
        if self._ctx is not None:
            for c in calls:
                for src, dst, p0, p1 in c.copies:
                    capi.llama_memory_seq_cp(self.mem, src, dst, p0, p1)
                c.copies = []
        self._decode_calls(calls)

    def _decode_calls(self, calls: list[_Call]) -> None:
        try:
            logits = self._decode_rows([r for c in calls for r in c.rows])
        except Exception as e:
            if len(calls) == 1:
                calls[0].error, calls[0].done = e, True
                return
            for c in calls:
                self._decode_calls([c])
            return
        if len(calls) > 1:
            self.n_combined += 1
        at = 0
        for c in calls:
            c.logits, c.done = logits[at:at + c.n_out], True
            at += c.n_out

    def _decode_rows(self, rows: Sequence[Row]) -> np.ndarray:
        batch = self._batch
        if batch is None or self._ctx is None:
            raise RuntimeError("the draft model's context was closed")
        for i, (tok, pos, seq, out) in enumerate(rows):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = out
        batch.n_tokens = len(rows)
        rc = capi.llama_decode(self._ctx.ptr, batch)
        if rc == 1:
            raise RuntimeError(f"draft context full (n_ctx {self.n_ctx}): no KV slot for "
                               f"{len(rows)} tokens")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} on the draft model")
        n_out = sum(1 for r in rows if r[3])
        ptr = capi.llama_get_logits(self._ctx.ptr)
        return np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab)).copy()


class _Exclusive:
    """``with ctx.exclusive():`` waits until no decode runs and keeps the context to itself
    meanwhile; decodes that come in wait, queued, and go in one batch afterwards."""

    def __init__(self, owner: DraftContext) -> None:
        self.owner = owner

    def __enter__(self) -> DraftContext:
        o = self.owner
        with o._cond:
            while o._busy:
                o._cond.wait()
            if o._ctx is None:
                raise RuntimeError("the draft model's context was closed")
            o._busy = True
        return o

    def __exit__(self, *exc: object) -> None:
        o = self.owner
        with o._cond:
            o._busy = False
            o._cond.notify_all()


class DraftSeqs:
    """One drafter's sequences on a ``DraftContext``: local seq ``s`` is ``base + s``."""

    def __init__(self, ctx: DraftContext, index: int) -> None:
        self.ctx = ctx
        self.index = index
        self.seqs = SeqRange(index, ctx.width)
        self.width, self.base = ctx.width, self.seqs.base
        self.sole = ctx.parallel == 1  # the whole context is this view's
        self._open = True

    def close(self) -> None:
        """This drafter is done with the context (idempotent)."""
        if self._open:
            self._open = False
            self.ctx._release()

    def decode(self, rows: Sequence[Row], copies: Sequence[Copy] = ()) -> np.ndarray:
        """Logits of ``rows`` (local seq ids) that want them, decoded after ``copies``."""
        b = self.base
        return self.ctx.decode([(t, p, b + s, o) for t, p, s, o in rows],
                               [(b + src, b + dst, p0, p1) for src, dst, p0, p1 in copies])

    def rm(self, seq: int, p0: int, p1: int) -> None:
        with self.ctx.exclusive() as c:
            capi.llama_memory_seq_rm(c.mem, self.base + seq, p0, p1)

    def cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        with self.ctx.exclusive() as c:
            capi.llama_memory_seq_cp(c.mem, self.base + src, self.base + dst, p0, p1)

    def pos_max(self, seq: int) -> int:
        with self.ctx.exclusive() as c:
            return int(capi.llama_memory_seq_pos_max(c.mem, self.base + seq))

    def keep_committed(self, used: Iterable[int]) -> None:
        """Drop every tree sequence (``used``: the local ids that may hold cells)."""
        with self.ctx.exclusive() as c:
            if self.sole:
                capi.llama_memory_seq_keep(c.mem, 0)
                return
            for s in used:
                capi.llama_memory_seq_rm(c.mem, self.base + s, -1, -1)

    def park(self) -> bool:
        """Move the committed cells into host memory (a shared context only: alone, nobody
        else's attention pays for them). True when something was parked."""
        if self.sole:
            return False
        with self.ctx.exclusive() as c:
            return c._parking.park(c._ctx.ptr, c.mem, self.base) > 0

    def restore(self) -> None:
        """Put parked committed cells back (nothing when none are parked). Raises
        ``MemoryError`` when the context has no room; the committed sequence is then empty."""
        if self.sole:
            return
        with self.ctx.exclusive() as c:
            c._parking.restore(c._ctx.ptr, c.mem, self.base)
