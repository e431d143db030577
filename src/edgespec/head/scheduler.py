"""The head's scheduler (docs/design.md 5.8): which requests are on the ring, in which slot.
The ring's loop (``edgespec.head.loop``) asks it; every way in (the HTTP server, the chat
CLI, Python's ``Ring``) only submits requests and reads their output.

- **Admission**: one FIFO queue for the whole head. ``admit`` hands out a ``Ticket`` at once or
  refuses with ``RingBusy`` when ``max_queue`` requests already wait behind full slots (the
  server answers 429 before anything starts); the loop starts the ticket at the head of the
  queue once a slot is free, and a request cancelled while it waits withdraws without ever
  reaching the ring.
- **Slot choice**: the free slot whose committed history shares the longest prefix with the
  prompt (a conversation's next turn computes only its new tokens), else the least recently
  used free one (``edgespec.head.slots``: a slot's seq ids, its view of the chain).
- **Each step's share**: a request's engine asks ``sharers`` (the requests decoding now) before
  every step; tree sizes, flow's lookahead and prefill chunks shrink with it (``TreePolicy``,
  ``SpecEngine._prefill``).
- **Recovery**: after a lost node the loop has the ring rebuilt once for all its requests,
  with retries and backoff (``recover``); a rebalance (``rebuild``) runs when no request does.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from edgespec.errors import NodeLost, RingBusy, RingError
from edgespec.head.chain import Chain
from edgespec.head.slots import Demux, Slot, SlotChain
from edgespec.seqs import N_SEQ, slot_width

log = logging.getLogger("edgespec.ring")

#: Ring rebuilds tried in a row after a lost node before giving up, and the first backoff.
MAX_RECOVERIES = 3
RECOVERY_BACKOFF_S = 0.5


class Ticket:
    """A request's place in the admission queue (``Scheduler.admit``)."""

    __slots__ = ("_scheduler", "number", "state")

    def __init__(self, scheduler: Scheduler, number: int) -> None:
        self._scheduler = scheduler
        self.number = number
        self.state = "waiting"  # -> "serving", or "withdrawn"

    def withdraw(self) -> None:
        """Give the place up (a request that will not run after all); no-op once served."""
        self._scheduler._withdraw(self)


class Scheduler:
    """S slots over one chain: admission, slot choice, each step's sharers, recovery. Its
    queue and counters are read from any thread; slots change on the ring's loop only."""

    def __init__(self, chain: Chain, make_engine: Callable[[Chain, int], Any], *,
                 parallel: int = 1, max_queue: int | None = None,
                 recover: Callable[[Exception], Chain] | None = None) -> None:
        self.parallel = parallel
        self.width = slot_width(parallel, getattr(chain, "n_seq_max", N_SEQ))
        self.max_queue: int | None = None
        self.set_max_queue(max_queue)
        self.chain = chain
        self._recover = recover
        self.recovery_log: list[dict[str, Any]] = []
        self._rebuilding = 0
        self._cond = threading.Condition()
        self._queue: list[Ticket] = []  # admitted, not yet serving, in arrival order
        self._serving = 0
        self._numbers = 0
        self.slots: list[Slot] = []
        self.demux = Demux(chain)
        for i in range(parallel):
            view = self._new_view(i)
            engine = make_engine(view, i)
            engine.sharers = self.busy  # trees and prefill chunks shrink as slots fill
            engine.streams = self.streaming  # a prompt beside answers goes in small chunks
            engine.demand = self.demand  # beside others a drafter reads when it first drafts
            # Lap ids of different slots never meet (the loop routes by lap, stages prune
            # by lap): each slot draws from its own part of the lap space.
            engine.use_laps(i, parallel)
            self.slots.append(Slot(i, engine, view))

    def _new_view(self, index: int) -> SlotChain:
        return SlotChain(self.demux, index, self.width, whole=self.parallel == 1)

    @property
    def can_recover(self) -> bool:
        return self._recover is not None

    def set_max_queue(self, max_queue: int | None) -> None:
        """Requests that may wait for a slot (None: any number)."""
        if max_queue is not None and (isinstance(max_queue, bool) or max_queue < 0):
            raise ValueError(f"max_queue must be >= 0 (or None: no limit), got {max_queue}")
        self.max_queue = max_queue

    # ------------------------------------------------------------ admission

    def admit(self) -> Ticket:
        """A place in the queue, or ``RingBusy`` at once when every slot is busy and
        ``max_queue`` requests wait already."""
        with self._cond:
            waiting = len(self._queue)
            if (self.max_queue is not None and self._serving + waiting
                    >= self.parallel + self.max_queue):
                raise RingBusy(f"all {self.parallel} slot(s) of the ring are busy and "
                               f"{waiting} request(s) wait already (max_queue "
                               f"{self.max_queue}): try again later")
            return self._enqueue()

    def _enqueue(self) -> Ticket:
        """A new ticket at the end of the queue (called holding ``_cond``)."""
        self._numbers += 1
        ticket = Ticket(self, self._numbers)
        self._queue.append(ticket)
        return ticket

    def _withdraw(self, ticket: Ticket) -> None:
        with self._cond:
            if ticket.state == "waiting":
                ticket.state = "withdrawn"
                self._queue.remove(ticket)
                self._cond.notify_all()

    def head_ticket(self) -> Ticket | None:
        """The ticket whose turn is next (the loop starts it once a slot is free)."""
        with self._cond:
            return self._queue[0] if self._queue else None

    def choose(self, prompt: Sequence[int]) -> Slot | None:
        """The free slot for ``prompt``: the longest shared prefix, else the least recently
        used; None when every slot is busy."""
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None

        def shared(s: Slot) -> int:
            h = s.engine.history
            n = min(len(h), len(prompt) - 1)
            k = 0
            while k < n and h[k] == prompt[k]:
                k += 1
            return k

        return max(free, key=lambda s: (shared(s), -s.last_used))

    def take(self, ticket: Ticket, slot: Slot) -> None:
        """``ticket``'s request runs in ``slot`` now."""
        with self._cond:
            self._queue.remove(ticket)
            ticket.state = "serving"
            self._serving += 1
            slot.busy = True
            self._cond.notify_all()

    def free(self, slot: Slot) -> None:
        """``slot``'s request is over and nothing of it is in flight any more."""
        with self._cond:
            if not slot.busy:
                return
            slot.busy = False
            slot.last_used = time.monotonic()
            self._serving -= 1
            self._cond.notify_all()

    def state(self) -> dict[str, Any]:
        """``serving``: requests holding a slot; ``queued``: those waiting behind them;
        ``max_queue`` (None: no limit)."""
        with self._cond:
            return {"serving": self._serving, "queued": len(self._queue),
                    "max_queue": self.max_queue}

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is served or queued; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._serving and not self._queue, timeout)

    def busy(self) -> int:
        """Requests decoding on the ring now (each request's engine asks before a step)."""
        with self._cond:
            return sum(s.busy for s in self.slots)

    def demand(self) -> int:
        """Requests running or waiting for a slot now (those that came at once start one
        by one, each while the others wait their turn)."""
        with self._cond:
            return self._serving + len(self._queue)

    def streaming(self) -> int:
        """Requests past their prefill now (their answers streaming): their rows per lap
        are what a prompt's chunks beside them may take (``SpecEngine._prefill``)."""
        return sum(1 for s in self.slots if s.busy and s.engine.req is not None
                   and s.engine.req.stats.tokens > 0)

    def view(self, slot: Slot) -> SlotChain:
        """A new view of the chain in force for ``slot`` (after a rebuild)."""
        return self._new_view(slot.index)

    def park(self, slot: Slot) -> None:
        """A slot's request ended: park its conversation's cells (``SlotChain.park``), and
        its drafter's (``Drafter.idle``)."""
        if self.parallel == 1:
            return
        drafter = getattr(slot.engine, "drafter", None)
        if drafter is not None:
            try:
                drafter.idle()
            except Exception as e:  # only speed is at stake: the next begin() recomputes
                log.warning("slot %d: drafter not parked: %s", slot.index, e)
        if not slot.engine.history:
            return
        try:
            slot.view.park()
        except NodeLost as e:  # its next request finds the ring lost and recovers
            log.debug("slot %d: not parked: %s", slot.index, e)

    # ------------------------------------------------------------ recovery

    @property
    def recovering(self) -> bool:
        """True while the ring is being rebuilt after a lost node."""
        return self._rebuilding > 0

    def recover(self, exc: Exception) -> None:
        """Rebuild the ring after ``exc`` (a lost node) over the nodes that answer (the
        ``recover`` callback), at most MAX_RECOVERIES times in a row with doubling backoff
        while none answers yet, then ``RingError``. The loop moves every slot onto it."""
        self._rebuild_after(exc)

    def _rebuild_after(self, exc: Exception) -> None:
        assert self._recover is not None
        t0 = time.perf_counter()
        log.warning("ring failure: %s; re-planning over the remaining nodes", exc)
        with contextlib.suppress(Exception):
            self.chain.close()
        self._rebuilding += 1
        try:
            last: Exception = exc
            for attempt in range(1, MAX_RECOVERIES + 1):
                try:
                    chain = self._recover(last)
                    break
                except NodeLost as e:  # another node went, or none answers yet: wait, retry
                    last = e
                    log.warning("recovery attempt %d/%d failed: %s", attempt, MAX_RECOVERIES,
                                e)
                    time.sleep(RECOVERY_BACKOFF_S * 2 ** (attempt - 1))
                except RingError as e:  # the survivors cannot hold the model, a busy node...
                    raise RingError(f"the ring lost a node ({exc}) and cannot be re-formed: "
                                    f"{e}") from e
            else:
                raise RingError(f"the ring lost a node and could not be re-formed after "
                                f"{MAX_RECOVERIES} attempts: {last}") from last
        finally:
            self._rebuilding -= 1
        self._install(chain)
        took = time.perf_counter() - t0
        self.recovery_log.append({"error": str(exc), "seconds": round(took, 3),
                                  "stages": chain.n_stages})
        log.warning("ring recovered in %.2f s with %d stage(s)", took, chain.n_stages)

    def _install(self, chain: Chain) -> None:
        """``chain`` is the ring from now on (the loop moves the slots onto it)."""
        self.chain = chain
        self.demux = Demux(chain)

    def rebuild(self, make_chain: Callable[[], Chain]) -> Chain:
        """Replace the ring on purpose (a rebalance), on the loop when no request runs: the
        old chain is closed and ``make_chain`` forms the new one. The slots' conversations
        start anew on it (their KV lived on the old windows)."""
        with contextlib.suppress(Exception):
            self.chain.close()
        chain = make_chain()
        self._install(chain)
        return chain

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.chain.close()
