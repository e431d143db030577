#!/bin/sh
# The commands that produced the committed results (run from the repository root), in order.
# 1. The full benchmark: every mode and drafter at hops 10 (the reference operating point first,
#    so a run cut short still has it), 0, 25 and 50 ms.
.venv/bin/python -m bench.ring_bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
    --stages 4 --hop-ms 10,0,25,50 --modes single,none,sync,flow --drafter model,retrieval \
    --prompts 8 --tokens 128 --out bench/results/ > bench/results/ring_bench.log 2>&1
# 2. Fixed budgets next to the cost model's choice at 10 ms (in flow a budget B means segments
#    of B / 4 rows; auto = 2-row segments, lookahead from the measured acceptance).
.venv/bin/python -m bench.ring_bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
    --stages 4 --hop-ms 10 --modes none,sync,flow --drafter model --budgets auto,4,8,16 \
    --prompts 4 --tokens 128 --no-projection --name ring_bench_budgets --out bench/results/ \
    > bench/results/ring_bench_budgets.log 2>&1
# 3. The draft model as shipped (Q5_0/Q8_0) instead of its Q4_0 copy, same operating point.
.venv/bin/python -m bench.ring_bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
    --stages 4 --hop-ms 10 --modes none,sync,flow --drafter model --draft-quant none \
    --prompts 4 --tokens 128 --no-projection --name ring_bench_draft_as_shipped \
    --out bench/results/ > bench/results/ring_bench_draft_as_shipped.log 2>&1
# 4. Drafter costs and acceptance, the 0.5B as shipped and its Q4_0 copy side by side.
.venv/bin/python bench/drafter_bench.py > bench/results/drafter_bench.json
# 5. The unsplit 1.5B in one process without and with llama.cpp's repacked CPU kernels.
EDGESPEC_EXTRA_BUFTS=0 .venv/bin/python -m bench.ring_bench --target qwen2.5-coder-1.5b \
    --draft qwen2.5-coder-0.5b --stages 4 --modes single --prompts 8 --tokens 128 \
    --no-projection --name ring_bench_single_no_repack --out bench/results/ \
    > bench/results/ring_bench_single_no_repack.log 2>&1
.venv/bin/python -m bench.ring_bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
    --stages 4 --modes single --prompts 8 --tokens 128 --no-projection \
    --name ring_bench_single_repack --out bench/results/ \
    > bench/results/ring_bench_single_repack.log 2>&1
