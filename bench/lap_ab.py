"""A/B of node settings in one run (issue 19): the same ring, mode none, with node processes
started under different environment variables, alternated so host load hits both alike.

    .venv/bin/python -m bench.lap_ab --ab OMP_WAIT_POLICY=passive,OMP_WAIT_POLICY=active \
        --stages 4 --reps 2 --out bench/results/lap_ab_omp.json

(``bench/results/lap_ab_inline*.json`` came from ``--ab EDGESPEC_NODE_INLINE=1,...=0`` on a
node that could run idle stages' batches on the reading thread; docs/design.md 8.3.)

Per run: tokens/s, CPU ms per token of head and nodes together (``lap_bench.ring_cpu_s``) and
the lap-timing view (``edgespec.laps``). The summary averages each setting over its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from bench.lap_bench import CODE_PROMPTS, _model_path, ring_cpu_s  # noqa: E402
from bench.ring_bench import machine_info  # noqa: E402
from edgespec.laps import combine, lap_lines  # noqa: E402


def run_setting(setting: str, model: str, stages: int, n_tokens: int) -> list[dict[str, Any]]:
    from edgespec import Ring
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer

    key, _, value = setting.partition("=")
    saved = os.environ.get(key)
    os.environ[key] = value  # the node processes inherit it
    try:
        path = _model_path(model)
        vocab = load_model(path, vocab_only=True)
        prompts = [Tokenizer(vocab).encode(p) for p in CODE_PROMPTS]
        vocab.close()
        out = []
        with Ring.local(str(path), stages=stages, threads=1, spec="none", n_ctx=2048) as ring:
            ring.generate(prompts[0][:16], max_tokens=8, spec="none")  # warm-up
            for i, p in enumerate(prompts):
                ring.reset()
                ring.generate(p, max_tokens=1, spec="none")  # prompt into the KV first
                cpu0 = ring_cpu_s(ring)
                g = ring.generate(p, max_tokens=n_tokens, spec="none")
                cpu = ring_cpu_s(ring) - cpu0
                st = g.stats.as_dict()
                out.append({"setting": setting, "prompt": i, "n_tokens": len(g.tokens),
                            "decode_s": g.stats.decode_s, "cpu_s": cpu,
                            "tokens_per_s": st["tokens_per_s"], "lap_timing": st["lap_timing"],
                            "load_avg_1m": round(os.getloadavg()[0], 2)})
        return out
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ab", required=True, help="comma-separated VAR=VALUE settings")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="bench/results/lap_ab.json")
    args = ap.parse_args(argv)
    settings = args.ab.split(",")
    result: dict[str, Any] = {
        "command": "python -m bench.lap_ab " + " ".join(map(shlex.quote, argv or sys.argv[1:])),
        "machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()]}
    runs: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for s in settings if rep % 2 == 0 else settings[::-1]:
            rs = run_setting(s, args.model, args.stages, args.tokens)
            runs += rs
            print(f"rep {rep} {s}: {[round(r['tokens_per_s'], 2) for r in rs]} tok/s, load "
                  f"{rs[-1]['load_avg_1m']}", file=sys.stderr, flush=True)
    summary = []
    for s in settings:
        rs = [r for r in runs if r["setting"] == s]
        toks = sum(r["n_tokens"] for r in rs)
        summary.append({"setting": s, "tokens_per_s": round(toks / sum(r["decode_s"] for r in rs), 2),
                        "cpu_ms_per_token": round(sum(r["cpu_s"] for r in rs) * 1e3 / toks, 2),
                        "load_avg_1m_mean": round(statistics.mean(r["load_avg_1m"] for r in rs), 2),
                        "lap_timing": combine([r["lap_timing"] for r in rs])})
    result.update(runs=runs, summary=summary,
                  load_avg_end=[round(x, 2) for x in os.getloadavg()])
    for row in summary:
        print(f"{row['setting']}: {row['tokens_per_s']} tok/s, {row['cpu_ms_per_token']} ms CPU "
              f"per token (load {row['load_avg_1m_mean']})")
        print("\n".join(lap_lines(row["lap_timing"])))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
