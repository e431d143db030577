"""Admission: up to ``parallel`` requests on the ring at once (one per slot of the ring,
``Ring.parallel``), the rest in arrival order behind a bounded queue (``_Gate``), and the
cancel events of every admitted request (``_Inflight``)."""

from __future__ import annotations

import threading


class _Gate:
    """A bounded first-come-first-served gate for one ring: up to ``parallel`` requests
    inside (the ring's slots; 1 = one request at a time), up to ``max_queue`` waiting behind
    them, admitted in ticket order. A waiting request that is cancelled withdraws its ticket
    at once, so it holds neither a slot nor a place in the queue."""

    #: How often a waiting request looks at its cancel event.
    CANCEL_POLL_S = 0.1

    def __init__(self, max_queue: int, parallel: int = 1) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        if parallel < 1:
            raise ValueError("parallel must be >= 1")
        self.max_queue = max_queue
        self.parallel = parallel
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._next_in = 0  # the lowest ticket not yet admitted nor withdrawn
        self._withdrawn: set[int] = set()  # waiting tickets whose requests were cancelled
        self._inside = 0  # requests admitted and not yet left
        self._admitted = 0  # tickets handed out and not yet left or withdrawn

    def try_enter(self) -> int | None:
        """A ticket, or None when ``max_queue`` requests already wait behind full slots."""
        with self._cond:
            if self._admitted >= self.parallel + self.max_queue:
                return None
            self._admitted += 1
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def _skip_withdrawn(self) -> None:
        while self._next_in in self._withdrawn:
            self._withdrawn.discard(self._next_in)
            self._next_in += 1

    def wait_turn(self, ticket: int, cancel: threading.Event | None = None) -> bool:
        """Wait until ``ticket`` is admitted (True: call ``leave`` when done). With
        ``cancel``: False as soon as it is set while still waiting; the ticket is then
        withdrawn (no ``leave``)."""
        with self._cond:
            while not (self._next_in == ticket and self._inside < self.parallel):
                if cancel is not None and cancel.is_set():
                    self._withdrawn.add(ticket)
                    self._admitted -= 1
                    self._skip_withdrawn()
                    self._cond.notify_all()
                    return False
                self._cond.wait(self.CANCEL_POLL_S if cancel is not None else None)
            self._next_in += 1
            self._skip_withdrawn()
            self._inside += 1
            self._cond.notify_all()  # the next ticket may fit in a free slot too
            return True

    def leave(self) -> None:
        """Free the slot of an admitted request (once per ticket whose turn came)."""
        with self._cond:
            self._inside -= 1
            self._admitted -= 1
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is served or queued; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._admitted == 0, timeout)

    def state(self) -> dict[str, int]:
        """``serving``: requests holding a slot (at most ``parallel``); ``queued``: those
        waiting behind them."""
        with self._cond:
            return {"serving": min(self._admitted, self.parallel),
                    "queued": max(self._admitted - self.parallel, 0), "max_queue": self.max_queue}

class _Inflight:
    """The cancel events of every admitted request, so a shutdown can stop them all."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: set[threading.Event] = set()
        self.closing = False

    def add(self, ev: threading.Event) -> bool:
        with self._lock:
            if self.closing:
                return False
            self._events.add(ev)
            return True

    def discard(self, ev: threading.Event) -> None:
        with self._lock:
            self._events.discard(ev)

    def close(self) -> None:
        """Stop every admitted generation at its next step and refuse new ones."""
        with self._lock:
            self.closing = True
            events = list(self._events)
        for ev in events:
            ev.set()
