"""Does one draft-model batch for several slots cost less than one batch per slot?

A ring with ``S`` slots drafts for up to ``S`` requests at once. Separate contexts (one per
slot) each run their own ``llama_decode``; one shared context could take the rows of every
slot that is drafting at that moment in a single call, reading the weights once. Both on the
draft model (its Q4_0 copy, as the head drafts with it), 1 thread per context as the head
runs it:

- ``separate``: ``--slots`` contexts, each holding its own ``--cells``-token history, each
  decoding ``rows`` tree rows in its own call, one after another;
- ``shared``: one context holding all ``--slots`` histories (one sequence each), decoding
  the same rows of every slot in one call.

Every decode is rolled back (``seq_rm`` of the rows), so the state stays fixed; the cases
alternate rep by rep. Prints JSON: median wall ms (one thread: the CPU it takes) per case
and rows per slot, and the ratio ``shared / separate``.

    .venv/bin/python -m bench.draft_batch_probe        # about a minute on the 2-core host
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from bench.ring_bench import machine_info
from edgespec.drafters.quant import fast_draft
from edgespec.llm import capi, models
from edgespec.llm.llamacpp import load_model, new_context


def decode(ctx, batch, rows: list[tuple[int, int, int]]) -> None:
    """One ``llama_decode`` of ``(token, pos, seq)`` rows, every row's logits wanted."""
    for i, (tok, pos, seq) in enumerate(rows):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, True
    batch.n_tokens = len(rows)
    if capi.llama_decode(ctx.ptr, batch) != 0:
        raise RuntimeError("llama_decode failed")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.draft_batch_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--cells", type=int, default=200, help="history tokens per slot")
    ap.add_argument("--rows", default="1,2,4,8", help="tree rows per slot and call")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    model = load_model(fast_draft(models.ensure(args.draft)))
    rng = np.random.default_rng(0)
    n_vocab = 32000  # any valid ids: the cost does not depend on them
    hist = [rng.integers(0, n_vocab, args.cells).tolist() for _ in range(args.slots)]
    rows_per = [int(r) for r in args.rows.split(",")]
    n_batch = max(512, args.slots * max(rows_per))

    def ctx_with(histories: dict[int, list[int]]):
        """A context and batch holding each ``seq: tokens`` history."""
        c = new_context(model, n_ctx=4096, n_batch=n_batch, n_seq_max=max(histories) + 1,
                        kv_unified=True, n_threads=1)
        b = capi.llama_batch_init(n_batch, 0, 1)
        for s, toks in histories.items():
            decode(c, b, [(t, p, s) for p, t in enumerate(toks)])
        return c, b

    separate = [ctx_with({0: hist[slot]}) for slot in range(args.slots)]
    shared = ctx_with(dict(enumerate(hist)))

    def tree_rows(seq: int, n: int) -> list[tuple[int, int, int]]:
        return [(int(rng.integers(0, n_vocab)), args.cells + j, seq) for j in range(n)]

    times: dict[str, list[float]] = {f"{case}_{n}": [] for case in ("separate", "shared")
                                     for n in rows_per}
    for rep in range(args.reps):
        for n in rows_per:
            for case in (("separate", "shared") if rep % 2 == 0 else ("shared", "separate")):
                t = time.perf_counter()
                if case == "separate":
                    for c, b in separate:
                        decode(c, b, tree_rows(0, n))
                    dt = time.perf_counter() - t
                    for c, _ in separate:
                        capi.llama_memory_seq_rm(c.memory, 0, args.cells, -1)
                else:
                    c, b = shared
                    decode(c, b, [r for s in range(args.slots) for r in tree_rows(s, n)])
                    dt = time.perf_counter() - t
                    for s in range(args.slots):
                        capi.llama_memory_seq_rm(c.memory, s, args.cells, -1)
                times[f"{case}_{n}"].append(dt * 1e3)
    med = {k: round(statistics.median(v), 2) for k, v in times.items()}
    out = {"machine": machine_info(), "command": "python -m bench.draft_batch_probe "
           + " ".join(argv if argv is not None else sys.argv[1:]),
           "slots": args.slots, "cells": args.cells, "reps": args.reps, "median_ms": med,
           "shared_over_separate": {n: round(med[f"shared_{n}"] / med[f"separate_{n}"], 3)
                                    for n in rows_per}}
    print(json.dumps(out, indent=1))
    for c, b in [*separate, shared]:
        capi.llama_batch_free(b)
        c.close()
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
