"""Overhead of running a model as a chain of layer windows instead of one context.

Runs the unsplit model and an N-window LocalPipeline side by side in one process, on the same
prompt, alternating between the two for every measurement so both see the same machine load,
and times decode calls at batch 1 (plain decoding) and batch 16 (a verification batch). Prints
one JSON object: machine, model, windows, median ms per call and ratio = unsplit / split
(1.0 = no overhead; the target is >= 0.95 at batch 1).

    .venv/bin/python bench/stage_overhead.py [--model PATH] [--windows 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgespec.llm import cpu as cpu_facts
from edgespec.node.runtime import StageRuntime

# LocalPipeline is test scaffolding (tests/pipeline_fixtures.py), not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from pipeline_fixtures import LocalPipeline  # noqa: E402


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import llama_cpp

    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "physical_cores": cpu_facts.physical_cores(),
            "python": platform.python_version(), "llama_cpp_python": llama_cpp.__version__,
            "load_avg_1m": os.getloadavg()[0]}


def time_call(pipe: LocalPipeline, tokens: np.ndarray, start: int) -> float:
    """One decode call of ``tokens`` at ``start`` (seq 0), then rolled back; seconds."""
    t0 = time.perf_counter()
    pipe.forward(tokens, start, 0, want_rows=None)
    dt = time.perf_counter() - t0
    pipe.truncate(start)
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF model (default: Qwen2.5-Coder-0.5B via edgespec.llm.models)")
    ap.add_argument("--windows", type=int, default=3, help="windows in the split chain")
    ap.add_argument("--steps", type=int, default=30, help="timed calls per batch size and side")
    ap.add_argument("--threads", type=int, default=1, help="threads per context")
    ap.add_argument("--prompt-len", type=int, default=64)
    args = ap.parse_args()

    if args.model:
        model = Path(args.model)
    else:
        from edgespec.llm import models

        model = Path(models.ensure("qwen2.5-coder-0.5b"))
    kw = dict(n_ctx=1024, n_batch=128, n_threads=args.threads, n_seq_max=2)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="edgespec-bench-") as tmp, \
            LocalPipeline([StageRuntime(model, **kw)]) as unsplit, \
            LocalPipeline.from_model(model, n_stages=args.windows, out_dir=tmp, **kw) as split:
        vocab = unsplit.n_vocab
        prompt = rng.integers(100, min(vocab, 30000), args.prompt_len).astype(np.int32)
        for p in (unsplit, split):
            p.prefill(prompt)
        start = len(prompt)
        results = {}
        for batch in (1, 16):
            toks = rng.integers(100, min(vocab, 30000), batch).astype(np.int32)
            for p in (unsplit, split):  # warm-up
                time_call(p, toks, start)
            t_un, t_sp = [], []
            for _ in range(args.steps):
                t_un.append(time_call(unsplit, toks, start))
                t_sp.append(time_call(split, toks, start))
            un, sp = statistics.median(t_un), statistics.median(t_sp)
            results[f"batch_{batch}"] = {"unsplit_ms": round(un * 1e3, 2), "split_ms": round(sp * 1e3, 2),
                                         "ratio": round(un / sp, 3)}
        out = {
            "bench": "stage_overhead",
            "machine": machine_info(),
            "model": model.name,
            "windows": [list(w.layer_range) for w in split.windows],
            "threads_per_context": args.threads,
            "prompt_tokens": int(start),
            "steps": args.steps,
            "results": results,
            "target": "ratio >= 0.95 at batch 1",
            "meets_target": results["batch_1"]["ratio"] >= 0.95,
        }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
