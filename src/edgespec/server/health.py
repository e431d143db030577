"""What the server says about itself: the ring's condition for ``GET /health`` (``Monitor``)
and the Prometheus metrics for ``GET /metrics`` (``Metrics``), docs/design.md 5.9.

``/health`` must answer at once, also while nodes are dead (a probe of a dead node waits for
its timeout), so a background thread probes the ring every ``PROBE_S`` seconds through the
live view's snapshot (the one the page shows: one probe serves both) and ``/health`` reads the
last verdict:

- ``ok`` (200): every stage of the plan answers.
- ``degraded`` (200): the ring serves, but not as planned: a recovery is under way, a node
  does not answer and the next request re-plans over the others, or the ring runs on fewer
  stages than it had since a node was lost.
- ``down`` (503): no request can be served: no node answers, the lost nodes cannot be
  replaced, or another head took the ring over.

200/200/503 is what load balancers and uptime monitors expect: degraded still serves.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

#: How often the ring is probed for ``/health`` (and the page's ring view).
PROBE_S = 3.0


class Monitor:
    """The ring's condition, from a snapshot taken every ``PROBE_S`` seconds off the event
    loop (``snapshot``: the live view's ``Ring.describe`` with a cache)."""

    def __init__(self, ring: Any, snapshot: Callable[[float], dict],
                 interval: float = PROBE_S) -> None:
        self.ring = ring
        self._snapshot = snapshot
        self.interval = interval
        self._lock = threading.Lock()
        self._verdict: tuple[str, str | None] = ("ok", None)
        self._planned = _stage_count(ring)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Monitor:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="edgespec-health",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self.interval)

    def replanned(self) -> None:
        """The ring was re-planned on purpose (rebalance): its stage count is the plan now."""
        with self._lock:
            self._planned = _stage_count(self.ring)

    def check(self) -> tuple[str, str | None]:
        """Probe now (at most one probe per interval, shared with the page) and decide."""
        try:
            snap = self._snapshot(self.interval)
        except Exception as exc:  # a probe that fails says the ring is unusable
            snap = {"status": "down", "message": f"{type(exc).__name__}: {exc}", "nodes": []}
        verdict = self._judge(snap)
        with self._lock:
            self._verdict = verdict
        return verdict

    def _judge(self, snap: dict) -> tuple[str, str | None]:
        taken = getattr(self.ring, "taken_over", None)
        if taken:
            return "down", str(taken)
        if getattr(self.ring, "recovering", False):
            return "degraded", "re-forming the ring after a lost node"
        nodes = snap.get("nodes") or []
        planned = [n for n in nodes if not n.get("left")]
        answering = [n for n in planned if n.get("state") not in ("unreachable", "left")]
        stages = len(snap.get("stages") or [])
        with self._lock:
            self._planned = max(self._planned, stages)
            fewer = stages < self._planned
            planned_count = self._planned
        if planned and not answering:
            return "down", snap.get("message") or "no node of the ring answers"
        if snap.get("status") == "down" or len(answering) < len(planned):
            if not getattr(self.ring, "can_recover", False):
                return "down", snap.get("message") or "a node of the ring does not answer"
            lost = snap.get("message") or "a node of the ring does not answer"
            return "degraded", f"{lost}; the next request re-plans over the nodes that answer"
        if fewer:
            return "degraded", (f"running on {stages} of {planned_count} stages since a node "
                                "was lost")
        return "ok", None

    @property
    def verdict(self) -> tuple[str, str | None]:
        """("ok" | "degraded" | "down", why) as of the last probe."""
        with self._lock:
            return self._verdict


def _stage_count(ring: Any) -> int:
    try:
        return int(ring.chain.n_stages)
    except Exception:
        return 0


# ------------------------------------------------------------------------------- metrics

#: Per-token latency and time to first token, in seconds (a CPU ring: 10 ms to minutes).
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The server's Prometheus metrics, on a registry of its own (one per app)."""

    def __init__(self, ring: Any, gauges: Callable[[], dict[str, float]],
                 verdict: Callable[[], tuple[str, str | None]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("edgespec_requests", "Completion requests by endpoint and "
                                "outcome (completed, abandoned, rejected, failed)",
                                ["endpoint", "outcome"], registry=r)
        self.tokens = Counter("edgespec_tokens", "Tokens by kind (prompt, completion)",
                              ["kind"], registry=r)
        self.ttft = Histogram("edgespec_time_to_first_token_seconds", "From a request's "
                              "arrival to its first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("edgespec_time_per_output_token_seconds", "Decode time per "
                                   "generated token after the first, one sample per request",
                                   buckets=_LATENCY_BUCKETS, registry=r)
        self.stage_compute = Counter("edgespec_stage_compute_seconds", "Compute time per "
                                     "stage over the laps of finished requests", ["stage"],
                                     registry=r)
        self.link_transfer = Counter("edgespec_link_transfer_seconds", "Transfer time per "
                                     "link (from -> to) over the laps of finished requests",
                                     ["link"], registry=r)
        self.laps = Counter("edgespec_laps", "Laps of the ring timed for the two above",
                            registry=r)
        r.register(_ScrapeTime(ring, gauges, verdict))

    def finished(self, endpoint: str, gen: Any, ttft_s: float | None) -> None:
        """A generation's figures (also one that was abandoned midway)."""
        st = gen.stats
        self.tokens.labels("prompt").inc(st.prompt_tokens)
        self.tokens.labels("completion").inc(st.tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if st.tokens > 1 and st.decode_s > 0:
            self.per_token.observe(st.decode_s / st.tokens)
        timing = st.lap_timing.as_dict() if st.lap_timing is not None else None
        if timing:
            n = timing["laps"]
            self.laps.inc(n)
            for s in timing["stages"]:
                self.stage_compute.labels(str(s["stage"])).inc(s["compute_ms"] * n / 1e3)
            for link in timing["links"]:
                self.link_transfer.labels(f"{link['from']}->{link['to']}").inc(
                    link["transfer_ms"] * n / 1e3)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ScrapeTime:
    """Metrics read at scrape time: queue depth, running requests, recoveries, the ring's
    condition and stage count."""

    def __init__(self, ring: Any, gauges: Callable[[], dict[str, float]],
                 verdict: Callable[[], tuple[str, str | None]]) -> None:
        self.ring, self.gauges, self.verdict = ring, gauges, verdict

    def describe(self) -> list:
        return []

    def collect(self):
        g = self.gauges()
        yield GaugeMetricFamily("edgespec_queue_depth", "Requests waiting for a slot",
                                value=g.get("queued", 0))
        yield GaugeMetricFamily("edgespec_requests_running", "Requests on the ring now",
                                value=g.get("serving", 0))
        yield GaugeMetricFamily("edgespec_slots", "Requests the ring serves at once",
                                value=g.get("parallel", 1))
        yield CounterMetricFamily("edgespec_recoveries", "Ring rebuilds after a lost node",
                                  value=len(getattr(self.ring, "recovery_log", []) or []))
        yield GaugeMetricFamily("edgespec_stages", "Stages of the ring in force",
                                value=_stage_count(self.ring))
        state = GaugeMetricFamily("edgespec_ring_status", "1 for the ring's condition now",
                                  labels=["status"])
        now = self.verdict()[0]
        for s in ("ok", "degraded", "down"):
            state.add_metric([s], 1.0 if s == now else 0.0)
        yield state
        yield GaugeMetricFamily("edgespec_up_since_seconds", "Unix time this server started",
                                value=_STARTED)


_STARTED = time.time()
