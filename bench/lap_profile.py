"""Profile a ring in mode none with py-spy (``--native``) on one node and the head at once,
while the head decodes 64-token generations back to back.

    .venv/bin/pip install py-spy
    .venv/bin/python -m bench.lap_profile [MODEL] [SECONDS] [OUT_PREFIX] [STAGES] [NODE] [idle|cpu]

``idle`` (the default) samples waiting threads too (where wall time goes); ``cpu`` only
threads on a CPU (what the per-lap work costs the host).
    .venv/bin/python -m bench.lap_profile_agg OUT_PREFIX_node.txt   # per thread, leaf, inclusive
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")


def main(argv: list[str]) -> int:
    from edgespec import Ring

    model = argv[0] if argv else "qwen2.5-coder-0.5b"
    secs = int(argv[1]) if len(argv) > 1 else 25
    out = argv[2] if len(argv) > 2 else "/tmp/lap_profile"
    stages = int(argv[3]) if len(argv) > 3 else 1
    node = int(argv[4]) if len(argv) > 4 else 0
    idle = ["--idle"] if (argv[5] if len(argv) > 5 else "idle") == "idle" else []
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    with Ring.local(model, stages=stages, threads=1, spec="none") as ring:
        ring.generate("def f(x):\n", max_tokens=8, spec="none")  # warm-up
        pids = ((ring.local_nodes.procs[node].pid, "node"), (os.getpid(), "head"))
        spies = [subprocess.Popen([spy, "record", "-p", str(pid), "--native", "-r", "200",
                                   "-d", str(secs), "-f", "raw", "-o", f"{out}_{tag}.txt",
                                   "--threads", *idle],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for pid, tag in pids]
        t0 = time.time()
        while time.time() - t0 < secs - 2:
            ring.reset()
            g = ring.generate("def quicksort(arr):\n", max_tokens=64, spec="none")
            print(f"{g.stats.tokens_per_s:.2f} tok/s", flush=True)
        for s in spies:
            s.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
