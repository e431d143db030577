#!/bin/bash
# issue 19, final measurements (one quiet run of each, nothing else on the host):
#  A. lap_bench overhead (single vs 1/2/4-stage rings, mode none, loopback, interleaved reps),
#     after (main) then before (30ab917, a worktree with its own venv and this bench file);
#  B. lap_bench modes on the default ring (0.5B, 2 stages, no draft model, chat prompts);
#  C. lap_bench modes at the issue-6 point (1.5B/0.5B, 4 stages, 10 ms per hop): auto vs flow;
#  D. ring_bench at the issue-6 point, before/after alternated twice.
set -u
export EDGESPEC_DEAD_AFTER_S=10
OUT=${OUT:-/tmp/b19}
BEFORE=${BEFORE:-/work/wt-before}
AFTER=${AFTER:-/work/main}
mkdir -p $OUT
stamp() { echo "== $1 $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"; }
run() { local who=$1; shift; if [ $who = before ]; then (cd $BEFORE && PYTHONDONTWRITEBYTECODE=1 .venv/bin/python "$@"); else (cd $AFTER && .venv/bin/python "$@"); fi; }
for who in after before; do
  stamp "A overhead $who"
  run $who -m bench.lap_bench --parts overhead --reps 3 --out $OUT/overhead_$who.json > $OUT/overhead_$who.md
done
stamp "B modes default ring"
run after -m bench.lap_bench --parts modes --out $OUT/modes_default.json > $OUT/modes_default.md
stamp "C modes issue-6 point"
run after -m bench.lap_bench --parts modes --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --stages 4 --hop-ms 10 --modes none,flow,auto --chat-prompts 3 --chat-tokens 64 \
  --out $OUT/modes_issue6.json > $OUT/modes_issue6.md
ARGS="--target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --stages 4 --hop-ms 10 --modes none,sync,flow --drafter model --prompts 2 --tokens 64 --no-projection"
for rep in 1 2; do
  for who in before after; do
    stamp "D ring_bench rep $rep $who"
    run $who -m bench.ring_bench $ARGS --out $OUT/rb_$who$rep --name ring_bench_$who$rep
  done
done
stamp done
