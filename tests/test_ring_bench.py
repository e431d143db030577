"""The ring benchmark and its lab, as a smoke run (seconds, a tiny model), so neither can rot:

- all-in-one: two stage processes on this host, one link profile, modes none and flow, one
  client and two at once; its report says ALL-IN-ONE, its greedy outputs agree, its rows
  carry the figures the README quotes (tokens/s, ratios, link bytes, gaps between pieces);
- the lab (root): two devices, each a network namespace on its own CPU share, the head on its
  own share, found over mDNS, every device behind the link emulator in a namespace of its
  own; its report says where it ran and what the emulator cost;
- the lap model's check and the lab's link counters on fixed inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from stage_fixtures import tiny_dir, tiny_qwen2  # noqa: F401

from bench import projection
from bench.testbed import LINKS, lab_skip_reason, link_label, link_spec, proxy_from_map

REPO = Path(__file__).resolve().parent.parent


def run_bench(args: list[str], out: Path, timeout: float = 600) -> dict:
    res = subprocess.run([sys.executable, "-m", "bench.ring_bench", "--smoke", "--out",
                          str(out), *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "ring_bench_smoke.jsonl").read_text().splitlines()]


def check_rows(rows: list[dict], reps: int = 1) -> None:
    by = {(r["mode"], r["clients"]): r for r in rows}
    assert set(by) >= {("none", 1), ("flow", 1), ("none", 2), ("flow", 2)}, sorted(by)
    for r in rows:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0, r
        assert r["x_none"] is not None
    assert by[("none", 1)]["x_none"] == 1.0
    # Every request of the two-client rows ran its whole answer and streamed it in pieces.
    assert by[("none", 2)]["tokens"] == reps * 2 * 8
    if reps > 1:  # the ratio's spread over the batches
        low, high = by[("flow", 2)]["x_none_range"]
        assert 0 < low <= by[("flow", 2)]["x_none"] <= high
    assert by[("none", 2)]["piece_gap_ms_p95"] >= by[("none", 2)]["piece_gap_ms_p50"] > 0
    # One-client rows count the activations crossing the stage link.
    assert by[("none", 1)]["bytes_per_token_per_stage_hop"] > 0


def test_all_in_one_smoke_runs_and_says_so(tiny_qwen2, tmp_path):  # noqa: F811
    summary = run_bench(["--where", "local", "--target", str(tiny_qwen2), "--client-reps",
                         "2", "--long-prompt", "48"], tmp_path)
    assert summary["where"] == "all-in-one"
    assert summary["all_divergences_near_ties"], summary
    rows = rows_of(tmp_path)
    check_rows(rows, reps=2)
    # The same two requests one after another, and the two at once measured against it.
    by = {(r["mode"], r["clients"]): r for r in rows}
    assert by[("none-seq", 2)]["tokens"] == 2 * 2 * 8
    assert by[("none", 2)]["x_seq"] == pytest.approx(
        by[("none", 2)]["tokens_per_s"] / by[("none-seq", 2)]["tokens_per_s"], rel=0.01)
    # A stream beside a 48-token prefill: its gaps before and during it.
    (long,) = summary["long_prefill"]
    assert long["streams"] == 1 and long["prefill_s"] > 0
    assert {"gap_ms_p95_with", "gap_ms_p95_without"} <= set(long)
    md = (tmp_path / "ring_bench_smoke.md").read_text()
    assert "ALL-IN-ONE" in md and "## Streams beside a long prefill" in md
    assert f"| {long['link']} | 1 | 48 | {long['prefill_s']:.1f} |" in md


@pytest.mark.netns
def test_lab_smoke_forms_over_mdns_on_cpu_shares(tiny_qwen2, tmp_path):  # noqa: F811
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    summary = run_bench(["--where", "lab", "--target", str(tiny_qwen2), "--links", "wifi",
                         "--device-share", "0.5", "--head-share", "0.9"], tmp_path)
    assert summary["where"] == "lab"
    rows = rows_of(tmp_path)
    check_rows(rows)
    # Several clients at once: how busy each device was, read off its cgroup.
    several = [r for r in rows if r["clients"] > 1]
    assert several and all(set(r["device_busy"]) == {"n1", "n2"} for r in several), several
    assert all(v > 0 for r in several for v in r["device_busy"].values())
    settings = json.loads((tmp_path / "ring_bench_smoke_settings.json").read_text())
    assert settings["where"]["devices"] == 2 and settings["where"]["cfs_period_us"] == 4_000
    emu = settings["emulator"]["ring/wifi/retrieval"]
    assert emu["spec"]["bandwidth_mbps"] == 50.0 and emu["cpu_s"] >= 0
    # Each device ran on its share: the kernel throttled it, or it never used a period fully.
    for name in ("n1", "n2"):
        assert settings["device_cpu"]["ring/wifi/retrieval"][name].get("nr_periods", 0) > 0
    md = (tmp_path / "ring_bench_smoke.md").read_text()
    assert "Where: **lab: 2 devices at 50% of a core" in md


def test_link_profiles():
    assert link_spec("wifi") == LINKS["wifi"]
    assert link_spec("12.5").delay_ms == 12.5
    assert link_label("wifi") == "5 ms, ±2 ms jitter, 50 Mbit/s"
    with pytest.raises(ValueError, match="unknown link 'lan'"):
        link_spec("lan")
    proxy = proxy_from_map({"10.0.0.2": ["10.0.0.9", 7101]})
    assert proxy(("10.0.0.2", 7654)) == ("10.0.0.9", 7101)
    assert proxy(("10.0.0.3", 7654)) == ("10.0.0.3", 7654)


def _row(mode: str, link: str, tok_s: float, stage_ms: list[float], **kw) -> dict:
    return {"mode": mode, "link": link, "clients": 1, "drafter": "-", "budget": "-",
            "tokens": 64, "tokens_per_s": tok_s, "bytes_per_token": {"s0->s1": 0},
            "lap_timing": {"lap_ms": 0.0, "stages": [{"compute_ms": m} for m in stage_ms]},
            **kw}


def test_lap_model_fits_overhead_once_and_predicts_the_rest():
    # 3 stages of 100 ms: none on 1 ms links ran at 1000 / 330 tok/s, so the overhead is
    # 330 - 300 - 4 x 1 = 26 ms per lap; on 50 ms links the model says 300 + 200 + 26.
    rows = [_row("none", "wired", 1000 / 330, [100] * 3),
            _row("none", "sites", 1000 / 526, [100] * 3),
            # flow: a step is one lap for its first segment, 0.5 x (360 + 200 + 26), and
            # each further segment enters at the busiest stage's pace, (1.5 - 0.5) x 120
            # (drafting, 0.5 x 40 ms a token over 1.5 laps, is quicker): 413 ms a token.
            _row("flow", "sites", 1000 / 413, [120] * 3, laps_per_token=1.5,
                 steps_per_token=0.5, draft_ms_per_step=40.0)]
    got = projection.check(rows, link_spec)
    assert got["overhead_ms_per_lap"] == pytest.approx(26, abs=0.01)
    by = {(c["mode"], c["link"]): c for c in got["rows"]}
    assert by[("none", "wired")]["fitted_on"]
    assert by[("none", "sites")]["error"] == pytest.approx(0, abs=0.002)
    assert by[("flow", "sites")]["predicted_tok_s"] == pytest.approx(1000 / 413, rel=0.01)
    assert got["all_within"]
    # A measurement the model cannot explain is flagged, not hidden.
    rows[1]["tokens_per_s"] = 1000 / 800
    assert not projection.check(rows, link_spec)["all_within"]
