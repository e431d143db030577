#!/bin/bash
# issue 19 on a quiet host: lap_bench overhead (single vs 1/2/4-stage rings, mode none, loopback), before (1182222) then after (main), then before again
export EDGESPEC_DEAD_AFTER_S=10
for who in before after; do
  echo "== $who $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  if [ $who = before ]; then
    (cd /work/wt-before && PYTHONDONTWRITEBYTECODE=1 EDGESPEC_HOME=/tmp/h1/home_before .venv/bin/python -m bench.lap_bench --parts overhead --out /tmp/q19/overhead_$who.json)
  else
    (cd /work/main && .venv/bin/python -m bench.lap_bench --parts overhead --out /tmp/q19/overhead_$who.json)
  fi
done
echo "== done $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
