"""Would padding a decode up to a row block's end pay? n rows against the same n rows plus
dummy rows up to m, on one window, in turns.

    .venv/bin/python -m bench.pad_probe        # ~1 min on the 2-core test host

``bench/row_cost_curve.py`` shows that a decode of 12 to 15 rows of the 1.5B target costs a
middle stage more than one of 16 (docs/design.md 3.8). Whether a stage (or the drafter) could
gain by padding such a batch is not the same question: the dummy rows need a sequence of
their own (their KV cells are written, then removed) and, on the last stage, no logits. This
times exactly that: ``n`` real rows on sequence 0 after 160 cached tokens, against the same
rows plus ``m - n`` dummy rows on sequence 1 (positions 0.., removed after the call; the last
stage asks logits for the real rows only). One llama.cpp thread; pairs timed in turn, round
after round; medians. Windows as in ``row_cost_curve``: a middle and the last stage of the
target (4 stages) and the draft model's drafting copy.

Output: JSON on stdout and in ``<out>/pad_probe.json``; per window and case ``n->m``:
``[ms of n rows, ms of n rows padded to m]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before llama_cpp loads

import numpy as np  # noqa: E402

from bench.ring_bench import machine_info  # noqa: E402
from bench.row_cost_curve import (  # noqa: E402
    HISTORY,
    add_window_args,
    probe_windows,
    random_rows,
    write_json,
)

CASES = ((2, 4), (3, 4), (5, 8), (6, 8), (7, 8), (9, 16), (10, 16), (12, 16), (14, 16),
         (15, 16), (20, 32), (28, 32))


def probe(path: Path, reps: int) -> dict[str, list[float]]:
    """Median ms of each case, unpadded and padded, on the window in ``path``."""
    from edgespec.node.runtime import StageRuntime

    rng = np.random.default_rng(0)
    top = max(m for _, m in CASES)
    with StageRuntime(path, n_ctx=HISTORY + 2 * top + 8, n_seq_max=2, n_threads=1) as rt:
        def inputs(n: int) -> np.ndarray:
            return random_rows(rt, rng, n)

        rt.forward(inputs(HISTORY), 0)
        times: dict[tuple[int, int], tuple[list[float], list[float]]] = {
            c: ([], []) for c in CASES}
        for _ in range(reps):
            for (n, m), (plain, padded) in times.items():
                pos = rt.n_past(0)
                x = inputs(n)
                t = time.perf_counter()
                rt.forward(x, pos)
                plain.append((time.perf_counter() - t) * 1e3)
                rt.truncate(pos)
                xp = inputs(m)
                xp[:n] = x
                p = np.concatenate([np.arange(pos, pos + n), np.arange(m - n)]).astype(np.int32)
                want = list(range(n)) if rt.is_last else None
                t = time.perf_counter()
                rt.forward(xp, p, [[0]] * n + [[1]] * (m - n), want_rows=want)
                padded.append((time.perf_counter() - t) * 1e3)
                rt.truncate(pos)
                rt.kv_seq_rm(1)
    return {f"{n}->{m}": [round(statistics.median(a), 1), round(statistics.median(b), 1)]
            for (n, m), (a, b) in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pad_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    args = ap.parse_args(argv)

    out: dict[str, Any] = {"machine": machine_info(), "history": HISTORY, "reps": args.reps,
                           "threads": 1, "cases": "n->m: [ms of n rows, ms padded to m]",
                           "windows": []}
    for label, path in probe_windows(args.target, args.draft, args.stages):
        t = time.perf_counter()
        out["windows"].append({"window": label, "file": path.name, "ms": probe(path, args.reps)})
        print(f"{label}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    write_json(out, args.out, "pad_probe.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
