"""The devices people own, as a home lab in a box (``tests/lab.py``): three devices, each a
network namespace on one bridge with its own memory cap and CPU quota (cgroups), its own
EDGESPEC_HOME and an `edgespec node`; a head in a fourth namespace forms the ring over mDNS.
The real Qwen2.5-Coder-0.5B (its unsplit process peaks at about 630 MiB here):

- two devices capped at 450 MiB and the one holding the output head at 700 MiB (the last
  window holds the head and a logits buffer for 256 sequences, about 600 MiB in all): the ring
  forms, nobody is killed, and greedy tokens equal the unsplit model's, while the unsplit
  model under the small devices' cap is killed;
- one device capped at 200 MiB and one held to 25% of a core: the small one gets only what
  fits, the slow one proportionally fewer layers than the full-speed one, nobody is killed,
  the answer is unchanged;
- a device restarted rejoins on `ring rebalance`.

Each device's peak memory (its cgroup's) and layer count are printed for the record.

Opt-in (``EDGESPEC_LAB=1``) while it does not pass: under a 520 MiB cap a node is killed while
it profiles or cuts its window (cutting reads the whole model file and writes the shard
inside the device's cgroup), before any window is loaded. Cutting within the cap is the next
step; the planner's estimate of a loaded window (weights, KV, compute buffers, the last
window's logits buffer) is what the cap scenarios then check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lab as homelab
import pytest
from ring_fixtures import unsplit_greedy
from test_ring_netns import HEAD_SCRIPT

from edgespec.wire import auth

pytestmark = [pytest.mark.real_model, pytest.mark.netns,
              pytest.mark.skipif(os.environ.get("EDGESPEC_LAB") != "1",
                                 reason="opt-in while capped devices are killed cutting their "
                                        "windows (see the module docstring): EDGESPEC_LAB=1")]

N_TOKENS = 16
CAP = 520  # MiB: below the unsplit model's peak (about 630 MiB), above a middle third's need
HEAD_CAP = 700  # MiB: the last window, its output head and logits buffer
PROMPT = "def fibonacci(n):\n"
UNSPLIT = """
import sys
from edgespec.node.runtime import StageRuntime
import numpy as np
rt = StageRuntime(sys.argv[1], n_ctx=4096, n_seq_max=1, n_threads=1)
rt.forward(np.arange(8, dtype=np.int32) + 100, np.arange(8, dtype=np.int32), [[0]] * 8)
print("loaded")
"""


@pytest.fixture(scope="module")
def lab_ok() -> None:
    reason = homelab.skip_reason()
    if reason:
        pytest.skip(reason)


def _peak_mib(d: homelab.Device) -> int:
    """The device's peak memory (its cgroup's, page cache included)."""
    c = d.cgroup.dirs[0]
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        with __import__("contextlib").suppress(OSError, ValueError):
            return int((c / name).read_text().split()[0]) >> 20
    return -1


def _layers(lab: homelab.HomeLab) -> dict[str, int]:
    state = json.loads((lab.head_home / "ring.json").read_text())
    names = [n["name"] for n in state["nodes"]]
    out = dict.fromkeys(names, 0)
    for _stage, node, a, b in state["plan"]["windows"]:
        out[names[node]] += b - a
    return out


def _answer(lab: homelab.HomeLab) -> tuple[list[int], list[int]]:
    res = lab.head_run([sys.executable, "-c", HEAD_SCRIPT, PROMPT, str(N_TOKENS)], timeout=600)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return out["prompt_ids"], out["tokens"]


def _ring_up(lab: homelab.HomeLab, model: Path, key_file: Path) -> str:
    return lab.head_run([*homelab.edgespec(), "ring", "up", "--model", str(model), "--nodes",
                         "auto", "--expect", "3", "--timeout", "60", "--key-file",
                         str(key_file)], timeout=900).stdout


def test_a_home_lab_of_capped_and_slow_devices(lab_ok, real_model_path, tmp_path):
    model = Path(real_model_path).resolve()
    key_file = auth.write_key(tmp_path / "ring.key")
    record: dict[str, dict] = {}
    with homelab.HomeLab(["n1", "n2", "n3"], tmp_path) as lab:
        devs = [lab.device(n) for n in ("n1", "n2", "n3")]
        # 1. Two devices capped below the unsplit model's peak, the last one with room for
        # the head's window.
        for d, cap in zip(devs, (CAP, CAP, HEAD_CAP), strict=True):
            d.cap(memory_mib=cap)
        lab.start_nodes(key_file)
        _ring_up(lab, model, key_file)
        prompt_ids, tokens = _answer(lab)
        ref = unsplit_greedy(model, prompt_ids, N_TOKENS)
        assert tokens == ref
        record[f"{CAP}/{CAP}/{HEAD_CAP}"] = {d.name: {"layers": _layers(lab)[d.name], "peak_mib":
                                          _peak_mib(d)} for d in devs}
        assert all(d.node.poll() is None and d.cgroup.oom_kills() == 0 for d in devs)
        # The unsplit model under the same cap is killed.
        probe = homelab.Cgroup(f"edgespec-lab-unsplit-{tmp_path.name[-6:]}")
        try:
            probe.cap(memory_mib=CAP)
            res = subprocess.run(probe.wrap([sys.executable, "-c", UNSPLIT, str(model)]),
                                 capture_output=True, text=True, timeout=300)
            assert res.returncode != 0 and "loaded" not in res.stdout, res.stderr[-2000:]
            assert probe.oom_kills() >= 1
        finally:
            probe.close()
        lab.head_run([*homelab.edgespec(), "ring", "down", "--key-file", str(key_file)])
        for d in devs:
            d.stop_node()

        # 2. A slow device (the first, 25% of a core) and a small one (the middle, 200 MiB).
        devs[0].cap(memory_mib=900, cpu_share=0.25)
        devs[1].cap(memory_mib=200)
        devs[2].cap(memory_mib=900)
        lab.start_nodes(key_file)
        plan = _ring_up(lab, model, key_file)
        layers = _layers(lab)
        assert _answer(lab)[1] == ref
        record["900@25%/200/900"] = {d.name: {"layers": layers[d.name], "peak_mib":
                                              _peak_mib(d)} for d in devs}
        assert all(d.node.poll() is None and d.cgroup.oom_kills() == 0 for d in devs), record
        assert layers["n1"] * 2 < layers["n3"], plan  # 4x slower: about a quarter as many
        assert layers["n2"] < layers["n3"], plan  # only what fits in 200 MiB

        # 3. A device restarted rejoins.
        devs[2].stop_node()
        devs[2].start_node(key_file, tmp_path)
        lab.head_run([*homelab.edgespec(), "ring", "rebalance", "--key-file", str(key_file)],
                     timeout=900)
        assert sum(_layers(lab).values()) == 24 and len(_layers(lab)) == 3
        assert _answer(lab)[1] == ref
    print("home lab:", json.dumps(record))
