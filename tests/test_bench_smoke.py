"""Every benchmark kept in bench/ runs in its smoke mode (``--smoke``: a tiny model, seconds)
as a user would start it, ``python -m bench.X --smoke``, and reports what its full run
reports: the fields exist, counts are the ones asked for, greedy answers agree. No figure is
judged (tests never time anything); a benchmark that no longer runs against today's code, or
drops a field, fails here. The ring benchmark has its own tests (test_ring_bench.py).

One tiny target and one tiny draft model serve the whole file; every run gets an
EDGESPEC_HOME of its own (shards, quantized copies) and writes into a temporary folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lab as homelab
import pytest
from tinygguf import make_tiny_gguf

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Iterator[dict[str, str]]:
    """Two tiny models and the benchmarks' home, removed when the module ends (the real
    model's windows some benchmarks cut there: 0.6 GB)."""
    d = tmp_path_factory.mktemp("bench-smoke")
    yield {"target": str(make_tiny_gguf(d / "target.gguf", "qwen2", n_layer=4, n_embd=64,
                                        seed=3)),
           "draft": str(make_tiny_gguf(d / "draft.gguf", "qwen2", n_layer=2, n_embd=64,
                                       seed=4)),
           "home": str(d / "home")}
    shutil.rmtree(d, ignore_errors=True)


def bench(tiny: dict[str, str], name: str, *args: str, timeout: float = 180) -> str:
    """``python -m bench.<name> --smoke <args>`` from the repository root; its stdout."""
    env = dict(os.environ, EDGESPEC_HOME=tiny["home"], OMP_WAIT_POLICY="passive")
    res = subprocess.run([sys.executable, "-m", f"bench.{name}", "--smoke", *args], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"bench.{name} exited {res.returncode}:\n{res.stderr[-3000:]}"
    return res.stdout


def last_json(text: str) -> Any:
    """The JSON object a benchmark prints (it may print a line or two before it)."""
    return json.loads(text[text.index("{"):])


def needs_lab() -> None:
    reason = homelab.skip_reason()
    if reason:
        pytest.skip(reason)


def test_core_bench(tiny) -> None:
    out = last_json(bench(tiny, "core_bench"))
    assert out["tree"]["rows"] == 256 and out["tree"]["reps"] == 10
    assert 1 <= out["tree"]["accepted_path_rows"] <= 256
    assert {"build_511_candidates", "select_255", "order", "verify_stepwise_and_prune",
            "commit_plan", "total"} <= set(out["tree_ops_us"])
    assert all(v > 0 for v in out["tree_ops_us"].values())
    assert {"argmax_64_rows", "verify_whole_tree_greedy_from_logits"} <= set(
        out["logits_scan_us"])
    assert set(out["goals"]) == {"tree_ops_total_le_100us", "argmax_64_rows_le_5ms"}


def test_transport_bench(tiny) -> None:
    out = last_json(bench(tiny, "transport_bench"))
    assert (out["laps"], out["rounds"]) == (20, 2)
    for hop in ("one_token_hop", "tree64_hop"):
        h = out[hop]
        assert h["frame_bytes_sealed"] > h["frame_bytes_plain"] > 0  # the AEAD tag
        for k in ("bare_tcp_us", "sealed_forward_us", "plain_forward_us",
                  "sealed_decode_encode_us", "plain_decode_encode_us"):
            assert h[k]["median"] > 0, (hop, k)
        assert "sealing_cost_forward_us" in h and h["aead_seal_and_open_us"] > 0
        inplace = h["open_copy_vs_in_place"]
        assert inplace["fresh_buffer_us"] > 0
        assert inplace["in_place_us"] or inplace["in_place_refused"]
    for key, row in out["bytes_per_token_per_hop"].items():
        assert row["q8"] < row["f16"] < row["f32"], key
    for key, err in out["quantization_error"].items():
        assert err["f16"]["rel_rms"] <= err["q8"]["rel_rms"] < 0.05, key
        assert err["q8"]["cosine_min"] > 0.999, key


def test_drafter_bench(tiny) -> None:
    out = last_json(bench(tiny, "drafter_bench", "--model", tiny["draft"]))
    assert out["settings"]["model_path"] == tiny["draft"]
    rows = {(r["drafter"], r.get("draft_quant")): r for r in out["results"]}
    assert set(rows) == {("retrieval", None), ("draft_model", "none"), ("hybrid", "none"),
                         ("draft_model", "q4_0"), ("hybrid", "q4_0")}
    for key, r in rows.items():
        assert r["budget"] == 8 and r["steps"] > 0, key
        assert r["accepted_per_round"] >= 1, key  # the bonus token at least
        assert r["nodes_per_proposal"] <= 8, key
    for key in (("draft_model", "none"), ("draft_model", "q4_0")):
        assert rows[key]["steps"] == 4 and rows[key]["nodes_per_proposal"] == 8
    assert set(out["draft_model_single_token_step_ms"]) == {"none", "q4_0"}


def test_ttft_bench(tiny, tmp_path) -> None:
    path = tmp_path / "ttft.json"
    summary = last_json(bench(tiny, "ttft_bench", "--target", tiny["target"], "--out",
                              str(path)))
    out = json.loads(path.read_text())
    assert [(r["mode"], r["rep"]) for r in out["alone"]] == [("none", 0), ("flow", 0)]
    assert [(r["mode"], r["busy"]) for r in out["busy"]] == [("none", 1), ("flow", 1)]
    for r in out["alone"] + out["busy"]:
        assert r["ttft_s"] > 0
    for r in out["busy"]:
        assert r["others_tok_s_before"] > 0  # the busy client decoded before the long prompt
        assert r["others_max_gap_s"] > 0
    assert set(summary) == {f"{p}_{m}_ttft_s_median" for p in ("alone", "busy")
                            for m in ("none", "flow")} | {
        f"busy_{m}_{k}" for m in ("none", "flow")
        for k in ("others_max_gap_s_median", "others_tok_s_during_vs_before")}


def test_device_memory(tiny, tmp_path) -> None:
    out = last_json(bench(tiny, "device_memory", "--model", tiny["target"], "--out",
                          str(tmp_path)))
    assert json.loads((tmp_path / "device_memory.json").read_text()) == out
    assert (out["stages"], out["n_ctx"]) == (2, 1024)
    assert [w["window"] for w in out["windows"]] == ["0:4", "0:2", "2:4"]
    for w in out["windows"]:
        for how in ("mapped", "read"):
            m = w[how]
            assert m["peak_mib"] >= m["anon_mib"] > 0, (w["window"], how)
            assert m["load_s"] >= 0 and m["idle_mib"] > 0


def test_row_cost_curve(tiny, tmp_path) -> None:
    out = last_json(bench(tiny, "row_cost_curve", "--target", tiny["target"], "--draft",
                          tiny["draft"], "--out", str(tmp_path)))
    assert json.loads((tmp_path / "row_cost_curve.json").read_text()) == out
    assert [c["window"] for c in out["curves"]] == [
        "target stage 1 of 4, layers 1-2", "target stage 3 of 4, layers 3-4",
        "draft model (drafting copy)"]
    assert out["curves"][2]["file"].endswith(".q4_0.gguf")  # the copy rings draft with
    for c in out["curves"]:
        assert list(c["ms"]) == [str(r) for r in range(1, 7)]
        assert all(v >= 0 for v in c["ms"].values())


def test_lab_ceiling(tiny, tmp_path) -> None:
    out = last_json(bench(tiny, "lab_ceiling", "--target", tiny["target"], "--users", "2",
                          "--out", str(tmp_path)))
    assert json.loads((tmp_path / "lab_ceiling_users2.json").read_text()) == out
    assert out["cgroups"] == (homelab.skip_reason() is None)  # a share where one can be made
    assert [w["window"] for w in out["windows"]] == ["0:2", "2:4"] and out["users"] == 2
    for w in out["windows"]:
        for phase in ("alone", "together"):
            assert set(w[phase]) == {"decode", "chunk"}, w
            assert all(v["wall_ms"] > 0 and v["cpu_ms"] >= 0 for v in w[phase].values())
        assert set(w["slowdown"]) == {"decode", "chunk"}
    assert out["decode_ms_together_max"] == max(w["together"]["decode"]["wall_ms"]
                                                for w in out["windows"])


def test_structured_bench(tiny, tmp_path) -> None:
    """Tiny models: every part runs and constrained answers agree across modes (a random
    model never closes a schema in 24 tokens: validity is the real model's test below)."""
    path = tmp_path / "structured.json"
    out = last_json(bench(tiny, "structured_bench", "--target", tiny["target"], "--draft",
                          tiny["draft"], "--out", str(path)))
    assert path.with_suffix(".md").is_file()
    assert [(r["kind"], r["mode"]) for r in out["runs"]] == [
        ("json", "none"), ("json", "sync"), ("json", "flow"), ("free", "none"),
        ("free", "flow")]
    for r in out["runs"]:
        assert 0 < r["n_tokens"] <= 24 and r["tokens_per_s"] > 0
    assert all("drafter" in r for r in out["runs"] if r["kind"] == "json" and r["mode"] != "none")
    for ident in out["ring"]["identity"]:  # float32 weights: no near-tie to part at
        assert not ident["parted"], ident
    forced = out["forced"]["summary"]
    assert forced["answers"] == 1 and 0 <= forced["share_mask_single"] <= 1
    assert [s["rows"] for s in out["micro"]["sizes"]] == [1, 16]
    for s in out["micro"]["sizes"]:
        assert s["trees"] == 2 and s["us_per_row_constrained"] > 0


@pytest.mark.real_model
def test_structured_bench_answers_are_valid(tiny, real_model_path, tmp_path) -> None:
    """The real 0.5B: every constrained answer parses and passes its schema, in none and flow,
    and where flow parts from none it is at a near-tie."""
    out = last_json(bench(tiny, "structured_bench", "--target", str(real_model_path),
                          "--draft", "", "--modes", "none,flow", "--free-modes", "none",
                          "--max-tokens", "96", "--parts", "ring", "--out",
                          str(tmp_path / "s.json"), timeout=300))
    json_runs = [r for r in out["runs"] if r["kind"] == "json"]
    assert [r["mode"] for r in json_runs] == ["none", "flow"]
    for r in json_runs:
        assert r["json_ok"] and r["schema_ok"], r["text"]
    for ident in out["ring"]["identity"]:
        assert all(p["near_tie"] for p in ident["parted"]), ident


@pytest.mark.netns
def test_quota_profile(tiny) -> None:
    needs_lab()
    out = last_json(bench(tiny, "quota_profile", "--model", tiny["target"]))
    assert out["expected_ratio"] == 4.0
    assert set(out["free_ms_per_layer"]) == {"1", "4"}
    for key in ("ratio_reading_quota", "ratio_blind_to_quota"):
        assert len(out[key]) == 1 and set(out[key][0]) == {"1", "4"}, out[key]
        assert all(v > 0 for v in out[key][0].values())


@pytest.mark.netns
def test_home_lab(tiny, tmp_path) -> None:
    needs_lab()
    path = tmp_path / "home_lab.json"
    out = last_json(bench(tiny, "home_lab", "--model", tiny["target"], "--out", str(path),
                          timeout=400))
    assert path.with_suffix(".md").is_file()
    assert out["unsplit_reference"]["tokens"] == out["unsplit_reference_ring_shape"]["tokens"]
    assert [s["scenario"] for s in out["scenarios"]] == ["c"]
    for s in out["scenarios"]:
        assert s["ring_up"]["ok"], s["ring_up"]
        assert s["exact"] or s["near_tie"], s
        assert not s["any_oom_killed"]
        assert sum(d["layers"] for d in s["devices"].values()) == 4  # every layer placed
    pve = out["scenarios"][0]["planned_vs_even"]
    assert pve["even_ring_up"]["ok"] and pve["even_ranges"] == "0:2,2:3,3:4"
    assert [m["mode"] for m in pve["summary"]] == ["none", "flow"]
    for m in pve["summary"]:
        assert m["tokens_each"] == 8 and m["same_tokens"] == "1/1", m
        assert m["planned_tok_s"] > 0 and m["even_tok_s"] > 0


def test_sampling_bytes(tiny) -> None:
    out = last_json(bench(tiny, "sampling_bytes"))
    assert out["tokens"] >= 30 and set(out["bytes_per_lap"]) == {"5", "25"}
    assert all(v > 0 for v in out["bytes_per_lap"].values()) and out["late_over_early"] > 0
