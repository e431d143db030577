"""What a device holds for its window: peak resident memory (anonymous + file-mapped) and load
time of each window of an N-way split, the model file mapped (its pages released once loaded,
as the node does) and read into memory, side by side.

    .venv/bin/python -m bench.device_memory --model qwen2.5-coder-1.5b --stages 3
    .venv/bin/python -m bench.device_memory --smoke     # seconds: a tiny model, 2 stages

Each (window, mode) is loaded in a fresh process, as a node loads it (``StageRuntime``: the
shard a local ring cuts, ``n_ctx`` KV cells, 256 sequences as a ring's stages have), then
prefills 300 rows, verifies a 64-row tree on a second sequence (all its logits on the last
window) and decodes 5 rows, and reports its peak: ``VmHWM`` (resident, anonymous and file
pages together) and, at the end, ``RssAnon`` and ``RssFile``. The idle process (Python, numpy,
llama.cpp's libraries) is measured the same way and reported apart. The order of the two modes
alternates per window. The unsplit model is measured the same way for reference.

Output: JSON on stdout and in ``<out>/device_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.ring_bench import machine_info

CHILD = r"""
import json, os, sys, time
os.environ["EDGESPEC_MMAP"] = sys.argv[2]
import numpy as np
from edgespec.node.runtime import StageRuntime

def status():
    st = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    return {k: int(st[k].split()[0]) // 1024 for k in ("VmHWM", "RssAnon", "RssFile")}

idle = status()
t0 = time.perf_counter()
rt = StageRuntime(sys.argv[1], n_ctx=int(sys.argv[3]), n_seq_max=256, n_threads=2)
load_s = time.perf_counter() - t0
rng = np.random.default_rng(0)

def rows(n, seq, p0, want):
    x = (np.arange(n, dtype=np.int32) % min(5000, rt.n_vocab - 100) + 100 if rt.is_first
         else rng.standard_normal((n, rt.n_embd)).astype(np.float32))
    kw = {"want_rows": want} if rt.is_last else {}
    rt.forward(x, np.arange(p0, p0 + n, dtype=np.int32), [[seq]] * n, **kw)

rows(300, 0, 0, [299])
rt.kv_seq_cp(0, 1)
rows(64, 1, 300, list(range(64)))
for i in range(5):
    rows(1, 0, 300 + i, [0])
end = status()
print(json.dumps({"load_s": round(load_s, 3), "peak_mib": end["VmHWM"],
                  "anon_mib": end["RssAnon"], "file_mib": end["RssFile"],
                  "idle_mib": idle["RssAnon"] + idle["RssFile"]}))
rt.close()
"""


def measure(path: Path, mmap: bool, n_ctx: int) -> dict[str, Any]:
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), "1" if mmap else "0",
                          str(n_ctx)], capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096, help="KV cells per window")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: a tiny model (unless --model), 2 stages, 1024 cells; writes "
                         "into the temporary folder (unless --out)")
    args = ap.parse_args(argv)
    if args.smoke:
        from bench import smoke

        smoke.apply(ap, args, model=smoke.tiny_model, stages=2, ctx=1024,
                    out=str(smoke.scratch_dir()))

    from bench.projection import stage_shard
    from edgespec.llm import models
    from edgespec.llm.cpu import extra_bufts_default
    from edgespec.llm.gguf_read import read_info
    from edgespec.llm.shards import even_ranges

    model = models.ensure(args.model)
    info = read_info(model)
    windows = [(a, b) for a, b in even_ranges(info.n_layer, args.stages)]
    rows = []
    for i, (a, b) in enumerate([(0, info.n_layer), *windows]):
        path = model if (a, b) == (0, info.n_layer) else stage_shard(model, a, b)
        row: dict[str, Any] = {"window": f"{a}:{b}", "file_mib": path.stat().st_size >> 20}
        for mmap in ((True, False) if i % 2 == 0 else (False, True)):
            row["mapped" if mmap else "read"] = measure(path, mmap, args.ctx)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    result = {"benchmark": "device_memory", "model": model.name, "stages": args.stages,
              "n_ctx": args.ctx, "repacked_weights": extra_bufts_default(),
              "machine": machine_info(), "windows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "device_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
