"""Rounding probe (docs/design.md 3.9): when does one row's logits change bit for bit?

    .venv/bin/python -m bench.rounding_probe          # about a minute: the 0.5B, 1 thread

Not a speed benchmark: it answers "can concurrent requests give bit-identical answers to the
same requests alone?" on this machine's llama.cpp build. One ``StageRuntime`` over the whole
model, sequence A (a 40-token prompt, then 4 one-token decodes) against A computed in other
surroundings, for the attention llama.cpp runs by default on CPU (``flash_attn=False``), for
flash attention, and for flash attention without repacked weights (``use_extra_bufts=False``):

- ``rows``: A's decode row in a batch of ``n`` rows (the others another sequence's, whose 10
  cells precede A's), against A decoding alone after those 10 cells: the row count classes
  of the kernels show (with the default attention, the cells the other rows take between
  A's also count);
- ``offset``: another sequence's ``k`` cells before A's (A's cells start at cell ``k``);
- ``holes``: another sequence's cells before A's removed before A decodes, so llama.cpp's
  allocator puts A's later tokens in front of its earlier ones (cell order against position
  order).

For each case: the largest absolute logit change over A's decodes (0.0 = bit-identical).
Prints JSON (machine, settings, results) and writes it to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before llama_cpp loads

import numpy as np  # noqa: E402

from bench.ring_bench import machine_info  # noqa: E402

PROMPT = np.arange(1000, 1040, dtype=np.int32)  # A: 40 prompt tokens (ids, not text)
STEPS = 4


def _decodes(path: Path, flash: bool, repack: bool, other: int = 0, rows: int = 1,
             hole: bool = False, n_ctx: int = 1024) -> list[np.ndarray]:
    """A's logits for its STEPS decodes; ``other`` cells of sequence 1 first (removed before
    A decodes when ``hole``); each decode batch holds ``rows`` rows, A's first."""
    from edgespec.node.runtime import StageRuntime

    with StageRuntime(path, n_ctx=n_ctx, n_seq_max=2, n_threads=1, flash_attn=flash,
                      use_extra_bufts=repack) as rt:
        n1 = 0
        if other:
            rt.forward(np.arange(2000, 2000 + other, dtype=np.int32), 0, 1)
            n1 = other
        rt.forward(PROMPT, 0, 0)
        if hole:
            rt.kv_seq_rm(1)
            n1 = 0
        out = []
        for i in range(STEPS):
            k = rows - 1
            toks = np.concatenate([[3000 + i], np.arange(4000 + n1, 4000 + n1 + k)])
            pos = np.concatenate([[len(PROMPT) + i], np.arange(n1, n1 + k)]).astype(np.int32)
            seqs = np.array([0] + [1] * k)
            out.append(rt.forward(toks.astype(np.int32), pos, seqs)[0].copy())
            n1 += k
        return out


def _change(ref: list[np.ndarray], got: list[np.ndarray]) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(ref, got, strict=True))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rounding_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    from edgespec.llm.models import resolve

    path = resolve(args.model)
    results: dict[str, Any] = {}
    for name, flash, repack in (("default_attn", False, True), ("flash_attn", True, True),
                                ("flash_attn_no_repack", True, False)):
        def run(**kw: Any) -> list[np.ndarray]:
            return _decodes(path, flash, repack, **kw)  # noqa: B023 (used in this iteration)

        ref = run()
        ref10 = run(other=10)  # the rows cases' own reference
        res = {
            "rows": {n: _change(ref10, run(other=10, rows=n)) for n in (2, 4, 7, 8, 16, 63, 64)},
            "offset": {k: _change(ref, run(other=k)) for k in (8, 23, 32, 64, 256)},
            "holes": _change(ref, run(other=10, hole=True)),
        }
        results[name] = res
        print(f"{name}: {res}", file=sys.stderr, flush=True)
    report = {"machine": machine_info(), "model": str(path), "threads": 1,
              "command": "python -m bench.rounding_probe " + " ".join(argv or sys.argv[1:]),
              "max_abs_logit_change": results}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
