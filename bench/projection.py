"""The lap model: a ring's tokens/s from its parts, checked against the lab, then PROJECTED
onto named devices.

One model, three uses:

1. **Check** (``check``): for every one-client configuration the ring benchmark measured,
   predict its tokens/s from measured parts only, print it beside the measurement. The parts:
   each stage's compute per lap as the stage itself timed it (``lap_timing``, by the rows that
   lap carried), the link profile (one-way delay, bandwidth for the bytes per hop), the
   speculation's traces (laps, steps and drafting time per token, as recorded), and one head
   and transport overhead per lap, fitted once on mode ``none`` on the fastest link and used
   unchanged for every other link and mode.
2. **Projection** (``project_devices``): the same formulas with each stage's compute taken from
   a named device's public llama.cpp decode speed (``DEVICES``, each figure with its source),
   the model's layers split evenly over the devices, and the acceptance traces measured here.
   Labelled PROJECTION everywhere: model output, not a measurement.

Per token, with N stages, ``c_s`` stage s's compute per lap, ``L`` a lap's link time
((N + 1) x one-way delay + the bytes a lap moves over the bandwidth), ``H`` the overhead:

    none, sync:  ms/token = laps/token x lap + draft ms/token,   lap = sum_s c_s + L + H
    flow:        ms/token = steps/token x lap + (laps/token - steps/token) x pace,
                 pace = max(max_s c_s, draft ms per lap)

Flow streams a step's segments back to back: a step lasts one lap for its first segment, and
each further segment enters as fast as the busiest stage or the drafting head lets it
(``auto`` is flow on a ring of several stages, and is modelled as flow there).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def stage_shard(model_path: Path, a: int, b: int) -> Path:
    """The shard a local ring node would cut for window [a, b) (same cache file name, so the
    benchmark's nodes and this measurement share one copy)."""
    from edgespec.llm import models
    from edgespec.llm.gguf_read import fingerprint
    from edgespec.llm.shards import cut_window, shard_file_name

    fp = fingerprint(model_path)
    out = models.home() / "shards" / shard_file_name(a, b, fp, model_path.stem)
    return cut_window(model_path, (a, b), out)


def link_ms(spec: Any, n_stages: int, bytes_per_lap: float) -> float:
    """A lap's time on the links: N + 1 crossings of the delay, and its bytes serialised at
    the bandwidth (each hop carries its share one after another)."""
    ms = (n_stages + 1) * spec.delay_ms
    if spec.bandwidth_mbps:
        ms += bytes_per_lap * 8 / (spec.bandwidth_mbps * 1e3)
    return ms


def ms_per_token(mode: str, stage_ms: list[float], lap_link_ms: float, overhead_ms: float,
                 laps_per_token: float, steps_per_token: float, draft_ms_per_token: float
                 ) -> float:
    """The model's time per token (module docstring)."""
    lap = sum(stage_ms) + lap_link_ms + overhead_ms
    if mode == "flow":
        pace = max(max(stage_ms), draft_ms_per_token / max(laps_per_token, 1e-9))
        return steps_per_token * lap + max(0.0, laps_per_token - steps_per_token) * pace
    return laps_per_token * lap + draft_ms_per_token


def _parts(row: dict[str, Any]) -> dict[str, Any] | None:
    """What the model needs of one measured row, or None when its lap timing is missing."""
    lt = row.get("lap_timing")
    if not lt or not lt.get("stages") or not row.get("tokens"):
        return None
    toks = row["tokens"]
    steps = (row.get("steps_per_token") or 0) * toks
    bytes_tok = sum(row.get("bytes_per_token", {}).values())
    laps_tok = row.get("laps_per_token") or 1.0
    return {"stage_ms": [s["compute_ms"] for s in lt["stages"]],
            "laps_per_token": laps_tok, "steps_per_token": row.get("steps_per_token") or 1.0,
            "draft_ms_per_token": (row.get("draft_ms_per_step") or 0.0) * steps / toks,
            "bytes_per_lap": bytes_tok / laps_tok, "lap_ms": lt["lap_ms"]}


def check(rows: list[dict[str, Any]], link_spec, tolerance: float = 0.15) -> dict[str, Any]:
    """Predicted beside measured tokens/s for every one-client ring row (module docstring)."""
    ring_rows = [r for r in rows if r["mode"] != "single" and r["clients"] == 1]
    nones = [r for r in ring_rows if r["mode"] == "none" and _parts(r)]
    if not nones:
        return {"label": "lap model check", "rows": [], "note": "no mode none row with lap "
                "timing to fit the overhead on"}
    base = min(nones, key=lambda r: link_spec(r["link"]).delay_ms)
    bp = _parts(base)
    n = len(bp["stage_ms"])
    overhead = (1000.0 / base["tokens_per_s"] / bp["laps_per_token"] - sum(bp["stage_ms"])
                - link_ms(link_spec(base["link"]), n, bp["bytes_per_lap"]))
    out = []
    for r in ring_rows:
        p = _parts(r)
        if p is None:
            continue
        spec = link_spec(r["link"])
        mode = "flow" if r["mode"] == "auto" and n > 1 else r["mode"]
        ms = ms_per_token(mode, p["stage_ms"], link_ms(spec, n, p["bytes_per_lap"]),
                          overhead, p["laps_per_token"], p["steps_per_token"],
                          p["draft_ms_per_token"])
        pred = 1000.0 / ms
        err = pred / r["tokens_per_s"] - 1
        out.append({"link": r["link"], "mode": r["mode"], "drafter": r["drafter"],
                    "budget": r["budget"], "measured_tok_s": r["tokens_per_s"],
                    "predicted_tok_s": round(pred, 3), "error": round(err, 3),
                    "within": abs(err) <= tolerance, "fitted_on": r is base})
    return {"label": "lap model check (predicted from measured parts, beside the measurement)",
            "overhead_ms_per_lap": round(overhead, 2), "fitted_on": f"none/{base['link']}",
            "tolerance": tolerance, "rows": out,
            "all_within": all(c["within"] for c in out)}


# ----------------------------------------------------------------------------- named devices

#: Public llama.cpp decode figures (batch 1, tokens/s) of named devices, each with its source.
#: ``model_gb``: the size of the model file measured; ``mem_gb``: the device's memory.
#: ``flat_rows``: rows a decode call takes at about one row's cost (a GPU's matrix kernels are
#: bound by reading the weights up to there; a CPU's cost grows with rows from the start).
DEVICES: dict[str, dict[str, Any]] = {
    "4 x Jetson Orin Nano 8 GB": {
        "count": 4, "mem_gb": 8, "tg_tok_s": 32.1, "model_gb": 1.12, "flat_rows": 16,
        "source": "llama.cpp CUDA, Qwen2.5-Coder-1.5B Q4_K_M, 32.1 tok/s at concurrency 1 "
                  "(github.com/paiml/realizar/issues/120, 2026-03)"},
    "4 x Raspberry Pi 5 8 GB": {
        "count": 4, "mem_gb": 8, "tg_tok_s": 2.57, "model_gb": 3.825,
        "source": "llama-bench tg128, Amber 7B (llama architecture) Q4_0_4_4, 3.825 GB, "
                  "4 threads: 2.57 tok/s (huggingface.co/spaces/nyunai/edge-llm-leaderboard, "
                  "its Raspberry Pi 5 (8GB) table)"},
    "3 x N100 mini PC 16 GB": {
        "count": 3, "mem_gb": 16, "tg_tok_s": 3.01, "model_gb": 4.92,
        "source": "llama-bench tg128, Llama 3.1 8B Q4_K_M (4.92 GB): 3.01 tok/s "
                  "(github.com/brand-o/normiebench/issues/38, an N100 with 16 GB, 2026-03)"},
    "2 x Ryzen 7 8840U laptop 32 GB": {
        "count": 2, "mem_gb": 30, "tg_tok_s": 9.63, "model_gb": 4.92,
        "source": "llama-bench tg128 on the CPU, Llama 3.1 8B Q4_K_M (4.92 GB): 9.63 tok/s "
                  "(github.com/brand-o/normiebench/issues/8, 2026-03)"},
}

#: Q4_K_M GGUF file sizes in GB (as published with the models' GGUF releases).
MODELS_GB = {"7B": 4.68, "14B": 8.99, "32B": 19.85, "70B": 42.52}

#: The projected links: one-way delays (ms) of a wired LAN and of a link between two sites.
PROJECTED_LINKS_MS = {"wired 1 ms": 1.0, "sites 50 ms": 50.0}


def project_devices(traces: dict[str, dict[str, float]], cpu_row_cost: dict[int, float],
                    models: dict[str, float], links: dict[str, Any], *,
                    devices: dict[str, dict[str, Any]] | None = None,
                    overhead_ms: float = 0.0) -> list[dict[str, Any]]:
    """PROJECTED tokens/s of rings of named devices (``DEVICES``) for models of the given
    sizes (name -> GB at Q4), over the given links, in modes none and those in ``traces``
    (mode -> its measured ``rows_per_lap``, ``laps_per_token``, ``steps_per_token`` and
    ``draft_ms_per_token``). A CPU device's lap of r rows costs ``cpu_row_cost[r]`` times a
    one-row lap (measured here); a GPU's costs one row's up to ``flat_rows`` rows."""
    devices = DEVICES if devices is None else devices
    out = []
    for ring_name, dev in devices.items():
        k = dev["count"]
        for model, size_gb in models.items():
            fits = size_gb / k <= 0.8 * dev["mem_gb"]
            # Decode on these devices reads every weight once per token: time scales with
            # the bytes read, from the measured model's size to this one's.
            whole_ms = 1000.0 / dev["tg_tok_s"] * size_gb / dev["model_gb"]
            for link, spec in links.items():
                for mode, t in {"none": None, **traces}.items():
                    rows = 1.0 if t is None else t["rows_per_lap"]
                    if dev.get("flat_rows") and rows <= dev["flat_rows"]:
                        factor = 1.0
                    else:
                        factor = _interp(cpu_row_cost, rows)
                    stage = [whole_ms / k * factor] * k
                    kind = "none" if t is None else "flow" if mode == "auto" else mode
                    ms = ms_per_token(kind, stage,
                                      link_ms(spec, k, 0.0), overhead_ms,
                                      1.0 if t is None else t["laps_per_token"],
                                      1.0 if t is None else t["steps_per_token"],
                                      0.0 if t is None else t["draft_ms_per_token"])
                    out.append({"ring": ring_name, "model": model, "link": link,
                                "mode": mode, "fits": fits,
                                "projected_tok_s": round(1000.0 / ms, 2) if fits else None})
    return out


def cpu_row_cost(row_cost_curve: dict[str, Any]) -> dict[int, float]:
    """A CPU decode call's cost by rows, relative to one row: the middle target window of
    ``bench/row_cost_curve.py``'s result (the first curve)."""
    ms = {int(k): float(v) for k, v in row_cost_curve["curves"][0]["ms"].items()}
    return {r: v / ms[1] for r, v in sorted(ms.items())}


def _interp(curve: dict[int, float], x: float) -> float:
    xs = sorted(curve)
    if x <= xs[0]:
        return curve[xs[0]]
    for a, b in zip(xs, xs[1:], strict=False):
        if x <= b:
            return curve[a] + (curve[b] - curve[a]) * (x - a) / (b - a)
    return curve[xs[-1]] * x / xs[-1]


def traces_of(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per speculative mode, the median over links of its one-client traces."""
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["mode"] in ("sync", "flow", "auto") and r["clients"] == 1 and _parts(r):
            by_mode.setdefault(r["mode"], []).append(r)
    out = {}
    for mode, rs in by_mode.items():
        ps = [_parts(r) for r in rs]
        out[mode] = {
            "rows_per_lap": statistics.median(
                (r.get("rows_per_step") or 1.0) * (r.get("steps_per_token") or 1.0)
                / (r.get("laps_per_token") or 1.0) for r in rs),
            "laps_per_token": statistics.median(p["laps_per_token"] for p in ps),
            "steps_per_token": statistics.median(p["steps_per_token"] for p in ps),
            "draft_ms_per_token": statistics.median(p["draft_ms_per_token"] for p in ps)}
    return out


def markdown(check_: dict[str, Any], projected: list[dict[str, Any]] | None = None) -> str:
    lines = [f"### {check_['label']}", ""]
    if not check_.get("rows"):
        return "\n".join([*lines, check_.get("note", ""), ""])
    lines += [f"Overhead per lap {check_['overhead_ms_per_lap']} ms, fitted on "
              f"{check_['fitted_on']} only; tolerance ±{check_['tolerance']:.0%}.", "",
              "| link | mode | drafter | measured tok/s | predicted tok/s | error |",
              "|---|---|---|---:|---:|---:|"]
    for c in check_["rows"]:
        mark = " (fitted)" if c["fitted_on"] else ("" if c["within"] else " **out**")
        lines.append(f"| {c['link']} | {c['mode']} | {c['drafter']} | "
                     f"{c['measured_tok_s']:.2f} | {c['predicted_tok_s']:.2f} | "
                     f"{c['error']:+.0%}{mark} |")
    if projected:
        modes = list(dict.fromkeys(p["mode"] for p in projected))
        lines += ["", "### PROJECTION to named devices (modelled, not measured)", "",
                  "Each device's whole-model decode time from its public llama.cpp figure "
                  "(sources below) scaled by model bytes, layers split evenly; a CPU's lap of r "
                  "rows costs what r rows cost here (bench/results/row_cost_curve.json), a "
                  "GPU's one row's up to 16 rows; acceptance, laps, steps and drafting per "
                  "token as measured on the lab above (a 1.5B target drafted by a 0.5B); the "
                  "lab's overhead per lap. A model fits where its share is at most 80% of a "
                  "device's memory.", "",
                  "| ring | model | link | " + " | ".join(modes) + " |",
                  "|---|---|---|" + "---:|" * len(modes)]
        cells: dict[tuple, dict[str, str]] = {}
        for p in projected:
            v = "-" if not p["fits"] else f"{p['projected_tok_s']:.2f}"
            cells.setdefault((p["ring"], p["model"], p["link"]), {})[p["mode"]] = v
        for (ring, model, link), by in cells.items():
            if all(v == "-" for v in by.values()):
                v = "does not fit"
                lines.append(f"| {ring} | {model} | {link} | " + " | ".join(
                    [v] + [""] * (len(modes) - 1)) + " |")
                continue
            lines.append(f"| {ring} | {model} | {link} | "
                         + " | ".join(by.get(m, "") for m in modes) + " |")
        lines += ["", "Sources:", ""] + [f"- {k}: {v['source']}" for k, v in DEVICES.items()]
    return "\n".join(lines) + "\n"
