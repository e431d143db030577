"""Cost of one hop of seq-id conversions, engine to stage (docs/design.md 5.1), before and after
``SeqIds``.

One hop is what a batch's seq ids go through between the C++ core's layout and llama_batch:
the engine's form, the wire's bool matrix (encode side), back from the bool matrix (decode
side), and the stage runtime's ``normalize_seq_ids``. "before" is the per-row lists path as
it was (written out here, the runtime's checks included: layout -> lists -> bool matrix -> lists
-> int32 matrix); "after" is
today's path (layout -> SeqIds -> bool matrix -> SeqIds -> checked as is). Both run on the same
real C++ core layouts, alternated, and must agree on the ids. Prints one JSON object: machine,
and per shape the median microseconds per hop of each path and their ratio.

    .venv/bin/python bench/seq_ids_bench.py [--repeat 7] [--number 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import timeit

import numpy as np

from edgespec.batch import SeqIds
from edgespec.node.runtime import normalize_seq_ids
from edgespec.tree import core

N_SEQ_MAX = 256


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "load_avg_1m": os.getloadavg()[0]}


def layout(rows: int, leaves: int) -> core.Layout:
    """A real core layout of ``rows`` rows spread over exactly ``leaves`` sequences."""
    t = core.TokenTree(1, 10, 255)
    # The root and a trunk, then ``leaves`` children of its tip (one seq per leaf); one leaf:
    # a plain chain.
    tip, trunk = 0, rows - 1 - (leaves if leaves > 1 else 0)
    for i in range(trunk):
        tip = t.add(tip, 100 + i, -0.01)
    for j in range(leaves if leaves > 1 else 0):
        t.add(tip, 500 + j, -0.1 - j * 0.01)
    t.order()
    lay = t.layout()
    assert len(lay.tokens) == rows and int(lay.n_seq.max()) == leaves, (len(lay.tokens), lay.n_seq)
    return lay


def old_normalize_lists(rows: list[list[int]], n: int, n_seq_max: int) -> tuple[np.ndarray, np.ndarray]:
    """``normalize_seq_ids``' list-of-lists path and checks as they were before SeqIds."""
    lists = [[int(x) for x in r] for r in rows]
    k = max((len(r) for r in lists), default=1)
    if len(lists) != n or any(len(r) == 0 for r in lists):
        raise ValueError("every token needs at least one seq id")
    mat = np.zeros((n, max(k, 1)), np.int32)
    counts = np.zeros(n, np.int32)
    for i, r in enumerate(lists):
        mat[i, :len(r)] = r
        counts[i] = len(r)
    if mat.shape[1] > n_seq_max:
        raise ValueError(f"a token carries {mat.shape[1]} seq ids, n_seq_max is {n_seq_max}")
    used = np.arange(mat.shape[1])[None, :] < counts[:, None]
    vals = mat[used]
    if vals.size and (vals.min() < 0 or vals.max() >= n_seq_max):
        raise ValueError("seq id out of range")
    for i in np.nonzero(counts > 1)[0]:
        row = mat[i, :counts[i]]
        if len(set(row.tolist())) != len(row):
            raise ValueError(f"token {i} lists a seq id twice: {row.tolist()}")
    return np.ascontiguousarray(mat), np.ascontiguousarray(counts)


def hop_before(lay: core.Layout) -> tuple[np.ndarray, np.ndarray]:
    seq_ids = [lay.seq_ids[i, : lay.n_seq[i]].tolist() for i in range(len(lay.tokens))]
    top = max((max(s) for s in seq_ids if len(s)), default=-1)
    m = np.zeros((len(seq_ids), max(top + 1, 1)), dtype=bool)
    for i, s in enumerate(seq_ids):
        if any(j < 0 for j in s):
            raise ValueError("sequence ids must be >= 0")
        m[i, list(s)] = True
    lists = [np.flatnonzero(row).tolist() for row in m]
    return old_normalize_lists(lists, len(lists), N_SEQ_MAX)


def hop_after(lay: core.Layout) -> tuple[np.ndarray, np.ndarray]:
    m = SeqIds(lay.seq_ids, lay.n_seq).to_bool_matrix()
    return normalize_seq_ids(SeqIds.from_bool_matrix(m), m.shape[0], N_SEQ_MAX)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--number", type=int, default=200)
    args = ap.parse_args()
    out: dict = {"machine": machine(), "repeat": args.repeat, "number": args.number, "shapes": []}
    for rows, leaves in ((1, 1), (64, 16)):
        lay = layout(rows, leaves)
        (bm, bc), (am, ac) = hop_before(lay), hop_after(lay)
        used = np.arange(am.shape[1])[None, :] < ac[:, None]
        assert np.array_equal(bc, ac) and np.array_equal(bm[used], am[used])
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.repeat):  # alternated, so both see the same load
            for name, fn in (("before", hop_before), ("after", hop_after)):
                t = timeit.timeit(lambda fn=fn, lay=lay: fn(lay), number=args.number)
                times[name].append(t / args.number * 1e6)
        b, a = statistics.median(times["before"]), statistics.median(times["after"])
        out["shapes"].append({"rows": rows, "sequences": leaves, "before_us": round(b, 1),
                              "after_us": round(a, 1), "speedup": round(b / a, 2)})
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
