"""How fast the lab's devices compute when they all compute at once: the ceiling of any
schedule of a ring on the lab.

    .venv/bin/python -m bench.lab_ceiling              # ~2 min: the 1.5B target, 3 windows
    .venv/bin/python -m bench.lab_ceiling --smoke      # seconds: a tiny model

The lab (``tests/lab.py``) emulates each device by a CPU share of one host; the devices still
share that host's cores, caches and memory. Each window of ``--ranges`` is loaded by a
process of its own, in a cgroup of ``--device-share`` of a core as a lab device has (without
cgroups, where none can be made here: then the figures say so). Each process runs the same
loop for ``--seconds``: a plain decode (one row after ``HISTORY`` cached tokens, the row of a
mode-none token; with ``--users N``, N sequences of them share the window's KV, as N users'
do on a ring, and every row attends over all their cells), then a prompt chunk (``CHUNK`` rows; the last window computes logits for
its last row only, as for a prompt), the KV cut back after each, so every
sample sees the same cache. First each window alone, one after another (what one client
meets: one stage computes at a time), then all at once (what a full pipeline meets).

Output (JSON on stdout and in ``<out>/lab_ceiling.json``): per window and kind, ms of wall
time and of CPU per row alone and together, and ``slowdown`` (together over alone). Any
schedule of N clients in mode none delivers at most ``lap_ms / max(decode ms together)``
times one client's decode rate, where ``lap_ms`` is one client's measured lap (the ring
benchmark's ``lap_timing``): the slowest device computing rows back to back is the most a
full pipeline gets through.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench.row_cost_curve import random_rows, write_json

HISTORY = 192  # a user's cached tokens: a prompt of the ring benchmark's and its answer
CHUNK = 64
KINDS = {"decode": 1, "chunk": CHUNK}


def worker(path: str, seconds: float, users: int) -> int:
    """One device's loop (module docstring) on sequence 0 of ``users`` sequences of
    ``HISTORY`` cached tokens each: prints ``ready`` once loaded, waits for the start time on
    stdin, prints its counts as JSON."""
    import numpy as np

    from edgespec.node.runtime import StageRuntime

    rng = np.random.default_rng(0)
    with StageRuntime(Path(path), n_ctx=users * HISTORY + CHUNK + 8, n_seq_max=users,
                      n_threads=1) as rt:
        for seq in range(users):  # the other users' KV cells, which every decode attends over
            rt.forward(random_rows(rt, rng, HISTORY), 0, seq_ids=seq)
        rows = {k: random_rows(rt, rng, n) for k, n in KINDS.items()}
        want = [-1] if rt.is_last else None  # a chunk's logits: its last row's (a prompt's)
        print("ready", flush=True)
        start = float(sys.stdin.readline())
        out: dict[str, Any] = {}
        for i, kind in enumerate(KINDS):
            t0, t1 = start + i * seconds, start + (i + 1) * seconds
            time.sleep(max(0.0, t0 - time.time()))
            n, wall, cpu = 0, 0.0, 0.0
            while time.time() < t1:
                w, c = time.perf_counter(), time.process_time()
                rt.forward(rows[kind], HISTORY, seq_ids=0, want_rows=want)
                rt.truncate(HISTORY, seq=0)
                wall += time.perf_counter() - w
                cpu += time.process_time() - c
                n += 1
            out[kind] = {"calls": n, "wall_s": wall, "cpu_s": cpu}
    print(json.dumps(out), flush=True)
    return 0


def run(paths: list[Path], seconds: float, share: float | None, users: int
        ) -> dict[str, Any]:
    """Start a worker per window (each in a cgroup of ``share`` where one can be made),
    wait until all are loaded, start them at one moment; their counts."""
    from bench.testbed import homelab  # the lab (tests/lab.py)

    groups, procs = [], []
    try:
        for path in paths:
            argv = [sys.executable, "-m", "bench.lab_ceiling", "--worker", str(path),
                    "--seconds", str(seconds), "--users", str(users)]
            if share is not None:
                cg = homelab.Cgroup(f"edgespec-ceiling-{uuid.uuid4().hex[:8]}")
                groups.append(cg)
                cg.cap(cpu_share=share)
                argv = cg.wrap(argv)
            env = dict(os.environ, OMP_WAIT_POLICY="passive")
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, env=env))
        for p in procs:
            if p.stdout is None or p.stdout.readline().strip() != "ready":
                raise SystemExit(f"a worker failed to load its window (exit {p.wait()})")
        start = time.time() + 0.5
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(f"{start}\n")
            p.stdin.flush()
        out = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if p.wait(timeout=60 + 4 * seconds) != 0 or not line:
                raise SystemExit(f"a worker exited {p.returncode}")
            out.append(json.loads(line))
        return {"results": out}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for cg in groups:
            cg.close()


def per_row(counts: dict[str, Any]) -> dict[str, dict[str, float]]:
    """ms of wall time and of CPU per row of each kind."""
    return {k: {"wall_ms": round(1e3 * c["wall_s"] / (c["calls"] * KINDS[k]), 3),
                "cpu_ms": round(1e3 * c["cpu_s"] / (c["calls"] * KINDS[k]), 3)}
            for k, c in counts.items() if c["calls"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lab_ceiling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ranges", default="0:11,11:22,22:28",
                    help="the windows, as the ring benchmark's --ranges")
    ap.add_argument("--device-share", type=float, default=0.3)
    ap.add_argument("--seconds", type=float, default=12.0, help="per kind and phase")
    ap.add_argument("--users", type=int, default=1,
                    help="sequences of HISTORY tokens each in every window's KV (the users a "
                         "ring serves at once); the loop runs on one of them")
    ap.add_argument("--out", default="bench/results/")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: a tiny model in two windows, 1 s per kind; writes into the "
                         "temporary folder (unless --out)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.seconds, args.users)
    if args.smoke:
        from bench import smoke

        smoke.apply(ap, args, target=smoke.tiny_model, ranges="0:2,2:4", seconds=1.0,
                    out=str(smoke.scratch_dir()))

    from bench.projection import stage_shard
    from bench.ring_bench import machine_info
    from bench.testbed import homelab  # the lab (tests/lab.py)
    from edgespec.llm.models import resolve

    target = resolve(args.target)
    windows = [tuple(int(x) for x in r.split(":")) for r in args.ranges.split(",")]
    paths = [stage_shard(target, a, b) for a, b in windows]
    share: float | None = args.device_share
    no_cgroup = homelab.skip_reason() if share is not None else None
    if no_cgroup:
        print(f"no cgroups here ({no_cgroup}): the devices run without a CPU share",
              file=sys.stderr)
        share = None
    alone = [run([p], args.seconds, share, args.users)["results"][0] for p in paths]
    together = run(paths, args.seconds, share, args.users)["results"]
    rows = []
    for (a, b), one, all_ in zip(windows, alone, together, strict=True):
        pa, pt = per_row(one), per_row(all_)
        rows.append({"window": f"{a}:{b}", "alone": pa, "together": pt,
                     "slowdown": {k: round(pt[k]["wall_ms"] / pa[k]["wall_ms"], 3)
                                  for k in pa if k in pt}})
    out = {"benchmark": "lab_ceiling", "machine": machine_info(), "target": target.name,
           "device_share": share, "cgroups": not no_cgroup, "history": HISTORY,
           "users": args.users,
           "chunk_rows": CHUNK, "seconds": args.seconds, "windows": rows,
           "decode_ms_together_max": max(r["together"]["decode"]["wall_ms"] for r in rows),
           "command": "python -m bench.lab_ceiling " + " ".join(argv or sys.argv[1:])}
    write_json(out, args.out, "lab_ceiling.json" if args.users == 1
               else f"lab_ceiling_users{args.users}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
