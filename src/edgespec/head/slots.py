"""Slots: one ring serving ``S`` sequences at once (docs/design.md 3, "KV discipline",
holds per slot): a slot's range of seq ids, its view of the shared chain (``SlotChain``) and
who owns each lap in flight (``Demux``), so the ring's loop routes each result to its slot.

The nodes' contexts hold ``n_seq_max = 256`` llama.cpp sequences (``edgespec.head.formation``).
With ``parallel=S`` slot ``i`` owns the seq ids ``[i*W, (i+1)*W)``, ``W = 256 // S``: seq
``i*W`` is its committed history (the engine's "sequence 0"), the rest its tree seqs (its
trees have at most ``W - 1`` leaves). Each slot has its own engine (``SpecEngine``), written
for seq ids ``0..W-1`` as if it had the ring to itself; a ``SlotChain`` between the engine and
the shared chain

- shifts the seq ids of its batches and KV operations into the slot's range; "clear every
  sequence" and ``KEEP(s)`` become ``RM`` of the slot's own seqs (never another slot's);
- records each lap it sends as its own (``Demux.own``): the ring's loop (``edgespec.head.loop``),
  the one reader of the shared chain, hands each answer to the slot whose lap it is;
- ``abandon()`` gives up only its own laps (their answers are dropped on arrival);
- ``park()``: when a request ends, every stage moves the slot's committed cells into host
  memory (``edgespec.llm.kv_park``); its next batch or KV operation first puts them back. An
  idle slot's conversation then costs the busy slots' attention nothing (docs/design.md 5.8),
  and its next turn still computes only its new tokens.

``parallel=1``: the one slot's view passes seq ids and operations through unchanged
(``whole``), and never parks. Which request gets which slot, and the one rebuild of the ring
after a lost node, are the scheduler's (``edgespec.head.scheduler``).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgespec.batch import Batch, Result
from edgespec.errors import NodeLost
from edgespec.head.chain import Chain
from edgespec.seqs import SeqRange
from edgespec.tree.kvop import KvOp, KvOpCode

if TYPE_CHECKING:
    from edgespec.head.engine.runner import SpecEngine
from edgespec.wire.transport import TransportError

log = logging.getLogger("edgespec.ring")

#: Laps remembered per demux for routing (older ones are long answered).
OWNED_LAPS = 8192


class Demux:
    """One shared chain and the slot chains over it: which slot owns each lap in flight,
    and the laps given up, whose answers are dropped."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.owner: collections.OrderedDict[int, SlotChain] = collections.OrderedDict()
        # Laps given up by a slot (``SlotChain.abandon``): their answers, errors included,
        # are dropped on arrival, never raised in another slot.
        self.abandoned: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.slots: list[SlotChain] = []

    def own(self, lap: int, slot: SlotChain) -> None:
        self.owner[lap] = slot
        self.owner.move_to_end(lap)
        while len(self.owner) > OWNED_LAPS:
            self.owner.popitem(last=False)

    def route(self, item: Result | Exception) -> list[int] | None:
        """The slots ``item`` goes to (by index): its lap's owner; [] to drop it (an
        abandoned or unknown lap); None for an error of no lap (the loop's own, as a lost
        node is)."""
        lap = getattr(item, "lap", None)
        slot = self.owner.get(lap) if lap is not None else None
        if slot is not None:
            return [slot.index]
        if isinstance(item, Exception) and lap is None:
            return None
        log.debug("dropping an answer for lap %s: no slot waits for it", lap)
        return []


class SlotChain:
    """The ``Chain`` (``edgespec.head.chain``) one slot's engine drives: the shared chain,
    seen through the slot's range of seq ids (see the module docstring)."""

    def __init__(self, demux: Demux, index: int, width: int, whole: bool = False) -> None:
        self.demux = demux
        self.seqs = SeqRange(index, width)
        self.index, self.width, self.base = index, width, self.seqs.base
        self.whole = whole  # the only slot: seq ids and operations pass unchanged
        self._laps: set[int] = set()
        # Highest local seq that may hold KV: KEEP/clear remove only up to it. Unknown at
        # first (an earlier head may have left anything): the whole range.
        self._top = width - 1
        self.parked = False
        demux.slots.append(self)

    @property
    def n_vocab(self) -> int:
        return self.demux.chain.n_vocab

    @property
    def n_stages(self) -> int:
        return self.demux.chain.n_stages

    # ------------------------------------------------------------ seq ids

    def _rm_all(self, keep: int | None, p0: int = -1, p1: int = -1) -> list[KvOp]:
        return [KvOp(KvOpCode.RM, self.base + s, p0, p1)
                for s in range(self._top + 1) if s != keep]

    def _ops(self, ops: Iterable[KvOp]) -> list[KvOp]:
        if self.whole:
            return list(ops)
        out: list[KvOp] = []
        for op in ops:
            code, seq = op.code, op.seq
            if seq < 0:  # every sequence: every sequence of this slot
                if code == KvOpCode.RM:
                    out += self._rm_all(None, op.p0, op.p1)
                    continue
                raise ValueError(f"slot chain: {code.name} of every sequence is not "
                                 f"supported")
            self.seqs.check(seq)
            if code == KvOpCode.KEEP:
                out += self._rm_all(seq)
                self._top = seq
            elif code == KvOpCode.CP:
                self.seqs.check(op.arg)
                self._top = max(self._top, op.arg)
                out.append(KvOp(code, self.base + seq, op.p0, op.p1, self.base + op.arg))
            else:
                out.append(KvOp(code, self.base + seq, op.p0, op.p1, op.arg))
        return out

    def park(self) -> None:
        """Between requests (never for the only slot, ``whole``): every stage copies this slot's committed cells into its host
        memory and frees them, so they cost other slots' decodes nothing (docs/design.md
        5.8); the slot's next batch or KV operation first puts them back."""
        if self.parked or self.whole:
            return
        ops = [*self._rm_all(0), KvOp(KvOpCode.PARK, self.base)]
        try:
            self.demux.chain.kv(ops)
        except TransportError as e:
            raise NodeLost(f"the ring's chain is gone: {e}") from e
        self._top = 0
        self.parked = True

    def _unpark(self, ops: Sequence[KvOp]) -> list[KvOp]:
        """The RESTORE due before a parked slot's next ``ops`` (local seq ids). None when they
        begin by removing its committed sequence whole: the stages then drop the parked copy
        (a new conversation on this slot, or a reset)."""
        if not self.parked:
            return []
        self.parked = False
        first = ops[0] if ops else None
        if (first is not None and first.code == KvOpCode.RM and first.seq in (0, -1)
                and first.p0 <= 0 and first.p1 < 0):
            return []
        return [KvOp(KvOpCode.RESTORE, self.base)]

    # ------------------------------------------------------------ the Chain protocol

    def submit(self, batch: Batch) -> None:
        self._laps.add(batch.lap)
        self.demux.own(batch.lap, self)
        if self.whole:
            try:
                self.demux.chain.submit(batch)
            except TransportError as e:
                raise NodeLost(f"the ring's chain is gone: {e}") from e
            return
        sid = batch.seq_ids
        top = self.seqs.check(sid.max_id())
        self._top = max(self._top, top)
        moved = type(sid)._of(sid.ids + self.base, sid.counts) if self.base else sid
        out = Batch(batch.tokens, batch.pos, moved, batch.nodes, batch.want, batch.lap,
                    batch.segment, self._unpark(batch.pre_ops) + self._ops(batch.pre_ops),
                    batch.sampling, batch.timing)
        try:
            self.demux.chain.submit(out)
        except TransportError as e:  # another slot closed it for a rebuild, or it broke
            raise NodeLost(f"the ring's chain is gone: {e}") from e

    def kv(self, ops: Sequence[KvOp], release: Sequence[int] = ()) -> None:
        mapped = self._unpark(ops) + self._ops(ops) if ops or not release else []
        if mapped or release:
            try:
                self.demux.chain.kv(mapped, release)
            except TransportError as e:
                raise NodeLost(f"the ring's chain is gone: {e}") from e

    def prune(self, nodes: Iterable[int], lap: int = 0) -> None:
        if self.parked:  # prunes apply out of order: the cells come back first
            self.kv(())
        self.demux.chain.prune(nodes, lap=lap)

    def has_result(self) -> bool:
        return self.demux.chain.has_result()

    def next_result(self, timeout: float | None = None) -> Result:
        """The shared chain's next answer. The ring's loop reads the shared chain itself and
        routes; this is for an engine driven alone (``drive_alone``) while the loop is idle."""
        chain = self.demux.chain
        return chain.next_result() if timeout is None else chain.next_result(timeout)

    def abandon(self) -> None:
        """Give up on this slot's laps in flight: their answers are dropped on arrival."""
        d = self.demux
        for lap in self._laps:
            if d.owner.get(lap) is self:
                del d.owner[lap]
            d.abandoned[lap] = None
        while len(d.abandoned) > OWNED_LAPS:
            d.abandoned.popitem(last=False)
        self._laps.clear()

    def forget_done(self) -> None:
        """Between requests: nothing of this slot is in flight any more."""
        self._laps.clear()

    def close(self) -> None:
        self.abandon()  # the shared chain is the pool's to close


@dataclass
class Slot:
    """One of the ring's S concurrent sequences: its engine (the conversation's KV state),
    its view of the chain, the answers routed to it, and bookkeeping. The ring's loop alone
    touches it; ``info`` may be read from any thread."""

    index: int
    engine: SpecEngine
    view: SlotChain
    epoch: int = 0
    busy: bool = False
    last_used: float = 0.0
    prompt_tokens: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    requests: int = 0
    #: Answers routed to this slot, not yet read by its generation.
    inbox: collections.deque = field(default_factory=collections.deque)

    def info(self) -> dict[str, Any]:
        req = self.engine.req
        busy = self.busy
        tokens = req.stats.tokens if busy and req is not None else self.tokens
        speed = req.stats.tokens_per_s if busy and req is not None else self.tokens_per_s
        return {"slot": self.index, "state": "busy" if busy else "free", "tokens": tokens,
                "tokens_per_s": round(speed, 3), "prompt_tokens": self.prompt_tokens,
                "history_tokens": len(self.engine.history),
                "kv_parked": bool(self.view.parked)}
