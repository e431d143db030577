"""The soak (``bench/soak.py``) at its one-minute size: a lab of three devices serving six
clients through every door while faults from its schedule hit the ring; every check of its
report must hold (requests end within the bound, greedy answers equal, the ring serves again
within seconds of each fault, memory, descriptors and threads flat, /metrics equal to the
clients' counts). Needs root (network namespaces, cgroups); skipped otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lab as homelab
import pytest

REPO = Path(__file__).resolve().parents[1]


def test_a_minute_of_mixed_traffic_through_faults(real_model_path, tmp_path):
    reason = homelab.skip_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "soak.json"
    res = subprocess.run([sys.executable, "-m", "bench.soak", "--smoke", "--out",
                          str(out), "--workdir", str(tmp_path / "lab")], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert out.exists(), res.stderr[-4000:]
    report = json.loads(out.read_text())
    # Every check holds but the 5 s bound on serving again: that is a speed goal, which the
    # benchmark's long run keeps (docs/experiments.md 21), and timings on a host shared with
    # the rest of the test run are not. Each fault must still be followed by answers, in 30 s.
    failed = {k: v for k, v in report["checks"].items() if not v["ok"] and k != "serves_again"}
    assert not failed, json.dumps(failed, indent=1)[:6000]
    assert report["faults"], "no fault was injected"
    recoveries = [f.get("recovery_s") for f in report["faults"]]
    assert all(r is not None and r < 30 for r in recoveries), report["faults"]
    answered = sum(v.get("answer", 0) for v in report["requests"].values())
    assert answered >= 10, report["requests"]
    # Every kind of request ran, through every door.
    assert set(report["requests"]) >= {"chat", "stream", "schema", "tools", "cancel",
                                       "anthropic", "ollama", "responses"}, report["requests"]
