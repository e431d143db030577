"""Lap timing: where one lap's time goes, per stage and per link (docs/design.md 8.1).

Every stage that runs a batch appends one stamp to it, ``[stage, t_in, t_start, t_end, cpu]``
(integer microseconds: a float's shortest repr costs every hop several times an int's, in the
JSON of META; the times on the wall clock): ``t_in`` when its node had the frame off the socket and
decoded, ``t_start`` when the stage's worker took it from the queue, ``t_end`` when its compute
was done and the send to the next stage began, ``cpu`` the CPU time the worker thread spent in
between (with one llama.cpp thread, all of the compute: a wall time well above it means the
stage was waiting for a core, i.e. the host is loaded). The stamps ride along the ring in the
batch's META (``timing``) and come back in the RESULT. The head adds when it sent the batch
and when its reader thread got the result, and :class:`LapTimes` turns that into:

* per stage: ``wait_ms`` (queued behind earlier work or waiting for its thread to wake),
  ``compute_ms`` (KV operations, row pruning, the windows' llama_decode and target picking)
  and ``compute_cpu_ms`` (the worker thread's CPU time in it);
* per link (head -> stage 0, stage k -> k+1, last stage -> head): ``transfer_ms``, from one
  side's end of compute to the other side's frame decoded: encoding, sealing, the socket, the
  wire, reading and opening the frame (the sender's send is part of its outgoing link);
* ``head_wake_ms``: from the head's reader thread having the result to the engine holding it.

Links compare two processes' clocks. On one host (or with clocks synchronised by NTP to well
under a millisecond) the per-link figures are exact; ``links_ms`` (lap minus the stages' wait
and compute) needs no clock agreement at all, and a lap whose per-link figures come out
negative (clocks apart) is counted there only.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any

#: One stage's stamp in a batch's ``timing`` list: [stage, t_in, t_start, t_end, cpu].
Stamp = list

#: Laps whose send time is remembered until their result comes (results of abandoned laps
#: never come).
_SENT_MEMORY = 4096


def now() -> int:
    """The clock every stamp uses, in microseconds (wall clock: stamps are compared across
    processes)."""
    return time.time_ns() // 1000


def cpu_now() -> int:
    """This thread's CPU time in microseconds (a stamp's ``cpu``)."""
    return time.thread_time_ns() // 1000


@dataclass
class LapTimes:
    """Accumulated lap timing of one generation (``GenerationStats.lap_timing``).

    Only laps with wanted rows count (decode laps: prefill chunks, which want no token, would
    swamp the means with their large batches)."""

    laps: int = 0
    lap_s: float = 0.0
    head_wake_s: float = 0.0
    # per stage: [laps seen, wait_s, compute_s, compute_cpu_s]
    stages: dict[int, list[float]] = field(default_factory=dict)
    # per link, keyed by its sending side (-1 = the head): [laps seen, transfer_s]
    links: dict[int, list[float]] = field(default_factory=dict)
    skewed: int = 0  # laps whose per-link figures were negative (clocks apart)
    _sent: collections.OrderedDict = field(default_factory=collections.OrderedDict, repr=False)

    def sent(self, batch: Any) -> None:
        """The head handed ``batch`` (a ``chain.Batch``) to the chain."""
        if not batch.want.any():
            return  # a prefill chunk: not a decode lap
        self._sent[(batch.lap, batch.segment)] = now()
        while len(self._sent) > _SENT_MEMORY:
            self._sent.popitem(last=False)

    def got(self, result: Any) -> None:
        """The engine holds ``result`` (a ``chain.Result``)."""
        t_got = now()
        t_sent = self._sent.pop((result.lap, result.segment), None)
        stamps = getattr(result, "timing", None)
        if t_sent is None or not stamps or not len(result.targets):
            return
        t_recv = getattr(result, "received", 0) or t_got
        stamps = sorted(stamps, key=lambda s: s[0])
        self.laps += 1
        self.lap_s += (t_recv - t_sent) * 1e-6
        self.head_wake_s += (t_got - t_recv) * 1e-6
        for st, t_in, t_start, t_end, cpu in stamps:
            acc = self.stages.setdefault(int(st), [0, 0.0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += (t_start - t_in) * 1e-6
            acc[2] += (t_end - t_start) * 1e-6
            acc[3] += cpu * 1e-6
        hops = [(-1, t_sent)] + [(int(s[0]), s[3]) for s in stamps]
        arrivals = [s[1] for s in stamps] + [t_recv]
        gaps = [(src, t_arr - t_out) for (src, t_out), t_arr in zip(hops, arrivals, strict=True)]
        if any(g < 0 for _, g in gaps):
            self.skewed += 1
            return
        for src, g in gaps:
            acc = self.links.setdefault(src, [0, 0.0])
            acc[0] += 1
            acc[1] += g * 1e-6

    def merged(self, other: LapTimes | None) -> LapTimes:
        """These lap times with ``other`` (an earlier part of the same generation) added."""
        out = LapTimes(self.laps, self.lap_s, self.head_wake_s,
                       {k: list(v) for k, v in self.stages.items()},
                       {k: list(v) for k, v in self.links.items()}, self.skewed)
        if other is not None:
            out.laps += other.laps
            out.lap_s += other.lap_s
            out.head_wake_s += other.head_wake_s
            out.skewed += other.skewed
            for mine, theirs in ((out.stages, other.stages), (out.links, other.links)):
                for k, v in theirs.items():
                    acc = mine.setdefault(k, [0] + [0.0] * (len(v) - 1))
                    for i, x in enumerate(v):
                        acc[i] += x
        return out

    def log(self, logger: logging.Logger) -> None:
        """The view, one DEBUG record per line (shown by `edgespec -v` in chat, demo, serve)."""
        if logger.isEnabledFor(logging.DEBUG):
            for line in lap_lines(self.as_dict()):
                logger.debug("%s", line)

    def as_dict(self) -> dict[str, Any] | None:
        """Means per lap in ms; None when no lap was timed (e.g. every token came from KV)."""
        if not self.laps:
            return None

        def ms(x: float, n: float) -> float:
            return round(x * 1e3 / max(1, n), 3)

        stages = [{"stage": s, "wait_ms": ms(v[1], v[0]), "compute_ms": ms(v[2], v[0]),
                   "compute_cpu_ms": ms(v[3], v[0])} for s, v in sorted(self.stages.items())]
        order = sorted(self.stages)
        links = []
        for src, v in sorted(self.links.items()):
            nxt = [s for s in order if s > src]
            links.append({"from": "head" if src < 0 else src,
                          "to": nxt[0] if nxt else "head", "transfer_ms": ms(v[1], v[0])})
        lap = ms(self.lap_s, self.laps)
        inside = sum(s["wait_ms"] + s["compute_ms"] for s in stages)
        return {"laps": self.laps, "lap_ms": lap, "stages": stages, "links": links,
                "links_ms": round(lap - inside, 3),
                "head_wake_ms": ms(self.head_wake_s, self.laps), "skewed_laps": self.skewed}


def lap_lines(view: dict[str, Any] | None) -> list[str]:
    """The lap-timing view in words, one line per stage and one for the links (``-v``)."""
    if not view:
        return []
    out = [f"lap {view['lap_ms']:.2f} ms over {view['laps']} laps: stages "
           f"{sum(s['compute_ms'] for s in view['stages']):.2f} ms compute, "
           f"{sum(s['wait_ms'] for s in view['stages']):.2f} ms queued; links "
           f"{view['links_ms']:.2f} ms; head wake-up {view['head_wake_ms']:.2f} ms"]
    for s in view["stages"]:
        out.append(f"  stage {s['stage']}: wait {s['wait_ms']:.2f} ms, "
                   f"compute {s['compute_ms']:.2f} ms ({s['compute_cpu_ms']:.2f} ms CPU)")
    if view["links"]:
        out.append("  links: " + ", ".join(f"{lk['from']}->{lk['to']} {lk['transfer_ms']:.2f} ms"
                                           for lk in view["links"]))
    return out


def stamps_from_meta(value: Any) -> list[Stamp]:
    """The stamps a batch arrived with, from its META (a peer's; anything malformed is dropped:
    timing is a view, never a reason to refuse a batch)."""
    if not isinstance(value, list) or len(value) > 1024:
        return []
    out: list[Stamp] = []
    for s in value:
        # Runs on every hop: the JSON-decoded common case (plain int/float items) is tested by
        # exact type in one C-level pass; anything else takes the general test.
        if (isinstance(s, list) and len(s) == 5
                and (all(map(_JSON_NUMBER.__contains__, map(type, s)))
                     or all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in s))):
            out.append([int(s[0]), int(s[1]), int(s[2]), int(s[3]), int(s[4])])
    return out


_JSON_NUMBER = frozenset({int, float})


def combine(views: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Several generations' views as one (means weighted by their laps): benchmark summaries."""
    views = [v for v in views if v]
    n = sum(v["laps"] for v in views)
    if not n:
        return None

    def mean(get: Any, among: list[dict[str, Any]]) -> float:
        w = sum(v["laps"] for v in among)
        return round(sum(get(v) * v["laps"] for v in among) / max(1, w), 3)

    out: dict[str, Any] = {"laps": n, "skewed_laps": sum(v["skewed_laps"] for v in views)}
    for k in ("lap_ms", "links_ms", "head_wake_ms"):
        out[k] = mean(lambda v, k=k: v[k], views)
    stages = sorted({s["stage"] for v in views for s in v["stages"]})
    out["stages"] = []
    for st in stages:
        among = [v for v in views if any(s["stage"] == st for s in v["stages"])]

        def pick(v: dict[str, Any], key: str, st: int = st) -> float:
            return next(s[key] for s in v["stages"] if s["stage"] == st)

        out["stages"].append({k: mean(lambda v, k=k: pick(v, k), among) if k != "stage" else st
                              for k in ("stage", "wait_ms", "compute_ms", "compute_cpu_ms")})
    links = list(dict.fromkeys((lk["from"], lk["to"]) for v in views for lk in v["links"]))
    out["links"] = []
    for a, b in links:
        among = [v for v in views if any((lk["from"], lk["to"]) == (a, b) for lk in v["links"])]
        out["links"].append({"from": a, "to": b, "transfer_ms": mean(
            lambda v, a=a, b=b: next(lk["transfer_ms"] for lk in v["links"]
                                     if (lk["from"], lk["to"]) == (a, b)), among)})
    return out
