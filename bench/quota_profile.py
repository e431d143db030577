"""What the node profile measures on a device held by a CFS quota: ms per layer inside a real
CPU cgroup (``quota``/``period``) against the same profile unrestricted, as a ratio (a quarter
of a core should read about 4x), with the profile reading the quota and, for comparison,
blind to it (wall time over 0.5 s alone).

    .venv/bin/python -m bench.quota_profile --quota-us 250000 --period-us 1000000 --reps 3
    .venv/bin/python -m bench.quota_profile --smoke    # seconds: a tiny model, 1 rep (root)

Needs root and a writable cgroup hierarchy (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``). Each
profile runs in a fresh process (``node/profiling.profile_layers``, one thread, batch sizes 1
and 4) that moves itself into the cgroup before importing llama.cpp. Output: JSON on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from bench.ring_bench import machine_info

CHILD = r"""
import json, os, sys
if sys.argv[2]:
    open(sys.argv[2] + "/cgroup.procs", "w").write(str(os.getpid()))
from edgespec.node import info
if sys.argv[4] == "blind":
    info.cpu_quota = lambda *a, **k: None
from edgespec.node.profiling import profile_layers
print(json.dumps(profile_layers(sys.argv[1], cache_dir=sys.argv[3], n_threads=1,
                                batch_sizes=(1, 4))["ms_per_layer"]))
"""


def cpu_cgroup(quota_us: int, period_us: int) -> Path:
    name = f"edgespec-bench-{uuid.uuid4().hex[:8]}"
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
        where = v2 / name
        where.mkdir()
        (where / "cpu.max").write_text(f"{quota_us} {period_us}")
    else:
        where = Path("/sys/fs/cgroup/cpu") / name
        where.mkdir()
        (where / "cpu.cfs_period_us").write_text(str(period_us))
        (where / "cpu.cfs_quota_us").write_text(str(quota_us))
    return where


def profile(model: Path, cgroup: Path | None, cache: Path, mode: str) -> dict[str, float]:
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    out = subprocess.run([sys.executable, "-c", CHILD, str(model), str(cgroup or ""),
                          str(cache), mode], capture_output=True, text=True, env=env,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--quota-us", type=int, default=25_000)
    ap.add_argument("--period-us", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: a tiny model (unless --model), 1 rep")
    args = ap.parse_args(argv)
    if args.smoke:
        from bench import smoke

        smoke.apply(ap, args, model=smoke.tiny_model, reps=1)

    from edgespec.llm import models

    model = models.ensure(args.model)
    cache = models.home() / "shards"
    free = profile(model, None, cache, "reads")
    runs: dict[str, list[dict[str, float]]] = {"reads": [], "blind": []}
    for rep in range(args.reps):
        for mode in (("reads", "blind") if rep % 2 == 0 else ("blind", "reads")):
            where = cpu_cgroup(args.quota_us, args.period_us)
            try:
                held = profile(model, where, cache, mode)
            finally:
                with contextlib.suppress(OSError):
                    os.rmdir(where)
            runs[mode].append({b: round(held[b] / free[b], 2) for b in held})
            print(mode, runs[mode][-1], file=sys.stderr)
    result: dict[str, Any] = {
        "benchmark": "quota_profile", "model": model.name, "quota_us": args.quota_us,
        "period_us": args.period_us, "expected_ratio": round(args.period_us / args.quota_us, 2),
        "free_ms_per_layer": free, "ratio_reading_quota": runs["reads"],
        "ratio_blind_to_quota": runs["blind"], "machine": machine_info()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
