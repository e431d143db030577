#!/bin/sh
# The commands that produced the committed results (run from the repository root).
# 1. Fixed tree budgets next to the cost model's choice at the issue-6 operating point (10 ms).
.venv/bin/python -m bench.ring_bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
    --stages 4 --hop-ms 10 --modes none,sync,flow --drafter model,retrieval --budgets auto,4,16 \
    --prompts 4 --tokens 128 --no-projection --name ring_bench_budgets --out bench/results/ \
    --resume >> bench/results/ring_bench_budgets.log 2>&1
# 2. The full benchmark. Its first attempt was killed from outside after the 10 ms rings (no
# error in its log); --resume keeps complete rings (see "unit" in ring_bench_runs.jsonl) and
# runs the rest.
.venv/bin/python -m bench.ring_bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
    --stages 4 --hop-ms 10,0,25,50 --modes single,none,sync,flow --drafter model,retrieval \
    --prompts 8 --tokens 128 --out bench/results/ --resume >> bench/results/ring_bench.log 2>&1
