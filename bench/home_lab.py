"""Home lab benchmark: a ring of capped devices, planned by the planner, on one host.

    .venv/bin/python -m bench.home_lab             # as root: 1.5B target, 3 prompts x 4 reps
    .venv/bin/python -m bench.home_lab --quick     # 0.5B, caps scaled to it, about 2 minutes
    .venv/bin/python -m bench.home_lab --smoke     # a tiny model, scenario c, about a minute

Every device is a device of ``tests/lab.py``'s ``HomeLab``: a network namespace on one bridge,
its own memory cgroup (cap) and CPU quota, its own EDGESPEC_HOME, an ``edgespec node`` in it;
a head in a namespace of its own forms the ring with ``edgespec ring up --nodes auto`` (mDNS,
the planner on each node's profile and free memory), exactly as a user would. Needs root.

What one run does:

1. The unsplit model's 16 greedy tokens for a code prompt, computed in a process with no cap
   (its peak is recorded too), twice: the prompt put in token by token at its end (all
   but its last token, then the last: the reference) and as the ring's prefill does (one
   batch). Then the unsplit model under one device's cap (``--unsplit-cap``): killed or not,
   and its peak.
2. Scenarios of three devices, each in a fresh lab (fresh homes, fresh cgroups, so every peak
   covers the device's whole life: node start, profile, shards received, load, generation):
   ``a`` 650/650/650 MiB; ``b`` 1100/1100/420 MiB (the small device named last, so it is the
   last one found); ``b_mid`` the same caps with the small device in the middle;
   ``c`` one device at 25% of a core, all with room (``--caps-c``). Per scenario: whether the
   ring formed (and if not, why), per device its layer window, peak memory (its cgroup's:
   ``memory.peak`` on v2, ``memory.max_usage_in_bytes`` on v1, page cache included), OOM kills
   and whether its node is still alive, and the ring's 16 greedy tokens (mode none) against
   both references; where they part from the reference, the unsplit model's logit gap
   between the two tokens there (under 0.5: a near-tie that rounding per batch shape may
   flip, docs/design.md 3.9).
3. Planned against even, for scenario ``c``: the planned ring of ``c`` stays up, and three twin
   devices (same caps, same quota) join the lab and form a second ring with
   ``ring up --nodes <the twins, in the planned ring's order> --ranges <even split>``, so the
   slow device holds the same place in both rings and only the split differs. One head process
   attaches to both rings and runs every chat prompt in every mode (``none``, and ``flow``
   with retrieval drafting: no draft model) on both, the ring order flipping per prompt, so
   drift of the shared host hits both. Tokens/s is decode tokens over decode time summed over
   prompts; ``with_prefill`` adds the prefill time. Both rings' generations are compared token
   for token too.

Output: JSON on stdout and in ``--out``, and a Markdown table beside it (same name, ``.md``),
with the machine (``ring_bench.machine_info``) and the exact command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the lab itself (tests/lab.py, tests/netns.py)

import lab as homelab  # noqa: E402

from bench.ring_bench import NEAR_TIE, machine_info  # noqa: E402

CHAT_PROMPTS = [
    "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and "
    "non-alphanumeric characters. Include a docstring with two doctest examples.",
    "Explain the difference between a list and a tuple in Python, with a short example.",
    "Write a bash one-liner that counts the lines of every .py file under the current folder.",
    "What does the `with` statement do in Python? Show how to write a context manager.",
    "Write a SQL query that returns the five customers with the highest total order amount.",
]

CODE_PROMPT = "def fibonacci(n):\n"
EXACT_TOKENS = 16

# The unsplit model greedy, in a process of its own, then one token per call. Its prompt goes
# in token by token at its end (shape "split": all but the last token in
# one batch, the last alone) or as the ring's prefill does (shape "whole": one batch, its last
# row wanted). ``n_ctx`` is 1024 for the references (as the tests'), the ring's 4096 when the
# unsplit model plays a device. With a pair of tokens after the prompt, it prints instead the
# logit gap between them where the greedy run stands after the prompt (shape "split").
UNSPLIT = r"""
import json, sys
import numpy as np
from edgespec.node.runtime import StageRuntime
model, n_ctx, n, shape = sys.argv[1], int(sys.argv[2]), int(sys.argv[4]), sys.argv[5]
prompt = json.loads(sys.argv[3])
out = []
with StageRuntime(model, n_ctx=n_ctx, n_seq_max=1, n_threads=1) as rt:
    print("loaded", file=sys.stderr, flush=True)
    if shape == "whole":
        logits = rt.forward(np.asarray(prompt, np.int32), 0)
    else:
        rt.forward(np.asarray(prompt[:-1], np.int32), 0)
        logits = rt.forward(np.asarray(prompt[-1:], np.int32), len(prompt) - 1)
    if len(sys.argv) > 6:
        a, b = json.loads(sys.argv[6])
        print(json.dumps(float(logits[-1][a] - logits[-1][b])))
        sys.exit(0)
    tok, pos = int(np.argmax(logits[-1])), len(prompt)
    for _ in range(n):
        out.append(tok)
        logits = rt.forward(np.array([tok], np.int32), pos)
        pos += 1
        tok = int(np.argmax(logits[-1]))
print(json.dumps(out))
"""

# The head's side of the exactness check: attach to the ring `ring up` saved, greedy, mode none.
GENERATE = r"""
import json, sys
from edgespec.api import Ring
ids, n = json.loads(sys.argv[1]), int(sys.argv[2])
with Ring.attach(spec="none") as ring:
    g = ring.generate(ids, max_tokens=n, spec="none", ignore_eos=True)
    print(json.dumps({"tokens": g.tokens, "tokens_per_s": g.stats.tokens_per_s}))
"""

# The head's side of planned against even: both rings attached in one process, every prompt
# in every mode on both, whose order flips per prompt (and per rep).
COMPARE = r"""
import json, os, sys, time
from edgespec.api import Ring
cfg = json.loads(sys.argv[1])
names = list(cfg["rings"])
rings = {k: Ring.attach(state=p, spec="none") for k, p in cfg["rings"].items()}
msgs = [[{"role": "user", "content": c}] for c in cfg["prompts"]]

def run(ring, msg, mode, n):
    ring.reset()  # every generation from an empty cache: prefill plus decode
    return ring.chat(msg, max_tokens=n, spec=mode, ignore_eos=True)

def log(s):
    print(s, file=sys.stderr, flush=True)

try:
    for k in names:  # warm-up: weights paged in, the cost model and drafter given laps
        for m in cfg["modes"]:
            run(rings[k], msgs[0], m, 8)
    out = []
    for rep in range(cfg["reps"]):
        for i, msg in enumerate(msgs):
            order = names if (i + rep) % 2 == 0 else names[::-1]
            for m in cfg["modes"]:
                for k in order:
                    g = run(rings[k], msg, m, cfg["tokens"])
                    st = g.stats.as_dict()
                    st.pop("lap_timing", None)
                    out.append({"ring": k, "mode": m, "prompt": i, "rep": rep,
                                "n_tokens": len(g.tokens), "decode_s": g.stats.decode_s,
                                "prefill_s": g.stats.prefill_s, "tokens": g.tokens,
                                "stats": st, "load_avg_1m": round(os.getloadavg()[0], 2)})
                    log(f"    r{rep} p{i} {m:<5} {k:<8} {st['tokens_per_s']:6.2f} tok/s "
                        f"(prefill {st['prefill_ms']:.0f} ms, steps {st['steps']}, "
                        f"load {os.getloadavg()[0]:.2f})")
finally:
    for r in rings.values():
        r.close()
print(json.dumps(out))
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ unsplit

def drop_page_cache(path: Path) -> None:
    """A file page is charged to the cgroup that first reads it: with the model still in the
    page cache from an earlier run, a peak would leave out what a device reading its own copy
    is charged for. So the file's clean pages are dropped before each measured run (every
    device of the lab reads the one model file on this host, as if it were its own copy)."""
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


#: How long the mapped unsplit model may page its weights under a device's cap before the run
#: is called off (16 tokens take about 3 s without a cap).
UNSPLIT_MAPPED_TIMEOUT_S = 120


def unsplit(model: Path, prompt_ids: list[int], n_ctx: int, cap_mib: int | None,
            shape: str = "split", mapped: bool = True, timeout: float = 900) -> dict[str, Any]:
    """The unsplit model's greedy tokens in a cgroup of its own (``cap_mib`` None: no limit,
    the cgroup only measures its peak). ``mapped`` False reads the file into memory; mapped
    under a cap too small for it, the process is not killed but re-reads its weights from the
    file as the kernel evicts them, so ``timeout`` bounds that run."""
    drop_page_cache(model)
    cg = homelab.Cgroup(f"edgespec-bench-unsplit-{uuid.uuid4().hex[:6]}")
    try:
        cg.cap(memory_mib=cap_mib)
        t0 = time.monotonic()
        out: dict[str, Any] = {"cap_mib": cap_mib, "n_ctx": n_ctx, "prompt_shape": shape,
                               "mapped": mapped, "timeout_s": timeout}
        try:
            res = subprocess.run(
                cg.wrap([sys.executable, "-c", UNSPLIT, str(model), str(n_ctx),
                         json.dumps(prompt_ids), str(EXACT_TOKENS), shape]),
                capture_output=True, text=True, timeout=timeout,
                env=dict(os.environ, OMP_WAIT_POLICY="passive",
                         EDGESPEC_MMAP="1" if mapped else "0"))
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            out.update({"returncode": None, "timed_out": True, "loaded": "loaded" in err,
                        "oom_kills": cg.oom_kills(), "peak_mib": cg.peak_mib(),
                        "wall_s": round(time.monotonic() - t0, 1), "killed": False})
            return out
        out.update({"returncode": res.returncode, "timed_out": False,
                    "loaded": "loaded" in res.stderr, "oom_kills": cg.oom_kills(),
                    "peak_mib": cg.peak_mib(), "wall_s": round(time.monotonic() - t0, 1)})
        out["killed"] = res.returncode != 0 and out["oom_kills"] > 0
        if res.returncode == 0:
            out["tokens"] = json.loads(res.stdout.strip().splitlines()[-1])
        else:
            out["stderr_tail"] = res.stderr[-600:]
        return out
    finally:
        cg.close()


def logit_gap(model: Path, seq: list[int], want: int, got: int) -> float:
    """The unsplit model's logit of ``want`` minus that of ``got`` after ``seq``: how torn
    the model itself is where a ring's greedy output parts from the reference."""
    res = subprocess.run([sys.executable, "-c", UNSPLIT, str(model), "1024", json.dumps(seq),
                          "0", "split", json.dumps([want, got])], capture_output=True,
                         text=True, timeout=900, check=True,
                         env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    return float(json.loads(res.stdout.strip().splitlines()[-1]))


def check_tokens(got: list[int] | None, refs: dict[str, list[int]], model: Path,
                 prompt_ids: list[int]) -> dict[str, Any]:
    """``got`` against each reference; where it parts from the tests' reference, the first
    difference and the unsplit model's logit gap there (below ``NEAR_TIE``: a near-tie that
    batch-shape rounding may flip, docs/design.md 3.9)."""
    if got is None:
        return {"exact": False}
    ref = refs["split"]
    out: dict[str, Any] = {"exact": got == ref, "exact_ring_shape": got == refs["whole"]}
    k = next((i for i, (x, y) in enumerate(zip(got, ref, strict=False)) if x != y), None)
    if k is not None:
        gap = logit_gap(model, prompt_ids + ref[:k], ref[k], got[k])
        out.update(first_difference=k, gap_at_difference=round(gap, 4),
                   near_tie=abs(gap) < NEAR_TIE)
    return out


# ------------------------------------------------------------------------------ scenarios

def ring_up(lab: homelab.HomeLab, model: Path, key_file: Path, *, nodes: str = "auto",
            ranges: str | None = None, head_home: Path | None = None) -> dict[str, Any]:
    argv = [*homelab.edgespec(), "ring", "up", "--model", str(model), "--nodes", nodes,
            "--key-file", str(key_file)]
    if nodes == "auto":
        argv += ["--expect", "3", "--timeout", "60"]
    if ranges:
        argv += ["--ranges", ranges]
    home = head_home or lab.head_home
    home.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    res = lab.head.run(argv, env=homelab.env_for(home), cwd=homelab.REPO, timeout=1200,
                       check=False)
    out = {"ok": res.returncode == 0, "seconds": round(time.monotonic() - t0, 1),
           "command": " ".join(["edgespec", *argv[len(homelab.edgespec()):]])}
    if res.returncode == 0:
        out["plan_table"] = res.stdout.split("ring plan:\n", 1)[-1].split("\nloading", 1)[0]
        # What gave way for the ring to fit (planner.fit_plan): fewer sequences, roomy ends.
        out["plan_notes"] = [line for line in res.stdout.splitlines()
                             if "sequences" in line or "hold the ends" in line]
    else:
        out["error"] = (res.stderr.strip() or res.stdout.strip())[-800:]
    return out


def ring_state(home: Path) -> dict[str, Any]:
    """Per device of the saved ring, in ring order: its layer window(s) and address."""
    state = json.loads((home / "ring.json").read_text())
    nodes = state["nodes"]
    out: dict[str, Any] = {n["name"]: {"order": i, "address": f"{n['host']}:{n['port']}",
                                       "windows": [], "layers": 0}
                           for i, n in enumerate(nodes)}
    for _stage, node, a, b in state["plan"]["windows"]:
        d = out[nodes[node]["name"]]
        d["windows"].append(f"{a}:{b}")
        d["layers"] += b - a
    return out


def head_generate(lab: homelab.HomeLab, prompt_ids: list[int]) -> dict[str, Any]:
    res = lab.head.run([sys.executable, "-c", GENERATE, json.dumps(prompt_ids),
                        str(EXACT_TOKENS)], env=homelab.env_for(lab.head_home),
                       cwd=homelab.REPO, timeout=900, check=False)
    if res.returncode != 0:
        return {"error": res.stderr[-800:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def device_record(d: homelab.Device) -> dict[str, Any]:
    """The cgroup's peak counts page cache, which the kernel lets grow to the cap and then
    reclaims, so a peak at the cap alone says little: beside it, how often the cgroup reached
    its limit, and the node process's own peak resident memory (anonymous and mapped file
    pages)."""
    alive = d.node is not None and d.node.poll() is None
    out = {"peak_mib": d.cgroup.peak_mib(), "oom_kills": d.cgroup.oom_kills(),
           "limit_hits": limit_hits(d.cgroup), "node_alive": alive, "node_peak_rss_mib": None}
    if alive:
        with contextlib.suppress(OSError, ValueError, KeyError):
            status = dict(line.split(":", 1) for line in
                          Path(f"/proc/{d.node.pid}/status").read_text().splitlines()
                          if ":" in line)
            out["node_peak_rss_mib"] = int(status["VmHWM"].split()[0]) >> 10
    return out


def cpu_throttling(cg: homelab.Cgroup) -> dict[str, float]:
    """The CPU quota's bite so far: periods with runnable work, periods the quota ran out in,
    and seconds held back (``cpu.stat``: v1 nanoseconds, v2 microseconds)."""
    f = cg.dirs[0 if cg.v2 else 1] / "cpu.stat"
    with contextlib.suppress(OSError, ValueError):
        st = dict(line.split() for line in f.read_text().splitlines() if line.strip())
        held = (int(st["throttled_usec"]) / 1e6 if "throttled_usec" in st
                else int(st.get("throttled_time", 0)) / 1e9)
        return {"periods": int(st.get("nr_periods", 0)),
                "throttled_periods": int(st.get("nr_throttled", 0)),
                "throttled_s": round(held, 3)}
    return {}


def limit_hits(cg: homelab.Cgroup) -> int | None:
    """Times the cgroup's usage reached its memory limit (v1 ``memory.failcnt``, v2 the
    ``max`` count of ``memory.events``)."""
    with contextlib.suppress(OSError, ValueError):
        if cg.v2:
            for line in (cg.dirs[0] / "memory.events").read_text().splitlines():
                if line.startswith("max "):
                    return int(line.split()[1])
            return None
        return int((cg.dirs[0] / "memory.failcnt").read_text())
    return None


def scenario(name: str, caps: dict[str, tuple[int, float | None]], model: Path,
             key_file: Path, workdir: Path, prompt_ids: list[int],
             refs: dict[str, list[int]], compare: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """One lab of three devices capped as ``caps`` says (name -> (MiB, CPU share or None)),
    its ring formed over mDNS and checked; with ``compare``, also planned against even
    (``compare_rings``) before the lab closes."""
    names = list(caps)
    twins = {n: f"{n}e" for n in names} if compare else {}
    record: dict[str, Any] = {
        "scenario": name,
        "caps": {n: {"memory_mib": m, "cpu_share": c} for n, (m, c) in caps.items()}}
    log(f"scenario {name}: " + ", ".join(
        f"{n} {m} MiB" + (f" {c:.0%} CPU" if c else "") for n, (m, c) in caps.items()))
    drop_page_cache(model)
    with homelab.HomeLab([*names, *twins.values()], workdir / name) as lab:
        for n, (mem, cpu) in caps.items():
            lab.device(n).cap(memory_mib=mem, cpu_share=cpu)
            if n in twins:
                lab.device(twins[n]).cap(memory_mib=mem, cpu_share=cpu)
        for n in names:  # only these advertise while the planned ring forms
            lab.device(n).start_node(key_file, lab.workdir)
        up = ring_up(lab, model, key_file)
        record["ring_up"] = up
        log(f"  ring up: {'ok' if up['ok'] else 'FAILED'} in {up['seconds']} s"
            + ("" if up["ok"] else f": {up['error'].splitlines()[-1]}"))
        layout: dict[str, Any] = {}
        if up["ok"]:
            layout = ring_state(lab.head_home)
            gen = head_generate(lab, prompt_ids)
            record["generation"] = gen
            record.update(check_tokens(gen.get("tokens"), refs, model, prompt_ids))
        record["devices"] = {n: {**caps_of(caps, n), **layout.get(n, {"layers": 0}),
                                 **device_record(lab.device(n))} for n in names}
        record["any_oom_killed"] = any(d["oom_kills"] > 0 for d in record["devices"].values())
        log("  " + "; ".join(f"{n}: {d['layers']} layers, peak {d['peak_mib']} MiB"
                             + (f", OOM x{d['oom_kills']}" if d["oom_kills"] else "")
                             for n, d in record["devices"].items())
            + (f"; exact: {record.get('exact')}" if up["ok"] else ""))
        if compare and up["ok"]:
            record["planned_vs_even"] = compare_rings(lab, model, key_file, layout, twins,
                                                      compare)
    return record


def caps_of(caps: dict[str, tuple[int, float | None]], n: str) -> dict[str, Any]:
    return {"cap_mib": caps[n][0], "cpu_share": caps[n][1]}


def even_ranges_str(n_layer: int, stages: int) -> str:
    from edgespec.llm.shards import even_ranges

    return ",".join(f"{a}:{b}" for a, b in even_ranges(n_layer, stages))


def compare_rings(lab: homelab.HomeLab, model: Path, key_file: Path, layout: dict[str, Any],
                  twins: dict[str, str], cfg: dict[str, Any]) -> dict[str, Any]:
    from edgespec.llm.gguf_read import read_info

    order = sorted(layout, key=lambda n: layout[n]["order"])
    for n in order:
        lab.device(twins[n]).start_node(key_file, lab.workdir)
    addrs = ",".join(f"{lab.device(twins[n]).host.address}:{homelab.PORT}" for n in order)
    ranges = even_ranges_str(read_info(model).n_layer, len(order))
    even_home = lab.workdir / "home-head-even"
    up = ring_up(lab, model, key_file, nodes=addrs, ranges=ranges, head_home=even_home)
    log(f"  even ring ({ranges}) on {', '.join(twins[n] for n in order)}: "
        + ("ok" if up["ok"] else "FAILED") + f" in {up['seconds']} s")
    out: dict[str, Any] = {"even_ring_up": up, "even_ranges": ranges,
                           "twins": {twins[n]: n for n in order}}
    if not up["ok"]:
        return out
    even_layout = ring_state(even_home)
    out["planned_layers"] = {n: layout[n]["windows"] for n in order}
    out["even_layers"] = {twins[n]: even_layout[twins[n]]["windows"] for n in order}
    job = {"rings": {"planned": str(lab.head_home / "ring.json"),
                     "even": str(even_home / "ring.json")},
           "prompts": CHAT_PROMPTS[:cfg["prompts"]], "modes": cfg["modes"],
           "tokens": cfg["tokens"], "reps": cfg["reps"]}
    devices = [*order, *(twins[n] for n in order)]
    before = {n: cpu_throttling(lab.device(n).cgroup) for n in devices}
    t0 = time.monotonic()
    res = subprocess.run(lab.head.command([sys.executable, "-c", COMPARE, json.dumps(job)]),
                         env=homelab.env_for(lab.head_home), cwd=homelab.REPO,
                         stdout=subprocess.PIPE, text=True, timeout=3600)
    out["seconds"] = round(time.monotonic() - t0, 1)
    # What the quota held back while both rings ran (warm-up included).
    after = {n: cpu_throttling(lab.device(n).cgroup) for n in devices}
    out["cpu_throttling"] = {n: {k: round(after[n][k] - before[n].get(k, 0), 3)
                                 for k in after[n]} for n in devices if after[n]}
    if res.returncode != 0:
        out["error"] = f"the comparing head exited {res.returncode}"
        return out
    runs = json.loads(res.stdout.strip().splitlines()[-1])
    out["runs"] = runs
    out["summary"] = summarize(runs, cfg["modes"])
    out["twin_devices"] = {twins[n]: device_record(lab.device(twins[n])) for n in order}
    return out


def summarize(runs: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    def rate(rs: list[dict[str, Any]], prefill: bool = False) -> float:
        return sum(r["n_tokens"] for r in rs) / sum(
            r["decode_s"] + (r["prefill_s"] if prefill else 0.0) for r in rs)

    rows = []
    for m in modes:
        p = [r for r in runs if r["mode"] == m and r["ring"] == "planned"]
        e = [r for r in runs if r["mode"] == m and r["ring"] == "even"]
        if not p or not e:
            continue
        key = lambda r: (r["rep"], r["prompt"])  # noqa: E731
        pairs = list(zip(sorted(p, key=key), sorted(e, key=key), strict=True))
        rows.append({
            "mode": m, "generations": len(p), "tokens_each": p[0]["n_tokens"],
            "planned_tok_s": round(rate(p), 2), "even_tok_s": round(rate(e), 2),
            "ratio_planned_even": round(rate(p) / rate(e), 3),
            "ratio_per_prompt": [round(rate([a]) / rate([b]), 3) for a, b in pairs],
            "planned_tok_s_with_prefill": round(rate(p, True), 2),
            "even_tok_s_with_prefill": round(rate(e, True), 2),
            "ratio_with_prefill": round(rate(p, True) / rate(e, True), 3),
            "planned_tokens_per_step": round(sum(r["n_tokens"] for r in p)
                                             / max(1, sum(r["stats"]["steps"] for r in p)), 2),
            "even_tokens_per_step": round(sum(r["n_tokens"] for r in e)
                                          / max(1, sum(r["stats"]["steps"] for r in e)), 2),
            # Steps that drafted a tree (flow may fall back to plain laps where trees lose).
            "planned_tree_steps": sum(r["stats"]["steps"] - r["stats"]["plain_steps"]
                                      for r in p),
            "even_tree_steps": sum(r["stats"]["steps"] - r["stats"]["plain_steps"] for r in e),
            "same_tokens": f"{sum(a['tokens'] == b['tokens'] for a, b in pairs)}/{len(pairs)}"})
    return rows


# ------------------------------------------------------------------------------ report

def markdown(result: dict[str, Any]) -> str:
    lines = ["# Home lab: a ring of capped devices planned by the planner", "",
             f"Command: `{result['command']}`  ", f"Model: `{result['model']}`  ",
             f"Started {result['started']}, {result['runtime_s']:.0f} s in all  ",
             "Machine: " + ", ".join(f"{k} {v}" for k, v in result["machine"].items()), "",
             "## Unsplit model", "",
             "| run | cap MiB | n_ctx | prompt batch | killed | OOM kills | peak MiB | wall s | tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, u in (("reference (no cap)", result["unsplit_reference"]),
                     ("reference, ring's prompt batch (no cap)",
                      result["unsplit_reference_ring_shape"]),
                     ("under one device's cap, read into memory", result["unsplit_capped"]),
                     ("under one device's cap, mapped", result["unsplit_capped_mapped"])):
        toks = ("reference" if u is result["unsplit_reference"] else
                ("= reference" if u.get("tokens") == result["unsplit_reference"].get("tokens")
                 else ("differ" if "tokens" in u else
                       (f"none in {u['timeout_s']} s" if u.get("timed_out") else "-"))))
        lines.append(f"| {label} | {u['cap_mib'] or '-'} | {u['n_ctx']} | "
                     f"{PROMPT_SHAPES[u['prompt_shape']]} | "
                     f"{'yes' if u['killed'] else 'no'} | {u['oom_kills']} | {u['peak_mib']} | "
                     f"{u['wall_s']} | {toks} |")
    lines += ["", "## Scenarios (ring up --nodes auto, planned)", "",
              "| scenario | device | cap MiB | CPU | ring order | layers | window | cgroup peak MiB "
              "| times at cap | node peak RSS MiB | OOM killed | node alive | ring formed | "
              "16 tokens = unsplit | = unsplit, ring's prompt batch |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in result["scenarios"]:
        for n, d in s["devices"].items():
            lines.append(
                f"| {s['scenario']} | {n} | {d['cap_mib']} | "
                f"{cpu_text(d['cpu_share'])} | "
                f"{d.get('order', '-')} | {d['layers']} | {','.join(d.get('windows', [])) or '-'} "
                f"| {d['peak_mib']} | {d['limit_hits']} | {d['node_peak_rss_mib']} | "
                f"{'yes' if d['oom_kills'] else 'no'} | "
                f"{'yes' if d['node_alive'] else 'no'} | {'yes' if s['ring_up']['ok'] else 'no'}"
                f" | {exact_text(s)} | {s.get('exact_ring_shape', '-')} |")
    notes = [(s["scenario"], n) for s in result["scenarios"]
             for n in s["ring_up"].get("plan_notes", []) if "at 256 sequences and" not in n]
    if notes:
        lines += ["", "What gave way for a ring to fit (`ring up`'s log):", ""]
        lines += [f"- {name}: {n}" for name, n in notes]
    lines += ["", "Sequences per context where nothing gave way: 256."]
    failed = [s for s in result["scenarios"] if not s["ring_up"]["ok"]]
    if failed:
        lines += ["", "Rings that did not form:", ""]
        lines += [f"- {s['scenario']}: `{s['ring_up']['error'].splitlines()[-1]}`"
                  for s in failed]
    for s in result["scenarios"]:
        pve = s.get("planned_vs_even")
        if not pve:
            continue
        lines += ["", f"## Planned against even (scenario {s['scenario']})", "",
                  f"Planned: {pve.get('planned_layers')}; even (twin devices, same caps and "
                  f"quota, same ring order): {pve.get('even_layers')}. "
                  f"Chat prompts: {result['config']['prompts']}, {result['config']['tokens']} "
                  f"tokens each (ignore_eos), reps {result['config']['reps']}, the ring order "
                  "flipping per prompt. Tokens/s: decode only; with prefill beside.", ""]
        thr = {n: t for n, t in pve.get("cpu_throttling", {}).items() if t.get("periods")}
        if thr:
            lines += ["CPU quota during the comparison (warm-up included): " + "; ".join(
                f"{n}: throttled in {t['throttled_periods']} of {t['periods']} periods, "
                f"{t['throttled_s']} s held back" for n, t in thr.items()), ""]
        if "summary" not in pve:
            lines.append(f"Not measured: {pve.get('error') or pve['even_ring_up'].get('error')}")
            continue
        lines += ["| mode | planned tok/s | even tok/s | planned/even | per prompt (rep by rep) | "
                  "planned tok/s incl. prefill | even tok/s incl. prefill | ratio incl. "
                  "prefill | tokens/step planned, even | tree steps planned, even | same tokens |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in pve["summary"]:
            lines.append(f"| {r['mode']} | {r['planned_tok_s']} | {r['even_tok_s']} | "
                         f"{r['ratio_planned_even']} | {r['ratio_per_prompt']} | "
                         f"{r['planned_tok_s_with_prefill']} | {r['even_tok_s_with_prefill']} "
                         f"| {r['ratio_with_prefill']} | {r['planned_tokens_per_step']}, "
                         f"{r['even_tokens_per_step']} | {r['planned_tree_steps']}, "
                         f"{r['even_tree_steps']} | {r['same_tokens']} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ main

PROMPT_SHAPES = {"split": "all but the last token, then the last",
                 "whole": "the whole prompt, last row wanted"}


def exact_text(s: dict[str, Any]) -> str:
    if "exact" not in s:
        return "-"
    if s["exact"]:
        return "yes"
    if "first_difference" not in s:
        return "no"
    return (f"no: from token {s['first_difference']}, a near-tie (gap "
            f"{s['gap_at_difference']})" if s["near_tie"] else
            f"NO: from token {s['first_difference']}, gap {s['gap_at_difference']}")


def cpu_text(share: float | None) -> str:
    return f"{share:.0%} of a core" if share else "unlimited"


def cgroup_version() -> str:
    """Which hierarchy the lab's cgroups are made in (as ``lab.Cgroup`` decides)."""
    ctrl = Path("/sys/fs/cgroup/cgroup.controllers")
    return "v2" if ctrl.exists() and {"memory", "cpu"} <= set(ctrl.read_text().split()) else "v1"


def parse_caps(s: str, cpu: dict[int, float] | None = None
               ) -> dict[str, tuple[int, float | None]]:
    mibs = [int(x) for x in s.split(",")]
    return {f"n{i + 1}": (m, (cpu or {}).get(i)) for i, m in enumerate(mibs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--quick", action="store_true",
                    help="the 0.5B with caps scaled to it, 1 prompt of 16 tokens")
    ap.add_argument("--smoke", action="store_true",
                    help="a minute: a tiny model (unless --model), scenario c with 400 MiB "
                         "caps, 1 prompt of 8 tokens, 1 rep; writes into the temporary folder "
                         "(unless --out)")
    ap.add_argument("--scenarios", default="a,b,b_mid,c")
    ap.add_argument("--caps-a", default="650,650,650")
    ap.add_argument("--caps-b", default="1100,1100,420")
    ap.add_argument("--caps-b-mid", default="1100,420,1100")
    ap.add_argument("--caps-c", default="1400,1400,1400",
                    help="room for the even split's last window too (its head and logits)")
    ap.add_argument("--slow-share", type=float, default=0.25, help="n1's CPU share in c")
    ap.add_argument("--unsplit-cap", type=int, default=650)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--reps", type=int, default=4, help="turns of every prompt")
    ap.add_argument("--modes", default="none,flow")
    ap.add_argument("--out", default="bench/results/home_lab.json")
    ap.add_argument("--keep", action="store_true", help="keep the lab's work folder")
    args = ap.parse_args(argv)
    if args.smoke:
        from bench import smoke

        smoke.apply(ap, args, model=smoke.tiny_model, scenarios="c", caps_c="400,400,400",
                    unsplit_cap=400, prompts=1,
                    tokens=8, reps=1, out=str(smoke.scratch_path("home_lab.json")))
    if args.quick:
        args.model = "qwen2.5-coder-0.5b"
        args.caps_a, args.caps_b, args.caps_b_mid = "300,300,300", "700,700,250", "700,250,700"
        args.caps_c, args.unsplit_cap = "900,900,900", 300
        args.prompts, args.tokens, args.reps = 1, 16, 1

    reason = homelab.skip_reason()
    if reason:
        raise SystemExit(f"home_lab: {reason}")
    from edgespec.llm import models
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer
    from edgespec.wire import auth

    started = time.monotonic()
    command = "python -m bench.home_lab " + " ".join(map(shlex.quote, argv or sys.argv[1:]))
    model = Path(models.resolve(args.model)).resolve()
    tm = load_model(model, vocab_only=True)
    try:
        prompt_ids = Tokenizer(tm).encode(CODE_PROMPT)
    finally:
        tm.close()
    result: dict[str, Any] = {
        "benchmark": "home_lab", "command": command, "model": model.name,
        "machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cgroup": cgroup_version(),
        "config": {"prompts": args.prompts, "tokens": args.tokens, "reps": args.reps,
                   "modes": args.modes.split(","), "code_prompt": CODE_PROMPT,
                   "prompt_ids": prompt_ids, "exact_tokens": EXACT_TOKENS}}

    log(f"unsplit {model.name}, no cap (the reference)...")
    result["unsplit_reference"] = ref_run = unsplit(model, prompt_ids, 1024, None)
    if "tokens" not in ref_run:
        raise SystemExit(f"the unsplit reference failed: {ref_run.get('stderr_tail')}")
    ref = ref_run["tokens"]
    result["unsplit_reference_ring_shape"] = whole = unsplit(model, prompt_ids, 1024, None,
                                                             shape="whole")
    refs = {"split": ref, "whole": whole.get("tokens") or []}
    log(f"  peak {ref_run['peak_mib']} MiB; under a {args.unsplit_cap} MiB cap...")
    result["unsplit_capped"] = capped = unsplit(model, prompt_ids, 4096, args.unsplit_cap,
                                                mapped=False)
    log(f"  read into memory: killed: {capped['killed']} (rc {capped['returncode']}, OOM kills "
        f"{capped['oom_kills']}), peak {capped['peak_mib']} MiB; mapped...")
    result["unsplit_capped_mapped"] = paged = unsplit(model, prompt_ids, 4096, args.unsplit_cap,
                                                      timeout=UNSPLIT_MAPPED_TIMEOUT_S)
    log(f"  mapped: {'timed out' if paged['timed_out'] else 'rc ' + str(paged['returncode'])} "
        f"after {paged['wall_s']} s, peak {paged['peak_mib']} MiB")

    specs = {"a": parse_caps(args.caps_a), "b": parse_caps(args.caps_b),
             "b_mid": parse_caps(args.caps_b_mid),
             "c": parse_caps(args.caps_c, {0: args.slow_share})}
    workdir = Path(tempfile.mkdtemp(prefix="edgespec-home-lab-"))
    key_file = auth.write_key(workdir / "ring.key")
    result["scenarios"] = []
    try:
        for name in args.scenarios.split(","):
            compare = ({"prompts": args.prompts, "tokens": args.tokens, "reps": args.reps,
                        "modes": args.modes.split(",")} if name == "c" else None)
            try:
                rec = scenario(name, specs[name], model, key_file, workdir, prompt_ids, refs,
                               compare)
            except Exception as e:  # one scenario's failure is a result, not the end
                rec = {"scenario": name, "error": f"{type(e).__name__}: {e}"[-1500:],
                       "ring_up": {"ok": False, "error": f"{type(e).__name__}: {e}"[-400:]},
                       "devices": {}}
                log(f"  scenario {name} failed: {rec['error'][-300:]}")
            result["scenarios"].append(rec)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    result["runtime_s"] = round(time.monotonic() - started, 1)
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    out.with_suffix(".md").write_text(md)
    print(json.dumps(result, indent=2))
    print(md, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
