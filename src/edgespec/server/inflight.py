"""The cancel events of every admitted request (``Inflight``), so a shutdown can stop them all.
Admission itself is the head's scheduler's (``edgespec.head.scheduler``)."""

from __future__ import annotations

import threading


class Inflight:
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
