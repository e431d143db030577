"""Admission: one request on the ring at a time, in arrival order, behind a bounded queue
(``_Gate``), and the cancel events of every admitted request (``_Inflight``)."""

from __future__ import annotations

import threading


class _Gate:
    """A bounded first-come-first-served gate for the single ring: one request inside, up to
    ``max_queue`` waiting behind it, in ticket order."""

    def __init__(self, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._next_ticket = 0
        self._serving = 0  # the ticket whose turn it is
        self._admitted = 0  # tickets handed out and not yet left (serving + waiting)

    def try_enter(self) -> int | None:
        """A ticket, or None when ``max_queue`` requests already wait."""
        with self._cond:
            if self._admitted > self.max_queue:  # one is served, max_queue wait: full
                return None
            self._admitted += 1
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def wait_turn(self, ticket: int) -> None:
        with self._cond:
            while self._serving != ticket:
                self._cond.wait()

    def leave(self) -> None:
        """End the current turn (called exactly once per ticket, after its turn came)."""
        with self._cond:
            self._admitted -= 1
            self._serving += 1
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is served or queued; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._admitted == 0, timeout)

    def state(self) -> dict[str, int]:
        with self._cond:
            return {"serving": min(self._admitted, 1), "queued": max(self._admitted - 1, 0),
                    "max_queue": self.max_queue}

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
