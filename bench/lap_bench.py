"""Lap benchmark: what a ring costs per lap next to the unsplit model, and whether
``auto`` ever loses to ``none``.

    .venv/bin/python -m bench.lap_bench                       # both parts, defaults below
    .venv/bin/python -m bench.lap_bench --parts overhead --models qwen2.5-coder-0.5b
    .venv/bin/python -m bench.lap_bench --parts modes --target qwen2.5-coder-1.5b \
        --draft qwen2.5-coder-0.5b --stages 4 --hop-ms 10 --modes none,flow,auto

To compare with another commit, run this benchmark from a worktree of that commit (its own
virtualenv or a copy of the built core, its own ``EDGESPEC_HOME`` for shards) alternately with
this tree (docs/experiments.md says how each comparison was run).

Part ``overhead`` (mode none, plain loopback, no link emulator): per model, the unsplit model in
one ``llama_cpp.Llama`` (``single``, one thread, greedy) and rings of 1, 2, 4 node processes (one
llama.cpp thread each), all loaded at once and taking turns for ``--reps`` reps (the order
rotates), so that a shared host's drift hits all alike; a ring's ``x_single`` is the median over
reps of its rate over the single process's in the same rep. A 1-stage ring does the single
process's compute, so what it loses is the per-lap tax: head, transport, node, stage runtime.

Part ``modes``: one ring (default: the one a user gets with no draft model: 0.5B, 2 local
stages, retrieval drafting), chat prompts (the model's chat template), every mode back to back
per prompt, so host load hits all alike. ``--hop-ms`` puts a link emulator on every link.

Writes one JSON object (machine, load averages before/after, commands, per-run records and the
summary) to ``--out`` and prints the summary tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from bench.ring_bench import Links, machine_info  # noqa: E402
from edgespec.laps import combine, lap_lines  # noqa: E402

CODE_PROMPTS = [
    "def quicksort(arr):\n",
    "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):\n",
]

CHAT_PROMPTS = [
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and "
    "non-alphanumeric characters. Include a docstring with two doctest examples.",
    "Explain the difference between a list and a tuple in Python, with a short example.",
    "Write a bash one-liner that counts the lines of every .py file under the current folder.",
    "What does the `with` statement do in Python? Show how to write a context manager.",
    "Write a SQL query that returns the five customers with the highest total order amount.",
]


def _model_path(name: str) -> Path:
    from edgespec.llm import models

    return Path(models.resolve(name))


class SingleModel:
    """The unsplit model in one ``llama_cpp.Llama`` (one thread, greedy), kept open so that it
    can take turns with the rings: the reference every ring is compared with."""

    def __init__(self, path: Path, n_ctx: int = 2048) -> None:
        import llama_cpp

        import edgespec.llm.llamacpp  # noqa: F401  (passive OpenMP before llama_cpp loads)
        from bench.ring_bench import _no_extra_bufts

        with _no_extra_bufts():
            self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=1, n_threads_batch=1,
                                       verbose=False)
        self._is_eog = lambda t: llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, t)  # noqa: SLF001

    def generate(self, prompt: list[int], n_tokens: int) -> dict[str, Any]:
        llm = self.llm
        llm.reset()
        # Prefill like the ring: the prompt minus its last token in one batch; generate() then
        # reuses that prefix and decodes one token per call (the ring's shapes).
        llm.eval(prompt[:-1])
        t, cpu = time.perf_counter(), time.process_time()
        toks: list[int] = []
        for tok in llm.generate(prompt, temp=0.0, repeat_penalty=1.0):
            if self._is_eog(tok):
                break
            toks.append(int(tok))
            if len(toks) >= n_tokens:
                break
        return {"tokens": toks, "decode_s": time.perf_counter() - t,
                "cpu_s": time.process_time() - cpu}

    def close(self) -> None:
        self.llm.close()


def run_overhead(model: str, stages: list[int], n_tokens: int, reps: int,
                 log) -> list[dict[str, Any]]:
    """The unsplit model and one ring per size, all loaded at once and taking turns: each
    rep runs every configuration on every prompt, in an order that rotates between reps, so
    the host's drift (this is a shared 2-core machine) falls on all of them alike. A ring's
    ratio is taken to the single process of the same rep."""
    from edgespec import Ring
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer

    path = _model_path(model)
    vocab = load_model(path, vocab_only=True)
    prompts = [Tokenizer(vocab).encode(p) for p in CODE_PROMPTS]
    vocab.close()
    out: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        single = SingleModel(path)
        stack.callback(single.close)
        rings = {s: stack.enter_context(Ring.local(str(path), stages=s, threads=1, spec="none",
                                                   n_ctx=2048)) for s in stages}
        single.generate(prompts[0], 4)  # warm-up: page in the weights
        for ring in rings.values():
            ring.generate(prompts[0][:16], max_tokens=8, spec="none")
        configs: list[str | int] = ["single", *stages]
        for rep in range(reps):
            k = rep % len(configs)
            for cfg in configs[k:] + configs[:k]:
                for i, p in enumerate(prompts):
                    if cfg == "single":
                        r = single.generate(p, n_tokens)
                        out.append({"model": model, "config": "single", "rep": rep, "prompt": i,
                                    "n_tokens": len(r["tokens"]), "decode_s": r["decode_s"],
                                    "cpu_s": r["cpu_s"],
                                    "tokens_per_s": len(r["tokens"]) / r["decode_s"],
                                    "load_avg_1m": round(os.getloadavg()[0], 2)})
                        continue
                    out.append(_ring_run(rings[cfg], model, cfg, rep, i, p, n_tokens))
            log(f"  {model} rep {rep}: " + ", ".join(
                f"{c}: {_rate([r for r in out if r['rep'] == rep and r['config'] == n]):.2f}"
                for c, n in ((c, c if c == 'single' else f'ring{c}') for c in configs))
                + f" tok/s (load {os.getloadavg()[0]:.2f})")
    return out


def _rate(rs: list[dict[str, Any]]) -> float:
    return sum(r["n_tokens"] for r in rs) / sum(r["decode_s"] for r in rs)


def _ring_run(ring: Any, model: str, stages: int, rep: int, i: int, prompt: list[int],
              n_tokens: int) -> dict[str, Any]:
    ring.reset()
    # Fill the KV with the prompt first: the measured generation then computes decode laps
    # only (its prefill is the prompt's last token), so the stages' compute per batch is a
    # decode lap's.
    ring.generate(prompt, max_tokens=1, spec="none")
    before = stage_busy(ring)
    cpu0 = ring_cpu_s(ring)
    g = ring.generate(prompt, max_tokens=n_tokens, spec="none")
    cpu1 = ring_cpu_s(ring)
    after = stage_busy(ring)
    st = g.stats.as_dict()
    return {"model": model, "config": f"ring{stages}", "rep": rep, "prompt": i,
            "n_tokens": len(g.tokens), "decode_s": g.stats.decode_s, "cpu_s": cpu1 - cpu0,
            "tokens_per_s": st["tokens_per_s"], "stats": st,
            "breakdown": breakdown(g.stats, before, after),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def ring_cpu_s(ring: Any) -> float:
    """CPU seconds used so far by this (head) process and every local node process, all
    threads (Linux schedstat, nanoseconds): what a ring costs the host whatever its load."""
    total = time.process_time()
    for p in getattr(getattr(ring, "local_nodes", None), "procs", []):
        for task in Path(f"/proc/{p.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                total += int((task / "schedstat").read_text().split()[0]) / 1e9
    return total


def stage_busy(ring: Any) -> dict[int, tuple[float, int]]:
    """Per stage: seconds its node spent computing batches, and batches, so far (the nodes'
    health report)."""
    out: dict[int, tuple[float, int]] = {}
    for m in getattr(ring.chain, "members", []):
        h = m.request("health", timeout=30).meta
        for st, v in (h.get("stages") or {}).items():
            out[int(st)] = (float(v.get("busy_s", 0.0)), int(v.get("batches", 0)))
    return out


def breakdown(stats: Any, before: dict[int, tuple[float, int]],
              after: dict[int, tuple[float, int]]) -> dict[str, Any]:
    """Where a token's time went in mode none, in ms per token: ``head`` (the head's own work
    between laps: engine, API, detokenizing), ``lap`` (submit to result), of which
    ``stages`` computed (per stage: the node's batch work, llama_decode and its Python
    around it) and ``rest`` (transport, queues, thread wake-ups, result handling)."""
    n = max(1, stats.tokens)
    comp = []
    for st in sorted(after):
        b0, n0 = before.get(st, (0.0, 0))
        b1, n1 = after[st]
        comp.append(round((b1 - b0) * 1e3 / max(1, n1 - n0), 2))
    lap = stats.plain_wait_s * 1e3 / max(1, getattr(stats, "plain_laps", stats.plain_steps))
    return {"ms_per_token": round(stats.decode_s * 1e3 / n, 2),
            "head": round((stats.decode_s - stats.plain_wait_s) * 1e3 / n, 2),
            "lap": round(lap, 2), "stages": comp, "rest": round(lap - sum(comp), 2)}


def summarize_overhead(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and configuration: tokens/s over every run, and ``x_single``, the median over
    reps of (this configuration's rate / the single process's rate in the same rep), with the
    per-rep ratios beside it."""
    rows = []
    for model in dict.fromkeys(r["model"] for r in runs):
        mine = [r for r in runs if r["model"] == model]
        singles = [r for r in mine if r["config"] == "single"]
        reps = sorted({r["rep"] for r in mine})
        ref = {rep: _rate([r for r in singles if r["rep"] == rep]) for rep in reps}
        ref_all = _rate(singles)
        ref_cpu = sum(r["cpu_s"] for r in singles) * 1e3 / sum(r["n_tokens"] for r in singles)
        for cfg in dict.fromkeys(r["config"] for r in mine):
            rs = [r for r in mine if r["config"] == cfg]
            tps = _rate(rs)
            per_rep = [round(_rate([r for r in rs if r["rep"] == rep]) / ref[rep], 3)
                       for rep in reps]
            row = {"model": model, "config": cfg, "tokens_per_s": round(tps, 2),
                   "x_single": round(statistics.median(per_rep), 3),
                   "x_single_per_rep": per_rep,
                   "ms_per_token": round(1e3 / tps, 2),
                   "extra_ms_per_token": round(1e3 / tps - 1e3 / ref_all, 2)}
            # CPU per token, all processes: the tax as the host pays it, load or not.
            cpu = sum(r["cpu_s"] for r in rs) * 1e3 / sum(r["n_tokens"] for r in rs)
            row["cpu_ms_per_token"] = round(cpu, 2)
            row["x_single_cpu"] = round(ref_cpu / cpu, 3)
            bd = [r["breakdown"] for r in rs if "breakdown" in r]
            if bd:
                row["head_ms"] = round(statistics.mean(b["head"] for b in bd), 2)
                row["lap_ms"] = round(statistics.mean(b["lap"] for b in bd), 2)
                row["stages_ms"] = [round(statistics.mean(b["stages"][k] for b in bd), 2)
                                    for k in range(len(bd[0]["stages"]))]
                row["rest_ms"] = round(statistics.mean(b["rest"] for b in bd), 2)
                row["lap_timing"] = combine([r["stats"].get("lap_timing") for r in rs])
            rows.append(row)
    return rows


def run_modes(target: str, draft: str | None, stages: int, hop_ms: float, modes: list[str],
              n_tokens: int, n_prompts: int, log, reps: int = 1) -> list[dict[str, Any]]:
    """Every prompt in every mode, ``reps`` times; each rep rotates the modes' order, so a
    mode does not always follow the same one (host drift within a prompt's block evens
    out)."""
    from edgespec import Ring

    links = Links(hop_ms) if hop_ms > 0 else None
    kwargs: dict[str, Any] = {"proxy": links.proxy} if links else {}
    out: list[dict[str, Any]] = []
    try:
        with Ring.local(str(_model_path(target)), stages=stages,
                        draft=str(_model_path(draft)) if draft else None, threads=1,
                        spec="none", **kwargs) as ring:
            def chat(msg: list[dict[str, str]], m: str, n: int) -> Any:
                ring.engine.reset()  # every mode starts from an empty cache, as the first did
                return ring.chat(msg, max_tokens=n, spec=m)

            msgs = [[{"role": "user", "content": c}] for c in CHAT_PROMPTS[:n_prompts]]
            for m in modes:  # warm-up: page in weights, give the cost model laps
                chat(msgs[0], m, 8)
            turns = [(rep, i, msg, m) for rep in range(reps) for i, msg in enumerate(msgs)
                     for m in modes[rep % len(modes):] + modes[:rep % len(modes)]]
            for rep, i, msg, m in turns:
                g = chat(msg, m, n_tokens)
                st = g.stats.as_dict()
                out.append({"mode": m, "resolved": st["mode"], "prompt": i, "rep": rep,
                            "n_tokens": len(g.tokens), "decode_s": g.stats.decode_s,
                            "tokens_per_s": st["tokens_per_s"], "tokens": g.tokens,
                            "stats": st, "load_avg_1m": round(os.getloadavg()[0], 2)})
                log(f"  r{rep} p{i} {m:<5} ({st['mode']}) {st['tokens_per_s']:7.2f} tok/s  "
                    f"steps {st['steps']} plain {st.get('plain_steps', '-')} "
                    f"acc/round {st['mean_accepted_per_step']:.2f}")
    finally:
        if links:
            links.close()
    return out


def summarize_modes(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: decode tokens/s and ``x_none``; and ``x_none_with_prefill``, over prefill and
    decode together: mode none takes its first token from the prefill lap (docs/design.md
    5.8), so its decode time lacks that token's lap and decode-only rates favour it."""
    def rate(rs: list[dict[str, Any]]) -> float:
        return sum(r["n_tokens"] for r in rs) / sum(r["decode_s"] for r in rs)

    def rate_all(rs: list[dict[str, Any]]) -> float:
        return sum(r["n_tokens"] for r in rs) / sum(
            r["decode_s"] + r["stats"]["prefill_ms"] / 1e3 for r in rs)

    none = [r for r in runs if r["mode"] == "none"]
    ref = rate(none) if none else None
    ref_all = rate_all(none) if none else None
    reps = sorted({r.get("rep", 0) for r in runs})
    rows = []
    for m in dict.fromkeys(r["mode"] for r in runs):
        rs = [r for r in runs if r["mode"] == m]
        tps = rate(rs)
        same = sum(r["tokens"] == n["tokens"] for r, n in zip(rs, none, strict=False))
        per_rep = [round(rate_all([r for r in rs if r.get("rep", 0) == k])
                         / rate_all([r for r in none if r.get("rep", 0) == k]), 3)
                   for k in reps] if none else []
        rows.append({"mode": m, "tokens_per_s": round(tps, 2),
                     "x_none": round(tps / ref, 3) if ref else None,
                     "x_none_with_prefill": round(rate_all(rs) / ref_all, 3) if ref_all else None,
                     # per rep (every prompt once), then their median: the modes of one rep
                     # ran back to back, so each ratio carries less of the host's drift
                     "x_none_with_prefill_per_rep": per_rep,
                     "x_none_with_prefill_median": (round(statistics.median(per_rep), 3)
                                                    if per_rep else None),
                     # (an engine from before plain_steps was counted: unknown)
                     "tree_steps": sum(r["stats"]["steps"] - r["stats"]["plain_steps"]
                                        for r in rs) if all("plain_steps" in r["stats"]
                                                            for r in rs) else "?",
                     "steps": sum(r["stats"]["steps"] for r in rs),
                     "same_as_none": f"{same}/{len(rs)}",
                     "lap_timing": combine([r["stats"].get("lap_timing") for r in rs])})
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "lap_timing"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    for r in rows:  # the lap-timing view under the table, one block per row
        view = lap_lines(r.get("lap_timing"))
        if view:
            lines += ["", " ".join(str(r[k]) for k in ("model", "config", "mode") if k in r)]
            lines += view
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="overhead,modes")
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--ring-stages", default="1,2,4", help="overhead part: ring sizes")
    ap.add_argument("--tokens", type=int, default=64, help="overhead part: tokens per prompt")
    ap.add_argument("--reps", type=int, default=4, help="overhead part: turns of every config")
    ap.add_argument("--target", default="qwen2.5-coder-0.5b", help="modes part")
    ap.add_argument("--draft", default=None, help="modes part (default: no draft model)")
    ap.add_argument("--stages", type=int, default=2, help="modes part")
    ap.add_argument("--hop-ms", type=float, default=0.0, help="modes part")
    ap.add_argument("--modes", default="none,sync,flow,auto", help="modes part")
    ap.add_argument("--chat-tokens", type=int, default=96)
    ap.add_argument("--chat-prompts", type=int, default=5)
    ap.add_argument("--mode-reps", type=int, default=1,
                    help="modes part: turns of every prompt in every mode (order rotated)")
    ap.add_argument("--out", default="bench/results/lap_bench.json")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import edgespec

    result: dict[str, Any] = {
        "command": "python -m bench.lap_bench " + " ".join(map(shlex.quote, argv or sys.argv[1:])),
        "edgespec_from": str(Path(edgespec.__file__).parent),
        "machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    parts = args.parts.split(",")
    if "overhead" in parts:
        runs = []
        for model in args.models.split(","):
            runs += run_overhead(model, [int(s) for s in args.ring_stages.split(",")],
                                 args.tokens, args.reps, log)
        result["overhead_runs"] = runs
        result["overhead"] = summarize_overhead(runs)
        print(_table(result["overhead"]))
    if "modes" in parts:
        runs = run_modes(args.target, args.draft, args.stages, args.hop_ms,
                         args.modes.split(","), args.chat_tokens, args.chat_prompts, log,
                         reps=args.mode_reps)
        result["modes_setup"] = {"target": args.target, "draft": args.draft,
                                 "stages": args.stages, "hop_ms": args.hop_ms}
        result["modes_runs"] = runs
        result["modes"] = summarize_modes(runs)
        print(_table(result["modes"]))
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
