"""What a constrained answer costs on a stage-to-stage link as it grows: bytes per lap at the
link, early in a long json_schema answer and late in it.

A request's sampling is registered once at the last stage and every batch carries only its key,
the tokens gained since the previous step and the step's tree (docs/design.md 6.11), so bytes
per lap should not grow with the answer. This measures it where the bytes flow: a ``Ring.local``
of two node processes whose every connection crosses a ``bench.linkemu`` proxy (no delay; the
kernel's byte counters of the proxy's sockets, ``bench.ring_bench.Links``), mode ``none`` (one
lap per token), greedy, a schema that asks for a long array. The counter of the link from the
first node to the second is read as the answer streams, around token ``--early`` and around
token ``--late``; bytes per lap there are the difference over ``--span`` tokens.

    .venv/bin/python -m bench.sampling_bytes                  # 0.5B, tokens 100 and 2000
    .venv/bin/python -m bench.sampling_bytes --smoke          # seconds: a tiny model

Prints one JSON object (machine, command, figures) and writes it to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

#: A JSON array of many short strings: a long answer whatever the model writes.
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1500}
PROMPT = "List many common English words as a JSON array of strings."


def measure(model: str, early: int, late: int, span: int, log) -> dict[str, Any]:
    from bench.ring_bench import Links
    from edgespec import Ring
    from edgespec.params import GenerationParams

    links = Links(0.0)
    marks = {early: None, early + span: None, late: None, late + span: None}
    try:
        with Ring.local(model, stages=2, threads=1, spec="none", n_ctx=late + span + 512,
                        proxy=links.proxy) as ring:
            label = next(x["label"] for x in links.links if x["label"] == "n0->n1")
            prompt = ring.tokenizer.chat_tokens([{"role": "user", "content": PROMPT}],
                                                add_generation_prompt=True)
            params = GenerationParams.of(json_schema=SCHEMA, max_tokens=late + span + 1,
                                         spec="none")
            n = 0
            t0 = time.perf_counter()
            for chunk in ring.stream_tokens(prompt, params):
                n += len(chunk)
                for at in marks:
                    if marks[at] is None and n >= at:
                        marks[at] = (n, links.counters()[label][0])
                if n >= late + span:
                    break
            seconds = time.perf_counter() - t0
    finally:
        links.close()
    if any(v is None for v in marks.values()):
        raise RuntimeError(f"the answer ended after {n} tokens, before token {late + span}")

    def per_lap(a: int) -> float:
        (n0, b0), (n1, b1) = marks[a], marks[a + span]
        return (b1 - b0) / (n1 - n0)

    e, lt = per_lap(early), per_lap(late)
    log(f"bytes per lap on n0->n1: token {early}: {e:.1f}, token {late}: {lt:.1f}")
    return {"link": "n0->n1 (node 0 to node 1: hidden states and META)",
            "tokens": n, "seconds": round(seconds, 1),
            "bytes_per_lap": {str(early): round(e, 1), str(late): round(lt, 1)},
            "late_over_early": round(lt / e, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b",
                    help="registry name or GGUF path (default: %(default)s)")
    ap.add_argument("--early", type=int, default=100, help="the early token (default 100)")
    ap.add_argument("--late", type=int, default=2000, help="the late token (default 2000)")
    ap.add_argument("--span", type=int, default=20, help="tokens each figure spans")
    ap.add_argument("--smoke", action="store_true", help="seconds: a tiny model, short answer")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    model = args.model
    if args.smoke:
        from bench.smoke import tiny_model

        model = tiny_model()
        args.early, args.late, args.span = 5, 25, 5
    elif not Path(model).is_file():
        from edgespec.llm.models import cached_path

        model = str(cached_path(model))
    result = {"bench": "sampling_bytes", "command": shlex.join(sys.argv),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version()},
              "model": Path(model).name, "schema": SCHEMA,
              **measure(model, args.early, args.late, args.span, log)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
