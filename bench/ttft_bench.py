"""Time to first token for a long prompt: alone, and while other requests decode.

    .venv/bin/python -m bench.ttft_bench                       # 1.5B target, 0.5B draft,
                                                              # 4 stages, 10 ms per hop
    .venv/bin/python -m bench.ttft_bench --busy 0             # alone only (any version)
    .venv/bin/python -m bench.ttft_bench --smoke              # seconds: a tiny model, 2
                                                              # stages, 64 tokens, 1 busy

What runs: one ring of ``Ring.local`` node processes, every link through its own
``bench.linkemu`` proxy with ``--hop-ms`` one-way delay (``bench.ring_bench.Links``).

- ``alone``: a prompt of exactly ``--prompt-tokens`` tokens (HumanEval problems one after
  another, cut to length), the KV reset before each, ``--reps`` times per mode. TTFT is taken
  where the caller sees it: from the call to the first piece of text the stream yields.
- ``busy`` (``--busy K`` > 0, a ring with ``parallel=K+1`` slots): K clients decode short
  HumanEval prompts back to back; once every one has produced tokens, the long prompt
  arrives. Its TTFT, and what the others saw meanwhile: their longest gap between two
  tokens and their tokens/s from the long prompt's arrival to its first token, against
  their tokens/s before it arrived.

The same file runs against an older checkout (``--busy 0`` where slots do not exist yet):
copy it into that tree's ``bench/`` and run it with that tree's venv. Output: JSON with the
machine, settings and every measurement (``--out``), a summary on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ring_bench import Links, humaneval_prompts, machine_info  # noqa: E402


def _model_path(name: str) -> str:
    from edgespec.llm import models

    return str(models.resolve(name))


def long_prompt(ring: Any, n_tokens: int) -> list[int]:
    """Exactly ``n_tokens`` tokens of HumanEval problems, one after another."""
    toks: list[int] = []
    for p in humaneval_prompts(60):
        toks += ring.tokenizer.encode(p["prompt"], add_special=False)
        if len(toks) >= n_tokens:
            return toks[:n_tokens]
    raise SystemExit(f"--prompt-tokens {n_tokens}: more than 60 HumanEval problems hold")


def first_token_s(ring: Any, prompt: list[int], mode: str, max_tokens: int) -> float:
    """Seconds from the call to the first text piece; the rest of the stream is read too."""
    t0 = time.perf_counter()
    ttft = None
    for _piece in ring.stream_tokens(prompt, max_tokens=max_tokens, spec=mode,
                                     temperature=0.0):
        if ttft is None:
            ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


class Decoder(threading.Thread):
    """A client decoding short prompts back to back, recording when each token came."""

    def __init__(self, ring: Any, prompts: list[list[int]], mode: str, n_tokens: int) -> None:
        super().__init__(daemon=True)
        self.ring, self.prompts, self.mode, self.n_tokens = ring, prompts, mode, n_tokens
        self.times: list[float] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            i = 0
            while not self.stop.is_set():
                prompt = self.prompts[i % len(self.prompts)]
                i += 1
                stream = self.ring.stream_tokens(prompt, max_tokens=self.n_tokens,
                                                 spec=self.mode, temperature=0.0)
                try:
                    for _piece in stream:
                        self.times.append(time.perf_counter())
                        if self.stop.is_set():
                            break
                finally:
                    stream.close()  # its slot is free now (see Ring.reset in run_busy)
        except BaseException as e:  # reported by the main thread
            self.error = e


def rate(times: list[float], a: float, b: float) -> float:
    n = sum(a <= t <= b for t in times)
    return n / (b - a) if b > a else 0.0


def max_gap(times: list[float], a: float, b: float) -> float:
    """Longest wait for a token between a and b (a token's arrival, or a and b themselves)."""
    ts = [a, *[t for t in times if a < t < b], b]
    return max(y - x for x, y in zip(ts, ts[1:], strict=False))


def run_busy(ring: Any, prompt: list[int], mode: str, k: int, reps: int, wait_s: float,
             log) -> list[dict[str, Any]]:
    shorts = [ring.tokenizer.encode(f"# client {c}\n" + p["prompt"])
              for c, p in enumerate(humaneval_prompts(8))]
    out = []
    for rep in range(reps):
        ring.reset()
        decoders = [Decoder(ring, shorts[c::k] or shorts, mode, 256) for c in range(k)]
        for d in decoders:
            d.start()
        t_wait = time.perf_counter()
        while any(len(d.times) < 8 for d in decoders):  # every one decoding
            if any(d.error for d in decoders) or time.perf_counter() - t_wait > 600:
                break
            time.sleep(0.05)
        t_before = time.perf_counter()
        time.sleep(wait_s)
        t0 = time.perf_counter()
        # A prompt of its own: "# long N" first, so no slot's KV holds a prefix of it.
        mine = ring.tokenizer.encode(f"# long {rep}\n", add_special=False) + prompt
        mine = mine[: len(prompt)]
        ttft = first_token_s(ring, mine, mode, 8)
        t1 = t0 + ttft
        for d in decoders:
            d.stop.set()
        for d in decoders:
            d.join(timeout=600)
        errors = [repr(d.error) for d in decoders if d.error]
        if errors:
            raise SystemExit(f"a decoding client failed: {errors}")
        row = {"mode": mode, "busy": k, "rep": rep, "ttft_s": round(ttft, 3),
               "others_tok_s_before": round(sum(rate(d.times, t_before, t0)
                                                for d in decoders), 2),
               "others_tok_s_during": round(sum(rate(d.times, t0, t1) for d in decoders), 2),
               "others_max_gap_s": round(max(max_gap(d.times, t0, t1) for d in decoders), 3),
               "load_avg_1m": round(os.getloadavg()[0], 2)}
        log(f"  busy {k} {mode} rep {rep}: {row}")
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="'-': none (retrieval)")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--hop-ms", type=float, default=10.0)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--modes", default="none,flow")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--busy", type=int, default=3,
                    help="clients decoding meanwhile in the busy part (0: alone only)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--busy-wait-s", type=float, default=3.0,
                    help="how long the busy clients decode before the long prompt arrives")
    ap.add_argument("--out", default="bench/results/ttft_bench.json")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: a tiny model (unless --target) drafting by retrieval, 2 "
                         "stages, no delay, a 64-token prompt, 1 rep, 1 busy client; writes "
                         "into the temporary folder (unless --out)")
    args = ap.parse_args(argv)
    if args.smoke:
        from bench import smoke

        smoke.apply(ap, args, target=smoke.tiny_model, draft="-", stages=2, hop_ms=0.0,
                    prompt_tokens=64, reps=1, busy=1, busy_wait_s=0.5,
                    out=str(smoke.scratch_path("ttft_bench.json")))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import edgespec
    from edgespec import Ring

    modes = args.modes.split(",")
    result: dict[str, Any] = {
        "command": "python -m bench.ttft_bench " + " ".join(map(shlex.quote,
                                                                argv or sys.argv[1:])),
        "edgespec_from": str(Path(edgespec.__file__).parent), "machine": machine_info(),
        "settings": vars(args), "alone": [], "busy": []}
    draft = None if args.draft == "-" else _model_path(args.draft)
    for part in ("alone", "busy"):
        if part == "busy" and args.busy <= 0:
            continue
        links = Links(args.hop_ms)
        extra = {"parallel": args.busy + 1} if part == "busy" else {}
        try:
            with Ring.local(_model_path(args.target), stages=args.stages, draft=draft,
                            threads=args.threads, spec="none", n_ctx=4096 * (args.busy + 1)
                            if part == "busy" else 4096, proxy=links.proxy, **extra) as ring:
                prompt = long_prompt(ring, args.prompt_tokens)
                first_token_s(ring, prompt[:64], modes[0], 4)  # page in the weights
                for mode in modes:
                    if part == "alone":
                        for rep in range(args.reps):
                            ring.reset()
                            ttft = first_token_s(ring, prompt, mode, 8)
                            row = {"mode": mode, "rep": rep, "ttft_s": round(ttft, 3),
                                   "load_avg_1m": round(os.getloadavg()[0], 2)}
                            log(f"  alone {mode} rep {rep}: {row}")
                            result["alone"].append(row)
                    else:
                        result["busy"] += run_busy(ring, prompt, mode, args.busy, args.reps,
                                                   args.busy_wait_s, log)
        finally:
            links.close()
    summary = {}
    for part in ("alone", "busy"):
        for mode in modes:
            rows = [r for r in result[part] if r["mode"] == mode]
            if rows:
                summary[f"{part}_{mode}_ttft_s_median"] = round(
                    statistics.median(r["ttft_s"] for r in rows), 3)
            if part == "busy" and rows:
                summary[f"busy_{mode}_others_max_gap_s_median"] = round(
                    statistics.median(r["others_max_gap_s"] for r in rows), 3)
                summary[f"busy_{mode}_others_tok_s_during_vs_before"] = round(
                    sum(r["others_tok_s_during"] for r in rows)
                    / max(1e-9, sum(r["others_tok_s_before"] for r in rows)), 3)
    result["summary"] = summary
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
