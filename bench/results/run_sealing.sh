#!/bin/sh
# The commands that produced the sealing results (run from the repository root), in order.
# 1. Per-hop cost of sealed vs plaintext links (one-token and 64-row tree frames, alternating).
.venv/bin/python bench/transport_bench.py --laps 2000 --rounds 4 > bench/results/transport_bench.json
# 2. The ring end to end with sealing on and off (EDGESPEC_INSECURE_PLAINTEXT=1, benchmarks
#    only), alternating: sealed, plaintext, sealed, plaintext, sealed.
common="--target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --stages 4 --hop-ms 10 --modes flow
  --drafter model --prompts 3 --tokens 64 --no-projection --out bench/results/"
.venv/bin/python -m bench.ring_bench $common --name ring_bench_sealed > bench/results/ring_bench_sealed.log 2>&1
EDGESPEC_INSECURE_PLAINTEXT=1 .venv/bin/python -m bench.ring_bench $common --name ring_bench_plaintext \
    > bench/results/ring_bench_plaintext.log 2>&1
.venv/bin/python -m bench.ring_bench $common --name ring_bench_sealed_again > bench/results/ring_bench_sealed_again.log 2>&1
EDGESPEC_INSECURE_PLAINTEXT=1 .venv/bin/python -m bench.ring_bench $common --name ring_bench_plaintext_again \
    > bench/results/ring_bench_plaintext_again.log 2>&1
.venv/bin/python -m bench.ring_bench $common --name ring_bench_sealed_third > bench/results/ring_bench_sealed_third.log 2>&1
