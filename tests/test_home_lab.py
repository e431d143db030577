"""The devices people own, as a home lab in a box (``tests/lab.py``): devices, each a network
namespace on one bridge with its own memory cap and CPU quota (cgroups), its own
EDGESPEC_HOME and an `edgespec node`; a head in a namespace of its own forms the ring over
mDNS. The real Qwen2.5-Coder-0.5B (its unsplit process peaks at about 630 MiB here).

- A device capped below the size of the window it cuts writes the shard without ever reaching
  its limit, and profiles the model in it (the writer drops the page cache it fills, and the
  profile loads two middle layers, not the embeddings).
- A device capped at 1.3x what the planner counts for its window (the first, a middle one, the
  last) profiles, cuts and runs it at the ring's context and sequences (the first window
  holds a logits buffer and a head copied from the embeddings that it never uses: counted).
- A ring of three: n1 held to 25% of a core, n2 capped at 200 MiB (the unsplit model under
  that cap is killed), n3 with room for the last window (its output head and logits buffer
  for 256 sequences): the slow device gets proportionally fewer layers than the full-speed
  one, the small one only what fits, nobody is killed, and greedy tokens equal the unsplit
  model's. n3 restarted rejoins on `ring rebalance`, and the answer is unchanged.

Each device's peak memory (its cgroup's, page cache included) and layer count are printed for
the record. Skipped, with the reason, where a lab cannot be built (not root, no `ip` or
`nsenter`, no writable cgroup hierarchy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import lab as homelab
import pytest
from ring_fixtures import unsplit_greedy
from test_ring_netns import HEAD_SCRIPT

from edgespec.wire import auth

pytestmark = [pytest.mark.real_model, pytest.mark.netns]

N_TOKENS = 16
PROMPT = "def fibonacci(n):\n"
SMALL = 200  # MiB: a few middle layers fit, the unsplit model (about 630 MiB) does not
CUT_CAP = 192  # MiB: below the last ten layers' shard (329 MB) it cuts
UNSPLIT = """
import sys
from edgespec.node.runtime import StageRuntime
import numpy as np
rt = StageRuntime(sys.argv[1], n_ctx=4096, n_seq_max=1, n_threads=1)
rt.forward(np.arange(8, dtype=np.int32) + 100, np.arange(8, dtype=np.int32), [[0]] * 8)
print("loaded")
"""
CUT_AND_PROFILE = """
import sys
from edgespec.llm.gguf_read import read_info
from edgespec.llm.shards import cut_window
from edgespec.node.profiling import profile_layers
model, out = sys.argv[1], sys.argv[2]
profile_layers(model, cache_dir=out, n_threads=1, batch_sizes=(1,), sustain_s=0.1)
n = read_info(model).n_layer
print(cut_window(model, (n - 10, n), out + "/last.gguf").stat().st_size)
"""
WINDOW = """
import sys
import numpy as np
from edgespec.llm.shards import cut_window
from edgespec.node.profiling import profile_layers
from edgespec.node.runtime import StageRuntime
model, out, a, b = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
profile_layers(model, cache_dir=out, n_threads=1, batch_sizes=(1,), sustain_s=0.1)
rt = StageRuntime(cut_window(model, (a, b), f"{out}/w.gguf"), n_ctx=4096, n_seq_max=256,
                  n_threads=1)
x = (np.arange(16, dtype=np.int32) + 100 if rt.is_first
     else np.random.default_rng(0).standard_normal((16, rt.n_embd)).astype(np.float32))
rt.forward(x, np.arange(16, dtype=np.int32), [[0]] * 16)
print("ran")
"""


@pytest.fixture(scope="session")  # before the real model's (session) fixture fetches it
def lab_ok() -> None:
    reason = homelab.skip_reason()
    if reason:
        pytest.skip(reason)


def _capped_run(cap_mib: int, argv: list[str], env: dict[str, str] | None = None,
                ) -> tuple[subprocess.CompletedProcess[str], int, int]:
    """``argv`` run in a cgroup of its own capped at ``cap_mib``: (result, peak MiB, OOM kills)."""
    probe = homelab.Cgroup(f"edgespec-lab-probe-{uuid.uuid4().hex[:6]}")
    try:
        probe.cap(memory_mib=cap_mib)
        res = subprocess.run(probe.wrap(argv), capture_output=True, text=True, timeout=300,
                             env=None if env is None else {**os.environ, **env})
        return res, probe.peak_mib(), probe.oom_kills()
    finally:
        probe.close()


def test_a_capped_device_cuts_and_profiles_within_its_cap(lab_ok, real_model_path, tmp_path):
    res, peak, kills = _capped_run(CUT_CAP, [sys.executable, "-c", CUT_AND_PROFILE,
                                             str(real_model_path), str(tmp_path)])
    assert res.returncode == 0 and kills == 0, res.stderr[-2000:]
    size_mib = int(res.stdout.split()[-1]) >> 20
    print(f"cut {size_mib} MiB and profiled under a {CUT_CAP} MiB cap: peak {peak} MiB")
    assert size_mib > CUT_CAP
    # Never at the limit: no page had to be reclaimed for it, let alone a process killed.
    assert 0 < peak < CUT_CAP, peak


@pytest.mark.parametrize("window", [(0, 6), (3, 9), (14, 24)], ids=["first", "middle", "last"])
def test_a_device_capped_near_its_window_cuts_profiles_and_runs_it(lab_ok, real_model_path,
                                                                  tmp_path, window):
    """Capped at 1.3x what the planner counts for the window (the process itself included),
    a device profiles, cuts the window and runs it at the ring's n_ctx and sequences."""
    from edgespec.head.memory import model_memory, window_need

    a, b = window
    need = window_need(model_memory(real_model_path), a, b, n_ctx=4096, n_seq_max=256)
    cap = int(1.3 * need) >> 20
    res, peak, kills = _capped_run(cap, [sys.executable, "-c", WINDOW, str(real_model_path),
                                         str(tmp_path), str(a), str(b)])
    print(f"window {a}:{b}, planned {need >> 20} MiB, cap {cap} MiB: peak {peak} MiB")
    assert res.returncode == 0 and kills == 0 and "ran" in res.stdout, res.stderr[-2000:]


def _layers(lab: homelab.HomeLab) -> dict[str, int]:
    state = json.loads((lab.head_home / "ring.json").read_text())
    names = [n["name"] for n in state["nodes"]]
    out = dict.fromkeys(names, 0)
    for _stage, node, a, b in state["plan"]["windows"]:
        out[names[node]] += b - a
    return out


def _answer(lab: homelab.HomeLab) -> tuple[list[int], list[int]]:
    res = lab.head_run([sys.executable, "-c", HEAD_SCRIPT, PROMPT, str(N_TOKENS)], timeout=300)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return out["prompt_ids"], out["tokens"]


def _record(lab: homelab.HomeLab) -> dict[str, dict[str, int]]:
    layers = _layers(lab)
    return {n: {"layers": layers.get(n, 0), "peak_mib": d.cgroup.peak_mib()}
            for n, d in lab.devices.items()}


def _all_alive(lab: homelab.HomeLab) -> bool:
    return all(d.node is not None and d.node.poll() is None and d.cgroup.oom_kills() == 0
               for d in lab.devices.values())


def test_a_home_lab_of_a_slow_and_a_small_device(lab_ok, real_model_path, tmp_path):
    model = Path(real_model_path).resolve()
    key_file = auth.write_key(tmp_path / "ring.key")
    with homelab.HomeLab(["n1", "n2", "n3"], tmp_path) as lab:
        slow, small, big = (lab.device(n) for n in ("n1", "n2", "n3"))
        slow.cap(memory_mib=900, cpu_share=0.25)
        small.cap(memory_mib=SMALL)
        big.cap(memory_mib=900)
        lab.start_nodes(key_file)
        plan = lab.head_run([*homelab.edgespec(), "ring", "up", "--model", str(model), "--nodes",
                             "auto", "--expect", "3", "--timeout", "60", "--key-file",
                             str(key_file)], timeout=300).stdout
        layers = _layers(lab)
        prompt_ids, tokens = _answer(lab)
        record = {"up": _record(lab)}
        assert _all_alive(lab), (record, plan)
        assert tokens == unsplit_greedy(model, prompt_ids, N_TOKENS)
        # 4x slower: well under half as many; not a quarter, since the last device also
        # runs the output head, which the planner counts as layers (docs/design.md 5.3).
        assert layers["n1"] * 1.5 < layers["n3"], plan
        assert layers["n2"] < layers["n3"], plan  # as fast, but only what fits in its cap

        # The unsplit model under the small device's cap is killed, read into memory as it
        # must be to run at speed (mapped, it would re-read its weights from disk every token).
        res, _, kills = _capped_run(SMALL, [sys.executable, "-c", UNSPLIT, str(model)],
                                    env={"EDGESPEC_MMAP": "0"})
        assert res.returncode != 0 and "loaded" not in res.stdout and kills >= 1, res.stderr

        # A device restarted rejoins.
        big.stop_node()
        big.start_node(key_file, tmp_path)
        lab.head_run([*homelab.edgespec(), "ring", "rebalance", "--key-file", str(key_file)],
                     timeout=300)
        record["rebalanced"] = _record(lab)
        assert sum(_layers(lab).values()) == 24 and len(_layers(lab)) == 3
        assert _answer(lab)[1] == tokens
        assert _all_alive(lab), record
    print("home lab:", json.dumps(record))
