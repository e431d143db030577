"""Does KV that idle slots keep slow the decodes of a busy one? (docs/design.md 5.8)

A ring's slots share each stage's unified KV cache; an idle slot keeps its last conversation's
cells for prefix reuse. llama.cpp attends over the cache's used span (its ``n_kv``), masking
other sequences' cells, so those cells may cost the busy slot time. Two middle stages of the
1.5B model (layers 7-13, as a 4-stage ring's stage 1) in one process: A holds ``--cells`` of
seq 0 only; B also holds ``--cells`` in each of 3 other slots' seqs (64, 128, 192), written
first. C is B with the 3 idle slots' sequences parked in host memory and seq 0 parked and
restored, as a ring with slots does at every request's end and its next turn's start
(``edgespec.llm.kv_park``, docs/design.md 5.8). All time 1-row and 4-row decodes of seq 0,
in turns (the first case rotates rep by rep), each decode rolled back, so the state stays
fixed. Prints JSON: median and quartiles per case, and C's park and restore times.

    .venv/bin/python -m bench.stale_kv_probe            # about 2 minutes on the 2-core host
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from bench.ring_bench import machine_info
from edgespec.llm import models
from edgespec.node.runtime import StageRuntime


def stage(model, cells: int, stale: list[int], rng: np.random.Generator) -> StageRuntime:
    rt = StageRuntime((model, (7, 14)), n_ctx=4096, n_seq_max=256, n_threads=1)
    for seq in [*stale, 0]:
        x = rng.standard_normal((cells, rt.n_embd)).astype(np.float32) * 0.1
        rt.forward(x, 0, seq_ids=[[seq]] * cells)
    return rt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.stale_kv_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--cells", type=int, default=300, help="KV cells per sequence")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    model = models.ensure(args.model)
    rng = np.random.default_rng(0)
    cases = {"A": stage(model, args.cells, [], rng),
             "B": stage(model, args.cells, [64, 128, 192], rng),
             "C": stage(model, args.cells, [64, 128, 192], rng)}
    t = time.perf_counter()
    for seq in (64, 128, 192, 0):
        cases["C"].kv_seq_park(seq)
    parked = time.perf_counter()
    cases["C"].kv_seq_restore(0)
    park_ms = {"park_4_seqs": round((parked - t) * 1e3, 2),
               "restore_1_seq": round((time.perf_counter() - parked) * 1e3, 2)}
    names = list(cases)
    times: dict[str, list[float]] = {f"{c}_{n}row": [] for c in cases for n in (1, 4)}
    for rep in range(args.reps):
        for name in names[rep % 3:] + names[:rep % 3]:
            rt = cases[name]
            for n in (1, 4):
                x = rng.standard_normal((n, rt.n_embd)).astype(np.float32) * 0.1
                t = time.perf_counter()
                rt.forward(x, args.cells, seq_ids=[[0]] * n)
                times[f"{name}_{n}row"].append((time.perf_counter() - t) * 1e3)
                rt.kv_seq_rm(0, args.cells, -1)
    out = {"machine": machine_info(), "settings": vars(args), "C_park_ms": park_ms,
           "decode_ms": {k: {"median": round(statistics.median(v), 2),
                             "p25": round(float(np.percentile(v, 25)), 2),
                             "p75": round(float(np.percentile(v, 75)), 2)}
                         for k, v in times.items()}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
