"""Time of one decode call against its row count, 1 row at a time up to ``--max-rows``.

    .venv/bin/python -m bench.row_cost_curve        # ~3 min on the 2-core test host
    .venv/bin/python -m bench.row_cost_curve --smoke    # seconds: tiny models, 1 to 6 rows

llama.cpp's CPU matrix kernels work on blocks of rows, and a batch a row past a block's end
pays for a slow remainder; the tree budgets (``CostModel.BUDGETS``, docs/design.md 3.8) are
chosen so that laps land on block ends. This measures where they lie, for the windows of the
reference operating point: a middle stage and the last stage of the 1.5B target (4 stages,
the shards a local ring cuts) and the draft model as the drafter runs it (its Q4_0 copy,
``edgespec.drafters.quant``). One llama.cpp thread, as each stage of a local ring has; rows
are one sequence after 160 cached tokens, every row an output (a tree row is); sizes are
timed in turn, round after round, so a drift of the host's speed hits them alike; medians.

Output: JSON on stdout and in ``<out>/row_cost_curve.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before llama_cpp loads

import numpy as np  # noqa: E402

from bench.projection import stage_shard  # noqa: E402
from bench.ring_bench import machine_info  # noqa: E402

HISTORY = 160


def random_rows(rt: Any, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` input rows for the window ``rt``: token ids on a first window, else hidden
    states of a real residual stream's magnitude (the cost does not depend on the values)."""
    if rt.is_first:
        return rng.integers(100, min(20000, rt.n_vocab), n).astype(np.int32)
    return (rng.standard_normal((n, rt.n_embd)) * 0.5).astype(np.float32)


def curve(path: Path, max_rows: int, reps: int) -> dict[int, float]:
    """Median ms per ``forward`` of r rows, r = 1..max_rows, of the window in ``path``."""
    from edgespec.node.runtime import StageRuntime

    rng = np.random.default_rng(0)
    with StageRuntime(path, n_ctx=HISTORY + 2 * max_rows + 8, n_seq_max=1, n_threads=1) as rt:
        def inputs(n: int) -> np.ndarray:
            return random_rows(rt, rng, n)

        rt.forward(inputs(HISTORY), 0)
        times: dict[int, list[float]] = {r: [] for r in range(1, max_rows + 1)}
        for _ in range(reps):
            for r in times:
                pos = rt.n_past(0)
                t = time.perf_counter()
                rt.forward(inputs(r), pos)
                times[r].append((time.perf_counter() - t) * 1e3)
                rt.truncate(pos)  # the same KV length for every sample
    return {r: round(statistics.median(v), 1) for r, v in times.items()}


def add_window_args(ap: argparse.ArgumentParser) -> None:
    """The flags naming the windows (``probe_windows``), the rounds and the output folder."""
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="'-': none")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/")


def probe_windows(target_name: str, draft_name: str, stages: int) -> list[tuple[str, Path]]:
    """(label, file) of the windows of the reference operating point: a middle and the last
    stage of the target cut in ``stages`` (the shards a local ring cuts) and the draft
    model's drafting copy (none for ``draft_name`` '-')."""
    from edgespec.drafters.quant import fast_draft
    from edgespec.llm.gguf_read import read_info
    from edgespec.llm.models import resolve
    from edgespec.llm.shards import even_ranges

    target = resolve(target_name)
    ranges = even_ranges(read_info(target).n_layer, stages)
    windows: list[tuple[str, Path]] = [
        (f"target stage {k} of {stages}, layers {a}-{b}", stage_shard(target, a, b))
        for k, (a, b) in ((1, ranges[1]), (stages - 1, ranges[-1]))]
    if draft_name != "-":
        windows.append(("draft model (drafting copy)", Path(fast_draft(resolve(draft_name)))))
    return windows


def write_json(out: dict[str, Any], folder: str, name: str) -> None:
    """Print ``out`` as JSON and write it to ``folder/name``."""
    text = json.dumps(out, indent=1)
    print(text)
    dest = Path(folder)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.row_cost_curve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_window_args(ap)
    ap.add_argument("--max-rows", type=int, default=34)
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: tiny models (unless --target/--draft), 1 to 6 rows, 1 rep; "
                         "writes into the temporary folder (unless --out)")
    args = ap.parse_args(argv)
    if args.smoke:
        from bench import smoke

        smoke.apply(ap, args, target=smoke.tiny_model,
                    draft=lambda: smoke.tiny_model("draft"),
                    reps=1, max_rows=6, out=str(smoke.scratch_dir()))

    out: dict[str, Any] = {"machine": machine_info(), "history": HISTORY, "reps": args.reps,
                           "threads": 1, "curves": []}
    for label, path in probe_windows(args.target, args.draft, args.stages):
        t = time.perf_counter()
        ms = curve(path, args.max_rows, args.reps)
        out["curves"].append({"window": label, "file": path.name, "ms": ms})
        print(f"{label}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    write_json(out, args.out, "row_cost_curve.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
