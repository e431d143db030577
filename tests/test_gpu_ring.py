"""A ring of two `edgespec node` processes on loopback, one on the CPU build (the CPU venv's
python) and one on the GPU build (this venv: its windows offloaded by default), brought up with
`edgespec ring up`: `ring status` shows each node's backend and device, and the greedy output
in every mode equals the unsplit model's on the CPU, or parts from it only at a near-tie of the
unsplit model's logits (``assert_same_greedy``: the GPU's float reorderings move logits by
up to the tolerance of test_gpu_stage.py).

Run from the GPU venv (``.venv-vulkan/bin/pytest -m gpu``); the CPU node's python is
``$EDGESPEC_CPU_PYTHON``, else the repository's ``.venv/bin/python``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from ring_fixtures import assert_same_greedy, unsplit_greedy

from edgespec.api import Ring
from edgespec.wire.auth import write_key

pytestmark = [pytest.mark.gpu, pytest.mark.real_model]

ROOT = Path(__file__).resolve().parent.parent
CPU_PYTHON = Path(os.environ.get("EDGESPEC_CPU_PYTHON", ROOT / ".venv" / "bin" / "python"))
LISTEN = re.compile(r"edgespec node \S+ \((\S+)\) on ([\d.]+):(\d+)")
PROMPTS = ["def quicksort(arr):\n",
           "colors = ['red', 'green', 'blue', 'red', 'green', 'blue', 'red', 'green',"]
N = 24


def _cpu_build(python: Path) -> bool:
    out = subprocess.run([str(python), "-c", "import llama_cpp; "
                          "print(llama_cpp.llama_supports_gpu_offload())"],
                         capture_output=True, text=True, timeout=120)
    return out.returncode == 0 and out.stdout.strip() == "False"


def _start_node(python: Path, name: str, key: Path, env: dict, log: Path,
                extra: tuple[str, ...] = ()) -> tuple:
    cmd = [str(python), "-m", "edgespec", "node", "--port", "0", "--bind", "127.0.0.1",
           "--no-mdns", "--name", name, "--key-file", str(key), "--threads", "1", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env,
                         start_new_session=True)
    lines: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = p.stdout.readline() if p.stdout else ""
        if not line and p.poll() is not None:
            raise RuntimeError(f"node {name} exited: {log.read_text()[-2000:]}")
        lines.append(line)
        m = LISTEN.search(line)
        if m:
            break
    else:
        raise RuntimeError(f"node {name} did not start")
    lines.append(p.stdout.readline())  # what it offloads

    def drain() -> None:
        for extra in p.stdout:
            lines.append(extra)

    threading.Thread(target=drain, daemon=True).start()
    return p, (m.group(2), int(m.group(3))), lines


@pytest.fixture(scope="module")
def mixed_ring(real_model_path, tmp_path_factory):
    if not CPU_PYTHON.is_file():
        pytest.skip(f"no CPU venv python at {CPU_PYTHON} (set EDGESPEC_CPU_PYTHON)")
    if not _cpu_build(CPU_PYTHON):
        pytest.skip(f"{CPU_PYTHON} is not a CPU-only llama.cpp build")
    tmp = tmp_path_factory.mktemp("mixed")
    env = {**os.environ, "EDGESPEC_HOME": str(tmp / "home"), "OMP_WAIT_POLICY": "passive"}
    env.pop("EDGESPEC_KEY_FILE", None)
    key = write_key(tmp / "ring.key")
    procs = []
    try:
        cpu, cpu_addr, cpu_out = _start_node(CPU_PYTHON, "cpu-node", key, env, tmp / "cpu.log")
        procs.append(cpu)
        # lavapipe is a software device, which a node leaves alone unless told: all of the
        # window's layers and its head on it, as on a real GPU by default.
        gpu, gpu_addr, gpu_out = _start_node(Path(sys.executable), "gpu-node", key, env,
                                             tmp / "gpu.log", ("--n-gpu-layers", "99"))
        procs.append(gpu)
        nodes = ",".join(f"{h}:{p}" for h, p in (cpu_addr, gpu_addr))
        cli = [sys.executable, "-m", "edgespec"]
        up = subprocess.run([*cli, "ring", "up", "--model", str(real_model_path), "--nodes",
                             nodes, "--no-profile", "--ctx", "1024", "--key-file", str(key)],
                            capture_output=True, text=True, timeout=600, env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        status = subprocess.run([*cli, "ring", "status", "--key-file", str(key)],
                                capture_output=True, text=True, timeout=120, env=env)
        status_json = subprocess.run([*cli, "ring", "status", "--json", "--key-file", str(key)],
                                     capture_output=True, text=True, timeout=120, env=env)
        assert status_json.returncode == 0, status_json.stderr
        old = os.environ.get("EDGESPEC_HOME")
        os.environ["EDGESPEC_HOME"] = env["EDGESPEC_HOME"]
        try:
            with Ring.attach(key=str(key), spec="none") as ring:
                yield {"ring": ring, "status": status.stdout,
                       "view": json.loads(status_json.stdout), "said": cpu_out + gpu_out}
        finally:
            if old is None:
                os.environ.pop("EDGESPEC_HOME", None)
            else:
                os.environ["EDGESPEC_HOME"] = old
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_ring_status_shows_each_nodes_backend_and_device(mixed_ring) -> None:
    print("\n" + mixed_ring["status"])
    said = "".join(mixed_ring["said"])
    assert "no GPU device (llama.cpp backend: cpu)" in said  # the CPU node says so at start
    assert re.search(r"vulkan device Vulkan0: .*; offloading --n-gpu-layers 99 per window",
                     said), said
    by_name = {n["name"]: n for n in mixed_ring["view"]["nodes"]}
    assert by_name["cpu-node"]["backend"] == "cpu" and by_name["cpu-node"]["device"] is None
    gpu = by_name["gpu-node"]
    assert gpu["backend"] == "vulkan" and gpu["device"].startswith("Vulkan0")
    assert gpu["unified"] or 0 < gpu["free_vram"] <= gpu["total_vram"]
    stages = {s["node"]: s for s in mixed_ring["view"]["stages"]}
    assert stages["cpu-node"]["gpu_layers"] == 0
    assert stages["gpu-node"]["gpu_layers"] == 99  # every layer of its window, and its head
    assert "vulkan" in mixed_ring["status"] and "Vulkan0" in mixed_ring["status"]


@pytest.mark.parametrize("mode", ["none", "sync", "flow"])
def test_cpu_plus_gpu_ring_equals_the_unsplit_model(mixed_ring, real_model_path,
                                                    mode: str) -> None:
    ring = mixed_ring["ring"]
    for prompt in PROMPTS:
        ring.reset()
        got = ring.generate(prompt, max_tokens=N, spec=mode).tokens
        ids = ring.tokenizer.encode(prompt)
        ref = unsplit_greedy(real_model_path, ids, N)
        same = sum(1 for a, b in zip(got, ref, strict=False) if a == b)
        print(f"\n{mode}: {prompt!r}: {same}/{N} tokens as the unsplit model")
        assert len(got) == N
        assert_same_greedy(got, ref, real_model_path, ids, f"CPU+Vulkan ring, {mode}")
