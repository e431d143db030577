"""What a soak run must show (``bench/soak.py``), judged from the clients' records, the faults
injected and the processes' samples: one entry per check, each ``{"ok": bool, ...}`` with
what it saw."""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from typing import Any

from bench.ring_bench import NEAR_TIE
from bench.soak_clients import REQUEST_BOUND_S

#: A request's end, its retries included, at the latest: the bound plus one attempt's timeout.
BOUND_S = REQUEST_BOUND_S + 60.0
#: The ring serves again within this long of a fault's end.
RECOVERY_S = 5.0
#: Resident memory may grow this much from the end of a process's warm-up.
RSS_GROWTH = 0.05
#: Settled samples a process needs after its warm-up to be judged (a one-minute run has
#: too few: its memory is reported, not judged).
MIN_POINTS = 4
#: Kinds whose answers are greedy, by prompt key: they must all agree.
GREEDY_KINDS = ("chat", "stream", "long", "anthropic", "ollama", "responses")


def _first_split(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _gap_at(ref: dict, char: int) -> float | None:
    """The chat reference's logit gap (top 1 - top 2) at the token holding character
    ``char`` of its text; None where it has no log probabilities there."""
    pos = 0
    for token, top in ref.get("logprobs") or []:
        pos += len(token)
        if pos > char:
            if len(top) < 2:
                return None
            return top[0][1] - top[1][1]
    return None


def greedy(records: list[dict], fault_windows: list[tuple[float, float]]) -> dict[str, Any]:
    """Every greedy answer of a prompt equals that prompt's fault-free chat answer (one with
    log probabilities, which started and ended outside every fault), or parts from it where
    the two best tokens were under ``NEAR_TIE`` apart."""
    def clear(r: dict) -> bool:
        return all(r["t1"] < a or r["t0"] > b for a, b in fault_windows)

    by_key: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("kind") in GREEDY_KINDS and r.get("result") == "answer":
            by_key[r["key"]].append(r)
    out: dict[str, Any] = {"ok": True, "compared": 0, "same": 0, "near_ties": [],
                           "differ": []}
    for key, rs in by_key.items():
        refs = [r for r in rs if r["kind"] in ("chat", "long") and r.get("logprobs")
                and clear(r)]
        if not refs:
            out.setdefault("no_reference", []).append(key)
            continue
        ref = refs[0]
        for r in rs:
            out["compared"] += 1
            if r["text"] == ref["text"]:
                out["same"] += 1
                continue
            at = _first_split(r["text"], ref["text"])
            # One answer may be a prefix of the other where the doors stop on different
            # text boundaries: a token whose text is cut.
            gap = _gap_at(ref, at)
            item = {"key": key, "kind": r["kind"], "at_char": at, "gap": gap,
                    "during_fault": not clear(r), "text": r["text"][:120],
                    "reference": ref["text"][:120]}
            if gap is not None and gap < NEAR_TIE:
                out["near_ties"].append(item)
            else:
                out["differ"].append(item)
                out["ok"] = False
    return out


def recovery(faults: list[dict], probes: list[dict]) -> dict[str, Any]:
    """For each fault: seconds from its end to the first probe answered after it."""
    ok_ends = sorted(p["t1"] for p in probes if p.get("status") == 200)
    by_kind: dict[str, list[float]] = defaultdict(list)
    late = []
    for f in faults:
        end = f.get("end")
        if end is None:
            continue
        nxt = next((t for t in ok_ends if t >= end), None)
        f["recovery_s"] = None if nxt is None else round(nxt - end, 2)
        if nxt is None or nxt - end > RECOVERY_S:
            late.append(f)
        if nxt is not None:
            by_kind[f["kind"]].append(nxt - end)
    table = {k: {"n": len(v), "p50_s": round(statistics.median(v), 2),
                 "max_s": round(max(v), 2)} for k, v in by_kind.items()}
    return {"ok": not late, "bound_s": RECOVERY_S, "by_kind": table,
            "late": [{k: f.get(k) for k in ("kind", "start", "end", "recovery_s")}
                     for f in late]}


def processes(samples: dict[str, list], settled: list[list], warmup_s: float
              ) -> dict[str, Any]:
    """Each process judged on the settled samples (quiet points between faults, the ring
    whole, so each node holds the same window at every one) taken once it had lived
    ``warmup_s``: its resident memory, descriptors and threads at the last one against the
    most of each over the first third of them (the level after warm-up; a stage's buffers
    follow the largest batch it has seen since its load). The full series is reported."""
    table: dict[str, Any] = {}
    bad = []
    for label, series in samples.items():
        if not series:
            continue
        t_first = series[0][0]
        step = max(1, len(series) // 40)
        row: dict[str, Any] = {
            "series": [[round(t - t_first), round(s["rss_kib"] / 1024, 1),
                        round(s["anon_kib"] / 1024, 1), s["fds"], s["threads"]]
                       for t, s in series[::step]],
            "series_columns": ["s", "rss_mib", "anon_mib", "fds", "threads"],
            "first_rss_mib": round(series[0][1]["rss_kib"] / 1024, 1),
            "last_rss_mib": round(series[-1][1]["rss_kib"] / 1024, 1),
            "lived_s": round(series[-1][0] - t_first, 1)}
        points = [snap[label] for t, snap in settled
                  if label in snap and t >= t_first + warmup_s]
        if len(points) < MIN_POINTS:
            row["judged"] = False  # too short a life after its warm-up
        else:
            early = points[:max(1, len(points) // 3)]
            last = points[-1]
            level = {k: max(p[k] for p in early) for k in ("rss_kib", "fds", "threads")}
            row.update(judged=True, settled_points=len(points),
                       early_rss_mib=round(level["rss_kib"] / 1024, 1),
                       end_rss_mib=round(last["rss_kib"] / 1024, 1),
                       growth=round(last["rss_kib"] / level["rss_kib"] - 1, 4),
                       fds=[level["fds"], last["fds"]],
                       threads=[level["threads"], last["threads"]])
            if (row["growth"] >= RSS_GROWTH or last["fds"] > level["fds"]
                    or last["threads"] > level["threads"]):
                bad.append(label)
        table[label] = row
    return {"ok": not bad, "grew": bad, "rss_growth_bound": RSS_GROWTH, "by_process": table}


_METRIC = re.compile(r'^edgespec_requests_total\{endpoint="chat",outcome="(\w+)"\} (\S+)$',
                     re.M)


def metrics(records: list[dict], probes: list[dict], metrics_text: str,
            last_start: float) -> dict[str, Any]:
    """/metrics of the last head against the clients' attempts that started once it was
    started (the one before had stopped by then): answered (completed or abandoned) ones, 5xx failures and 429s."""
    served = {k: int(float(v)) for k, v in _METRIC.findall(metrics_text or "")}
    mine = Counter()
    for a in [a for r in records for a in r.get("attempts", [])] + probes:
        if a["t0"] < last_start:
            continue
        s = a.get("status")
        mine["answered" if s == 200 else "rejected" if s == 429
             else "failed" if s is not None and s >= 500 else "other"] += 1
    theirs = {"answered": served.get("completed", 0) + served.get("abandoned", 0),
              "failed": served.get("failed", 0), "rejected": served.get("rejected", 0)}
    ok = all(theirs[k] == mine[k] for k in theirs) and bool(served)
    return {"ok": ok, "server": theirs, "clients": {k: mine[k] for k in theirs},
            "server_raw": served}


def judge(records: list[dict], faults: list[dict], samples: dict[str, list],
          settled: list[list], heads: list[dict], *, warmup_s: float, t_start: float
          ) -> dict[str, Any]:
    reqs = [r for r in records if "kind" in r]
    probes = [r for r in records if r.get("probe")]
    tail = next((r for r in records if "metrics" in r), {})
    windows = [(f["start"], f["end"] or f["start"]) for f in faults]
    errors = [{"kind": r["kind"], "error": r.get("error"), "retryable": r.get("retryable"),
               "status": r["attempts"][-1].get("status"), "at_s": round(r["t0"] - t_start, 1)}
              for r in reqs if r["result"] == "error"]
    slow = [r for r in reqs if r["t1"] - r["t0"] > BOUND_S]
    invalid = [r for r in reqs if r.get("valid") is False]
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for r in reqs:
        by_kind[r["kind"]][r["result"]] += 1
        by_kind[r["kind"]]["retried"] += len(r["attempts"]) > 1
    checks = {
        "ended_within_bound": {"ok": not slow and not tail.get("stuck"), "bound_s": BOUND_S,
                               "over": len(slow), "stuck": tail.get("stuck")},
        "errors_say_retry": {"ok": all(e["status"] is not None or e["retryable"]
                                       for e in errors), "errors": len(errors)},
        "structured_valid": {"ok": not invalid, "invalid": [r["text"][:200]
                                                            for r in invalid]},
        "greedy_through_faults": greedy(reqs, windows),
        "serves_again": recovery(faults, probes),
        "memory_flat": processes(samples, settled, warmup_s),
        "metrics_match": metrics(reqs, probes, tail.get("metrics", ""),
                                 heads[-1]["started"] if heads else 0.0),
    }
    return {"requests": {k: dict(v) for k, v in sorted(by_kind.items())},
            "probes": {"n": len(probes), "answered": sum(p["status"] == 200 for p in probes)},
            "faults": [dict(f) for f in faults],
            "errors": errors, "checks": checks, "warmup_s": warmup_s}
