"""The head's scheduler (docs/design.md 5.8): the one place that decides which requests are
on the ring. Every way in (the HTTP server, the chat CLI, Python's ``Ring``) only submits and
receives through it.

- **Admission**: one FIFO queue for the whole head. ``admit`` hands out a ``Ticket`` at once or
  refuses with ``RingBusy`` when ``max_queue`` requests already wait behind full slots (the
  server answers 429 before anything starts); ``acquire`` waits for the ticket's turn, and a
  request cancelled while it waits withdraws without ever reaching the ring.
- **Slot choice**: the free slot whose committed history shares the longest prefix with the
  prompt (a conversation's next turn computes only its new tokens), else the least recently
  used free one (``edgespec.head.slots``: a slot's seq ids, its view of the chain).
- **Each step's share**: a request's engine asks ``sharers`` (the requests decoding now) before
  every step; tree sizes, flow's lookahead and prefill chunks shrink with it (``TreePolicy``,
  ``SpecEngine._prefill``), and a node merges the batches of different requests that meet in
  its queue into one decode (docs/design.md 5.7).
- **Recovery**: after a lost node the ring is rebuilt once, by the first request to ask,
  with retries and backoff (``recover``); every other request finds it rebuilt and moves
  onto it. A rebalance (``rebuild``) takes every slot first, so requests in flight finish.

Each admitted request runs its engine in its caller's thread: the ring's compute happens on
the nodes, so a head thread spends a step waiting for its lap, and S such threads keep S
requests' batches interleaved around the ring.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
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
        self.state = "waiting"  # -> "serving" -> "done", or "withdrawn"

    def withdraw(self) -> None:
        """Give the place up (a request that will not run after all); no-op once served."""
        self._scheduler._withdraw(self)


class Scheduler:
    """S slots over one chain: admission, slot choice, each step's sharers, recovery."""

    #: How often a waiting request looks at its cancel event.
    CANCEL_POLL_S = 0.1

    def __init__(self, chain: Chain, make_engine: Callable[[Chain, int], Any],
                 make_session: Callable[[Chain, Any, Callable | None], Any], *,
                 parallel: int = 1, max_queue: int | None = None,
                 recover: Callable[[Exception], Chain] | None = None) -> None:
        self.parallel = parallel
        self.width = slot_width(parallel, getattr(chain, "n_seq_max", N_SEQ))
        self.max_queue: int | None = None
        self.set_max_queue(max_queue)
        self.chain = chain
        self._recover = recover
        self.epoch = 0
        self.recovery_log: list[dict[str, Any]] = []
        self._rebuilding = 0
        self._recover_lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: list[Ticket] = []  # admitted, not yet serving, in arrival order
        self._serving = 0
        self._numbers = 0
        self.slots: list[Slot] = []
        # parallel=1: the engine drives the chain itself (no seq-id mapping, no demux).
        self.demux = Demux(chain) if parallel > 1 else None
        for i in range(parallel):
            view: Chain = chain if self.demux is None else SlotChain(self.demux, i, self.width)
            engine = make_engine(view, i)
            if self.demux is not None:
                engine.sharers = self.busy  # trees and prefill chunks shrink as slots fill
                # Lap ids of different slots never meet (the demux routes by lap, stages
                # prune by lap): each slot draws from its own part of the lap space.
                engine.use_laps(i, parallel)
            session = make_session(view, engine, (lambda exc, i=i: self.recover(
                self.slots[i], exc)) if recover is not None else None)
            self.slots.append(Slot(i, engine, session))

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

    def _choose(self, prompt: Sequence[int]) -> Slot | None:
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

    @contextlib.contextmanager
    def acquire(self, prompt: Sequence[int], ticket: Ticket | None = None, *,
                index: int | None = None, cancel: threading.Event | None = None
                ) -> Iterator[Slot | None]:
        """A slot for the request of ``ticket`` (admitted now when None) on ``prompt`` (or
        the slot ``index``: a request for a given slot always waits), held for the block.
        Waits for the ticket's turn in FIFO order; yields None instead when ``cancel`` is
        set while it waits (the ticket is withdrawn)."""
        if ticket is None:
            if index is None:
                ticket = self.admit()
            else:
                with self._cond:
                    ticket = self._enqueue()
        slot: Slot | None = None
        with self._cond:
            if ticket.state != "waiting":
                raise RuntimeError(f"ticket {ticket.number} was {ticket.state}: admit again")
            while True:
                if cancel is not None and cancel.is_set():
                    ticket.state = "withdrawn"
                    self._queue.remove(ticket)
                    self._cond.notify_all()
                    break
                if self._queue[0] is ticket:
                    if index is not None:
                        slot = None if self.slots[index].busy else self.slots[index]
                    else:
                        slot = self._choose(prompt)
                    if slot is not None:
                        break
                self._cond.wait(self.CANCEL_POLL_S if cancel is not None else None)
            if slot is not None:
                self._queue.pop(0)
                ticket.state = "serving"
                self._serving += 1
                slot.busy = True
                self._cond.notify_all()  # the next ticket may fit in another free slot
        if slot is None:
            yield None
            return
        try:
            self._refresh(slot)
            yield slot
        finally:
            self._park(slot)
            with self._cond:
                slot.busy = False
                slot.last_used = time.monotonic()
                ticket.state = "done"
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

    def _refresh(self, slot: Slot) -> None:
        """A slot that slept through a ring rebuild moves onto the new chain."""
        with self._recover_lock:
            if slot.epoch != self.epoch:
                slot.epoch = self.epoch
                view = self._view(slot)
                slot.session.chain = view
                slot.engine.replace_chain(view)
            elif self.demux is not None:
                slot.session.chain.forget_done()

    def _view(self, slot: Slot) -> Chain:
        return self.chain if self.demux is None else SlotChain(self.demux, slot.index,
                                                                 self.width)

    def _park(self, slot: Slot) -> None:
        """A slot's request ended: park its conversation's cells (``SlotChain.park``), and
        its drafter's (``Drafter.idle``)."""
        if self.demux is None:
            return
        drafter = getattr(slot.engine, "drafter", None)
        if drafter is not None:
            try:
                drafter.idle()
            except Exception as e:  # only speed is at stake: the next begin() recomputes
                log.warning("slot %d: drafter not parked: %s", slot.index, e)
        if slot.epoch != self.epoch or not slot.engine.history:
            return
        try:
            slot.session.chain.park()
        except NodeLost as e:  # its next request finds the ring lost and recovers
            log.debug("slot %d: not parked: %s", slot.index, e)

    # ------------------------------------------------------------ recovery

    @property
    def recovering(self) -> bool:
        """True while the ring is being rebuilt after a lost node."""
        return self._rebuilding > 0

    def recover(self, slot: Slot, exc: Exception) -> Chain:
        """The chain ``slot`` goes on with after ``exc`` (a lost node). The first request to
        ask rebuilds the ring over the nodes that answer (the ``recover`` callback), at most
        MAX_RECOVERIES times in a row with doubling backoff while none answers yet, then
        ``RingError``; the others find it rebuilt and move onto it."""
        assert self._recover is not None
        with self._recover_lock:
            if slot.epoch == self.epoch:
                self._rebuild_after(exc)
            slot.epoch = self.epoch
            return self._view(slot)

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
        """``chain`` is the ring from now on; each slot moves onto it at its next request
        (``_refresh``) or recovery."""
        self.chain = chain
        if self.demux is not None:
            self.demux = Demux(chain)
        self.epoch += 1

    def rebuild(self, make_chain: Callable[[], Chain]) -> Chain:
        """Replace the ring on purpose (a rebalance): every slot is taken first, so requests
        in flight finish and new ones wait; then the old chain is closed and ``make_chain``
        forms the new one, which every slot moves onto. The slots' conversations start anew
        on it (their KV lived on the old windows)."""
        with contextlib.ExitStack() as held:
            for i in range(self.parallel):
                held.enter_context(self.acquire((), index=i))
            with self._recover_lock:
                with contextlib.suppress(Exception):
                    self.chain.close()
                chain = make_chain()
                self._install(chain)
        return chain

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.chain.close()
