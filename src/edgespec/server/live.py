"""The web page's live view: tree events from the engine while a page follows, generation
records, ring snapshots (``Ring.describe``, the one view of the ring: docs/design.md 5.3) with
per-stage compute times, and the server-sent events that carry them."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from edgespec.api import Ring
from edgespec.server.inflight import Inflight


class _Live:
    """What the web page's live view shows: tree events from the engine (only while a page
    is subscribed: with none, the engine has no listener and builds no event), a record per
    finished generation, and ring snapshots (``Ring.describe``) with per-stage compute
    times derived from two successive snapshots."""

    #: How often a subscriber is sent the tree events gathered meanwhile, and at most how
    #: many per flush (the page draws the latest step only).
    FLUSH_S = 0.5
    MAX_EVENTS = 400
    #: Ring snapshots (one health round trip per node) at most this often, for all pages.
    SNAPSHOT_S = 3.0
    #: Pages following the live view at once (each holds a connection).
    MAX_VIEWERS = 8

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self._lock = threading.Lock()
        self._events: collections.deque[tuple[int, dict]] = collections.deque(maxlen=4096)
        self._seq = 0
        self._subscribers = 0
        self._reserved: dict[int, float] = {}  # viewer places taken, stream not yet started
        self._next_ticket = 0
        self.history: collections.deque[dict] = collections.deque(maxlen=500)
        self._snap: dict | None = None
        self._snap_at = 0.0
        self._snap_lock = threading.Lock()
        self._prev: dict[int, tuple[float, int, float]] = {}  # stage -> (time, batches, busy)
        self._texts: dict[int, str] = {}

    def _on_event(self, event: dict) -> None:
        """Engine thread: O(1), no formatting (that happens on the way to the page)."""
        with self._lock:
            self._seq += 1
            self._events.append((self._seq, event))

    #: Seconds a place taken by ``reserve`` is kept for a stream that never starts.
    RESERVE_S = 10.0

    def reserve(self) -> int | None:
        """Take a viewer's place before its stream starts (None: ``MAX_VIEWERS`` follow
        already). Places taken and not yet used count, so a burst of pages cannot all pass
        the check before any of them subscribes; one whose stream never starts lapses."""
        with self._lock:
            now = time.monotonic()
            self._reserved = {t: at for t, at in self._reserved.items()
                              if now - at < self.RESERVE_S}
            if self._subscribers + len(self._reserved) >= self.MAX_VIEWERS:
                return None
            self._next_ticket += 1
            self._reserved[self._next_ticket] = now
            return self._next_ticket

    def invalidate(self) -> None:
        """The ring changed on purpose: the next snapshot probes anew."""
        with self._snap_lock:
            self._snap_at = 0.0

    def subscribe(self, ticket: int | None = None) -> int:
        with self._lock:
            if ticket is not None:
                self._reserved.pop(ticket, None)
            self._subscribers += 1
            if self._subscribers == 1:
                self.ring.add_listener(self._on_event)
            return self._seq

    def unsubscribe(self) -> None:
        with self._lock:
            self._subscribers -= 1
            if self._subscribers == 0:
                self.ring.remove_listener(self._on_event)

    @property
    def subscribers(self) -> int:
        with self._lock:
            return self._subscribers

    def since(self, seq: int) -> tuple[int, list[dict]]:
        """Events after ``seq`` (newest last). Scans from the newest end only, so the
        engine thread never waits on a long copy."""
        out: list[dict] = []
        with self._lock:
            for s, e in reversed(self._events):
                if s <= seq:
                    break
                out.append(e)
            last = self._seq
        out.reverse()
        return last, out

    def add_generation(self, record: dict) -> None:
        self.history.append(record)
        self._on_event({"e": "gen", **record})

    def text(self, token: int) -> str:
        t = self._texts.get(token)
        if t is None:
            t = self.ring.tokenizer.piece(token, special=True).decode("utf-8", "replace")
            if len(self._texts) < 200_000:
                self._texts[token] = t
        return t

    def readable(self, events: list[dict]) -> list[dict]:
        """Tree events with token texts added, the latest ``MAX_EVENTS`` only."""
        out = []
        for ev in events[-self.MAX_EVENTS:]:
            ev = dict(ev)
            if ev["e"] == "rows":
                ev["rows"] = [[n, p, t, self.text(t)] for n, p, t in ev["rows"]]
            elif ev["e"] == "decide":
                ev["bonus_text"] = self.text(ev["bonus"])
            elif ev["e"] == "plain":
                ev["text"], ev["root_text"] = self.text(ev["token"]), self.text(ev["root"])
            out.append(ev)
        return out

    def snapshot(self, max_age: float = SNAPSHOT_S) -> dict:
        """``Ring.describe()`` plus live per-stage compute time per batch (blocking: call
        from a worker thread), reused for ``max_age`` seconds."""
        with self._snap_lock:
            now = time.monotonic()
            if self._snap is not None and now - self._snap_at < max_age:
                return self._snap
            try:
                snap = self.ring.describe()
            except Exception as exc:  # the page must show a broken ring, not fail with it
                snap = {"status": "down", "message": f"the ring cannot be reached: {exc}",
                        "hint": "restart `edgespec serve` (or `edgespec ring up`)",
                        "stages": [], "model": self.ring.model_name}
            for st in snap.get("stages", []):
                st["ms_per_batch"] = None
                if st.get("batches") is None:
                    continue
                prev = self._prev.get(st["stage"])
                if prev is not None and st["batches"] > prev[1]:
                    st["ms_per_batch"] = round(
                        (st["busy_s"] - prev[2]) * 1e3 / (st["batches"] - prev[1]), 2)
                elif prev is not None and self._snap is not None:
                    old = next((o for o in self._snap.get("stages", [])
                                if o["stage"] == st["stage"]), None)
                    st["ms_per_batch"] = old and old.get("ms_per_batch")  # idle: keep last
                if prev is None or st["batches"] != prev[1]:
                    self._prev[st["stage"]] = (now, st["batches"], st["busy_s"])
            self._snap, self._snap_at = snap, now
            return snap


#: The page served at ``/`` to a browser without the key when ``--api-key`` is set: it asks
#: for the key and keeps it in a same-site cookie, which the page's requests then carry.

async def live_events(request: Request, live: _Live, inflight: Inflight,
                      ring_json: Callable[[], dict[str, Any]], ticket: int | None = None,
                      ) -> AsyncIterator[bytes]:
    """The page's server-sent events (``GET /v1/ring/events``): ``ring`` snapshots, batched
    ``tree`` events and ``gen`` records, until the client leaves or the server stops."""
    def sse(event: str, payload: Any) -> bytes:
        return f"event: {event}\ndata: {json.dumps(payload)}\n\n".encode()

    seq = live.subscribe(ticket)
    try:
        yield sse("ring", await asyncio.to_thread(ring_json))
        next_ring = time.monotonic() + live.SNAPSHOT_S
        while not inflight.closing:
            await asyncio.sleep(live.FLUSH_S)
            if await request.is_disconnected():
                break
            seq, events = live.since(seq)
            tree = [e for e in events if e["e"] != "gen"]
            if tree:
                yield sse("tree", live.readable(tree))
            for e in events:
                if e["e"] == "gen":
                    yield sse("gen", {k: v for k, v in e.items() if k != "e"})
            if time.monotonic() >= next_ring:
                next_ring = time.monotonic() + live.SNAPSHOT_S
                snap = await asyncio.to_thread(ring_json)
                snap.pop("history")  # the page keeps its own from the gen events
                yield sse("ring", snap)
    finally:
        live.unsubscribe()
