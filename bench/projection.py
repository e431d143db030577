"""Stage cost curves, a lap-time model checked against the ring benchmark, and a PROJECTION.

Two parts:

1. ``measure_stage_curves``: every stage window of the ring benchmark's split, loaded alone in
   this process (1 llama.cpp thread, like a stage process), timed for batches of r rows after
   a prompt-sized KV history: ``ms[stage][r]``. This is the measured compute of a lap.
2. ``project``: a lap-time model built from those curves, the measured acceptance and drafting
   time of the benchmark's ``sync`` rows, and the measured per-lap overhead that the curves do
   not explain. It is first *checked* against the measured configuration (predicted vs measured
   tokens/s), then used to PROJECT what N devices would reach if verifying a tree of B rows
   cost what one row costs (GPU-like flat verification: small batches are memory-bound there).
   Projections are model output, not measurements, and every table says so.

Model of one lap over N stages with one-way link delay d (the benchmark's head is a separate
process, so a lap crosses N + 1 links: head -> s0 -> ... -> s(N-1) -> head):

    lap(r) = sum_i c_i(r) + (N + 1) * d + overhead
    none:  tokens/s = 1000 / lap(1)
    sync:  tokens/s = 1000 * A / (lap(R) + draft)       A = tokens per round, R = rows per
                                                        round, draft = ms drafting per round
flat ("GPU-like"): c_i(r) = C(1) / N for every r, C(1) = the whole model's one-row cost here.
``flow`` is not projected: under flat verification cost its segments only add per-segment
stage passes, and its gain from overlap depends on scheduling this simple model does not have.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROWS = (1, 2, 4, 8, 16, 32)


def stage_shard(model_path: Path, a: int, b: int) -> Path:
    """The shard a local ring node would cut for window [a, b) (same cache file name, so the
    benchmark's nodes and this measurement share one copy)."""
    from edgespec.llm import models
    from edgespec.llm.gguf_read import fingerprint
    from edgespec.llm.shards import cut_window, shard_file_name

    fp = fingerprint(model_path)
    out = models.home() / "shards" / shard_file_name(a, b, fp, model_path.stem)
    return cut_window(model_path, (a, b), out)


def measure_stage_curves(model_path: Path, stages: int, *, rows: Sequence[int] = ROWS,
                         history: int = 160, reps: int = 3, threads: int = 1) -> dict[str, Any]:
    """Median ms per ``forward`` of r rows, per stage window, after ``history`` cached tokens.

    Rows are one sequence at consecutive positions (a chain, the same work per row as a tree
    row: llama.cpp's cost depends on the row count, not on the mask).
    """
    from edgespec.llm.gguf_read import read_info
    from edgespec.llm.shards import even_ranges
    from edgespec.node.runtime import StageRuntime

    info = read_info(model_path)
    rng = np.random.default_rng(0)
    out: list[dict[str, Any]] = []
    for a, b in even_ranges(info.n_layer, stages):
        path = stage_shard(model_path, a, b) if (a, b) != (0, info.n_layer) else model_path
        with StageRuntime(path, n_ctx=history + max(rows) * (reps + 1) + 8, n_seq_max=1,
                          n_threads=threads) as rt:
            def inputs(n: int, rt: StageRuntime = rt) -> np.ndarray:
                if rt.is_first:
                    return rng.integers(100, 20000, n).astype(np.int32)
                # Hidden states of the magnitude a real residual stream has; cost does not
                # depend on the values.
                return (rng.standard_normal((n, rt.n_embd)) * 0.5).astype(np.float32)

            rt.forward(inputs(history), 0)
            ms: dict[int, float] = {}
            for r in rows:
                times = []
                for _ in range(reps):
                    pos = rt.n_past(0)
                    t = time.perf_counter()
                    rt.forward(inputs(r), pos)
                    times.append((time.perf_counter() - t) * 1e3)
                    rt.truncate(pos)  # same KV length for every sample
                ms[r] = round(statistics.median(times), 3)
        out.append({"stage": len(out), "layers": [a, b], "last": b == info.n_layer, "ms": ms})
    whole = {r: round(sum(s["ms"][r] for s in out), 3) for r in rows}
    return {"model": model_path.name, "threads": threads, "history": history, "reps": reps,
            "stages": out, "whole_ms": whole}


def _interp(ms: dict[int, float], r: float) -> float:
    xs = sorted(ms)
    return float(np.interp(r, xs, [ms[x] for x in xs]))


def lap_ms(curves: dict[str, Any], rows: float, n_stages: int, delay_ms: float,
           overhead_ms: float, flat: bool) -> float:
    """Modelled lap time for ``rows`` rows (see module docstring)."""
    if flat:
        compute = _interp(curves["whole_ms"], 1)  # C(1), split over N stages, any row count
    else:
        if n_stages != len(curves["stages"]):
            raise ValueError("measured (non-flat) curves exist only for the measured split")
        compute = sum(_interp(s["ms"], rows) for s in curves["stages"])
    return compute + (n_stages + 1) * delay_ms + overhead_ms


def project(curves: dict[str, Any], rows: Iterable[dict[str, Any]], *,
            n_values: Sequence[int] = (2, 4, 8), hops: Sequence[float] | None = None
            ) -> dict[str, Any]:
    """Check the lap model against measured ring rows, then project flat-cost rings.

    ``rows``: the benchmark's aggregated JSON rows (mode none/sync with measured stats).
    """
    rows = [r for r in rows if r["mode"] in ("none", "sync") and r.get("tokens")]
    n_meas = int(curves and len(curves["stages"]))
    hops = sorted({float(r["hop_ms"]) for r in rows}) if hops is None else list(hops)
    # Overhead per lap the curves do not explain (Python, serialisation, proxies, scheduling
    # on a shared host): measured on mode none, where a lap is exactly one row.
    overheads = []
    for r in rows:
        if r["mode"] == "none":
            measured = 1000.0 / r["tokens_per_s"]
            overheads.append(measured - lap_ms(curves, 1, n_meas, r["hop_ms"], 0.0, False))
    overhead = float(statistics.median(overheads)) if overheads else 0.0

    check = []
    for r in rows:
        if r["mode"] == "none":
            pred = 1000.0 / lap_ms(curves, 1, n_meas, r["hop_ms"], overhead, False)
        else:
            per_step = r["rows_per_step"]
            pred = 1000.0 * r["tokens_per_step"] / (
                lap_ms(curves, per_step, n_meas, r["hop_ms"], overhead, False)
                + r["draft_ms_per_step"])
        check.append({"mode": r["mode"], "drafter": r["drafter"], "budget": r["budget"],
                      "hop_ms": r["hop_ms"], "measured_tok_s": r["tokens_per_s"],
                      "model_tok_s": round(pred, 3),
                      "model_error": round(pred / r["tokens_per_s"] - 1, 3)})

    # Acceptance and drafting cost per drafter/budget from sync rows (median over hops: they do
    # not depend on the link).
    spec: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        if r["mode"] == "sync":
            spec.setdefault((r["drafter"], str(r["budget"])), {"tpr": [], "draft": [], "rpr": []})
            d = spec[(r["drafter"], str(r["budget"]))]
            d["tpr"].append(r["tokens_per_step"])
            d["draft"].append(r["draft_ms_per_step"])
            d["rpr"].append(r["rows_per_step"])
    proj = []
    for n in n_values:
        for d in hops:
            base = 1000.0 / lap_ms(curves, 1, n, d, overhead, True)
            proj.append({"n_devices": n, "hop_ms": d, "mode": "none", "drafter": "-",
                         "budget": "-", "projected_tok_s": round(base, 3), "x_none": 1.0})
            for (drafter, budget), v in sorted(spec.items()):
                tpr = statistics.median(v["tpr"])
                draft = statistics.median(v["draft"])
                t = 1000.0 * tpr / (lap_ms(curves, 1, n, d, overhead, True) + draft)
                proj.append({"n_devices": n, "hop_ms": d, "mode": "sync", "drafter": drafter,
                             "budget": budget, "tokens_per_step": round(tpr, 3),
                             "draft_ms_per_step": round(draft, 2),
                             "projected_tok_s": round(t, 3), "x_none": round(t / base, 3)})
    return {
        "label": "PROJECTION - modelled, not measured",
        "assumptions": [
            "each device computes one row as fast as one core of this host (C(1) measured)",
            "verifying a tree of any measured size costs the same as one row (flat, GPU-like)",
            "layers split evenly: each of N stages costs C(1)/N",
            "a lap crosses N+1 links of the given one-way delay (head is its own process)",
            f"plus {overhead:.1f} ms per lap of measured overhead the stage curves do not explain",
            "acceptance (tokens per round) and drafting time per round as measured in sync mode",
            "flow is not projected (see bench/projection.py docstring)",
        ],
        "overhead_ms_per_lap": round(overhead, 2),
        "model_check": check,
        "projection": proj,
    }


def markdown(p: dict[str, Any]) -> str:
    """The projection as Markdown (labelled)."""
    lines = [f"### {p['label']}", "", "Assumptions:", ""]
    lines += [f"- {a}" for a in p["assumptions"]]
    lines += ["", "Model check against the measured ring (same split, measured cost curves):", "",
              "| mode | drafter | budget | hop ms | measured tok/s | model tok/s | error |",
              "|---|---|---|---:|---:|---:|---:|"]
    for c in p["model_check"]:
        lines.append(f"| {c['mode']} | {c['drafter']} | {c['budget']} | {c['hop_ms']:g} | "
                     f"{c['measured_tok_s']:.2f} | {c['model_tok_s']:.2f} | "
                     f"{c['model_error']:+.0%} |")
    lines += ["", "PROJECTED tokens/s with flat (GPU-like) verification cost:", "",
              "| N devices | hop ms | mode | drafter | budget | projected tok/s | x none |",
              "|---:|---:|---|---|---|---:|---:|"]
    for r in p["projection"]:
        lines.append(f"| {r['n_devices']} | {r['hop_ms']:g} | {r['mode']} | {r['drafter']} | "
                     f"{r['budget']} | {r['projected_tok_s']:.2f} | {r['x_none']:.2f} |")
    return "\n".join(lines) + "\n"
