"""Concurrency benchmark: 1, 2, 4 and 8 concurrent clients against one ring, slots
(``parallel=S``) against today's one-request-at-a-time ring (``parallel=1``, the FIFO
baseline), in the same run.

    .venv/bin/python -m bench.concurrency_bench --quick     # minutes: 0.5B, no draft, 2 stages
    .venv/bin/python -m bench.concurrency_bench             # 1.5B target, 0.5B draft, 4 stages,
                                                            # 10 ms/hop, 128 tokens, none+sync+flow

What runs: two rings of ``Ring.local`` node processes are up at once, ``parallel=1`` and
``parallel=--parallel``, every ring link through its own ``bench.linkemu`` proxy with
``--hop-ms`` one-way delay (``bench.ring_bench.Links``). For every mode (``none`` and the tree
modes ``sync`` and ``flow`` with the draft model) and client count, C client threads each send
``--requests`` generations back to back (HumanEval prompts, greedy, ``--tokens`` new tokens),
first to one ring then to the other (the order alternates cell by cell, so the host's other
load hits both alike). One client runs in pairs instead: each request goes to both rings, one
right after the other, the first ring alternating request by request, so a drift in the host's
speed over the cell (it is shared, and its speed wanders by 5-10% over minutes) hits both rings
alike (``--pairs`` requests; ``x_fifo`` is then the ratio of tokens over summed request times,
and the cell also lists the ratio of every pair, ``pair_x_fifo``). ``--control`` adds a
second FIFO ring, ``fifo_b``, to the one-client pairs (an A/A comparison: two rings built
alike, whose ratio shows how far the host's noise and the tree modes' timing-dependent
choices move a one-client ratio by themselves); the requests of a pair then visit the three
rings in each of their six orders in turn. A one-client cell of equally long answers also
gives ``x_fifo_ci90``, a 90% bootstrap interval of its ratio over the pairs (in the table
in brackets). Clients are admitted as
``edgespec serve`` admits them (the ring's scheduler: up to S at once, the rest wait in
arrival order);
``--via http`` sends them through a real ``edgespec serve`` app (uvicorn, in this process) over
HTTP streaming instead of the Python API. Every prompt starts with its own comment line
(``# request <mode>-<clients>-<client>-<n>``), so no request reuses another's KV cache (each pays
its whole prefill), and both rings of a cell get the same prompts. Every answer is ``--tokens``
long (``ignore_eos``, an option of vLLM's serving benchmark too): with C clients on C slots, a
cell lasts as long as its busiest client, so answers that stop at their own end would measure
how unevenly long they happen to be (in one run one client's two answers were 28 and 61 tokens,
another's 111 and 128) rather than the ring. ``--stop-at-eos`` lets them end on their own.

Per cell: aggregate tokens/s (all tokens / first submit to last token), per-request tokens/s
(tokens / first to last token, as the client sees them), time to first token from submit
(queueing included) median and p95, and the ring's own ``ttft_ms`` (request start to first
token) where the statistics carry it. ``x_fifo``: slots aggregate over FIFO aggregate. And
the host's CPU use over the cell (``host_cpu_pct``, % of one core: 200 is a 2-core host
saturated) and busy CPU ms per generated token (``host_cpu_ms_per_token``): with the whole
ring on one host, a cell near saturation can gain from more requests at once only by
spending less CPU per token, which is what bounds slots against FIFO there. Many-client
cells also give the link emulator's part of it (``emulator_cpu_pct``, % of one core: the
ring's proxy thread in this process, apparatus a real ring would not run).

Projection (labelled, modelled): ``--stages`` separate devices, one stage each, with the stage
costs measured alone (``bench.projection.measure_stage_curves``), the lap overhead and the
tokens/rows per lap measured here; A = min(C, S) sequences in flight either as separate
batches pipelined through the stages or merged into one batch per stage.

Output: ``<out>/<prefix>.json`` (machine, settings, command, cells, every request, projection)
and ``<prefix>.md`` (the table).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before llama_cpp loads (ring_bench)

import numpy as np  # noqa: E402

from bench import projection as projection_mod  # noqa: E402
from bench.ring_bench import Links, humaneval_prompts, machine_info  # noqa: E402
from edgespec.head.engine.cost import CostModel  # noqa: E402

# ----------------------------------------------------------------------------- clients


class _Api:
    """Requests through the Python API, admitted by the ring's scheduler as the server's are."""

    def __init__(self, ring: Any, parallel: int, ignore_eos: bool) -> None:
        self.ring = ring
        self.ignore_eos = ignore_eos

    def run(self, prompt: str, n_tokens: int, mode: str) -> dict[str, Any]:
        tokens = self.ring.tokenizer.encode(prompt, add_special=True, parse_special=False)
        t0 = time.perf_counter()
        stream = self.ring.stream_tokens(tokens, max_tokens=n_tokens, temperature=0.0,
                                         spec=mode, ignore_eos=self.ignore_eos)
        first = None
        for _piece in stream:
            first = first or time.perf_counter()
        end = time.perf_counter()
        st = stream.result.stats
        t_in = t0 + st.queue_ms / 1e3  # the wait for a slot
        return {"t_submit": t0, "t_admitted": t_in, "t_first": first or end, "t_end": end,
                "tokens": st.tokens, "prompt_tokens": len(tokens), "stats": st.as_dict(),
                "ttft_ms": getattr(st, "ttft_ms", None)}

    def close(self) -> None:
        pass


class _Http:
    """Requests to a real ``edgespec serve`` app (uvicorn in this process), streamed."""

    def __init__(self, ring: Any, parallel: int, ignore_eos: bool) -> None:
        import uvicorn

        from edgespec.server.app import create_app

        del parallel  # the app takes it from the ring
        self.ignore_eos = ignore_eos
        self.app = create_app(ring, "bench", max_queue=4096)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def run(self, prompt: str, n_tokens: int, mode: str) -> dict[str, Any]:
        import http.client

        body = {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "spec": mode,
                "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": self.ignore_eos}
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first, usage = None, {}
        for line in resp:
            if not line.startswith(b"data: {"):
                continue
            d = json.loads(line[6:])
            if "error" in d:
                raise RuntimeError(d["error"]["message"])
            if d.get("usage"):
                usage = d["usage"]
            elif d["choices"] and d["choices"][0]["text"] and first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        conn.close()
        return {"t_submit": t0, "t_admitted": None, "t_first": first or end, "t_end": end,
                "tokens": usage.get("completion_tokens", 0),
                "prompt_tokens": usage.get("prompt_tokens", 0), "stats": None,
                "ttft_ms": usage.get("time_to_first_token_ms")}

    def close(self) -> None:
        self.app.state.shutdown()
        self.server.should_exit = True
        self.thread.join(30)


def host_cpu() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole host so far, summed over its CPUs, from
    /proc/stat (None where there is none): a cell's share of busy time says how close the
    host's cores were to saturation. On one host every stage, the head's drafting and the
    link emulators share the same cores, so once they are busy, more requests at once can
    only trade one request's compute for another's."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # guest time is counted inside user time already
    return (total - idle) / tick, total / tick


def draft_calls(ring: Any) -> tuple[int, int]:
    """The decodes its drafters asked of the draft model so far, and the ``llama_decode``
    calls that served several slots' at once (one context shared by the slots,
    ``edgespec.drafters.draft_context``)."""
    calls = 0
    contexts = {}
    for d in getattr(ring, "_drafters", []):
        d = getattr(d, "model", d)  # a hybrid's draft model
        calls += getattr(d, "n_decode_calls", 0)
        seqs = getattr(d, "_seqs", None)
        if seqs is not None:
            contexts[id(seqs.ctx)] = seqs.ctx
    return calls, sum(c.n_combined for c in contexts.values())


def stage_decodes(ring: Any) -> list[tuple[int, int]]:
    """Per stage, in stage order: batches its node ran so far, and the decodes that ran
    several requests' batches as one (``edgespec.node.merge``), from the nodes' health."""
    got: dict[int, tuple[int, int]] = {}
    for member in getattr(getattr(ring, "chain", None), "members", []):
        for stage, h in member.ask("health", timeout=30).stages.items():
            got[int(stage)] = (h.batches, h.merged)
    return [got[k] for k in sorted(got)]


def run_cell(client: Any, prompts: list[str], clients: int, requests: int, n_tokens: int,
             mode: str) -> list[dict[str, Any]]:
    """``clients`` threads, each sending ``requests`` generations back to back. Request j of
    client k opens with ``# request <mode>-<clients>-k-j``: the same text on both rings of a
    cell (answers and their lengths follow the prompt), no other request's prefix on one."""
    out: list[dict[str, Any]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def one_client(k: int) -> None:
        try:
            for j in range(requests):
                i = (k * requests + j) % len(prompts)
                rec = client.run(f"# request {mode}-{clients}-{k}-{j}\n{prompts[i]}",
                                 n_tokens, mode)
                rec.update(client_id=k, prompt=i)
                with lock:
                    out.append(rec)
        except BaseException as e:  # reported after the cell
            errors.append(e)

    threads = [threading.Thread(target=one_client, args=(k,)) for k in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return out


def run_pairs(clients: dict[str, Any], order: list[str], prompts: list[str], requests: int,
              n_tokens: int, mode: str
              ) -> dict[str, tuple[list[dict[str, Any]], float | None]]:
    """One client, in pairs: request j goes to every ring of ``order`` in turn, in the j-th
    of the rings' orderings (``pair_orders``; module docstring). Returns per ring its records
    and the host's busy CPU seconds over its requests (None where /proc/stat is not
    there)."""
    got: dict[str, tuple[list[dict[str, Any]], float | None]] = {
        name: ([], 0.0 if host_cpu() else None) for name in order}
    orders = pair_orders(order)
    for j in range(requests):
        for name in orders[j % len(orders)]:
            cpu0 = host_cpu()
            rec = clients[name].run(f"# request {mode}-1-0-{j}\n{prompts[j % len(prompts)]}",
                                    n_tokens, mode)
            cpu1 = host_cpu()
            rec.update(client_id=0, prompt=j % len(prompts))
            recs, busy = got[name]
            recs.append(rec)
            got[name] = (recs, busy + cpu1[0] - cpu0[0] if busy is not None and cpu0 and cpu1
                         else None)
    return got


def pair_orders(order: list[str]) -> list[list[str]]:
    """The orders in which one pair's requests visit the rings, taken in turn pair by pair:
    every ordering of them, ``order`` first. Two rings alternate which goes first; with
    three, a rotation alone would have each ring always follow the same other one (fifo
    after fifo_b after slots), so what a request leaves behind on the host (a ring's
    trailing work, its caches' contents) would hit one ring every time; all six orders put
    each ring first, second and third behind either other alike."""
    return [list(p) for p in itertools.permutations(order)]


def ratio_interval(base_s: list[float], other_s: list[float], level: float = 0.9,
                   resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval (``level``, percentile method) of the one-client ratio
    sum(base_s) / sum(other_s) (``x_fifo`` of equally long answers: the other ring's tokens/s
    over FIFO's), resampling the pairs: how far the prompts drawn and the host's noise leave
    it uncertain. Pairs stay pairs (both times of pair j go together)."""
    a, b = np.asarray(base_s, float), np.asarray(other_s, float)
    idx = np.random.default_rng(seed).integers(0, len(a), (resamples, len(a)))
    r = a[idx].sum(axis=1) / b[idx].sum(axis=1)
    lo, hi = np.percentile(r, [50 * (1 - level), 50 * (1 + level)])
    return round(float(lo), 3), round(float(hi), 3)


def elapsed_s(recs: list[dict[str, Any]], paired: bool) -> float:
    """Seconds the cell's requests took: first submit to last token, or, ``paired``, the sum
    of their own times."""
    if paired:
        return sum(r["t_end"] - r["t_submit"] for r in recs)
    return max(r["t_end"] for r in recs) - min(r["t_submit"] for r in recs)


def summarize(recs: list[dict[str, Any]], paired: bool = False) -> dict[str, Any]:
    """``paired``: the requests ran one at a time, interleaved with another ring's
    (``run_pairs``), so the aggregate counts only their own times."""
    elapsed = elapsed_s(recs, paired)
    toks = sum(r["tokens"] for r in recs)
    # The first token came at t_first: the rest took t_end - t_first.
    per_req = [(r["tokens"] - 1) / (r["t_end"] - r["t_first"]) for r in recs
               if r["tokens"] > 1 and r["t_end"] > r["t_first"]]
    ttft = [(r["t_first"] - r["t_submit"]) * 1e3 for r in recs]
    ring_ttft = [r["ttft_ms"] for r in recs if r["ttft_ms"] is not None]

    def pct(xs: list[float], q: float) -> float | None:
        return round(float(np.percentile(xs, q)), 2) if xs else None

    laps = [r["stats"]["laps"] for r in recs if r["stats"]]
    rows = [r["stats"]["rows_sent"] for r in recs if r["stats"]]
    draft = [r["stats"]["draft_ms"] for r in recs if r["stats"]]
    return {"requests": len(recs), "tokens": toks,
            "aggregate_tok_s": round(toks / elapsed, 3),
            "per_request_tok_s_median": pct(per_req, 50),
            "ttft_ms_median": pct(ttft, 50), "ttft_ms_p95": pct(ttft, 95),
            "ring_ttft_ms_median": pct(ring_ttft, 50), "ring_ttft_ms_p95": pct(ring_ttft, 95),
            "tokens_per_lap": round(toks / sum(laps), 3) if laps and sum(laps) else None,
            "rows_per_lap": round(sum(rows) / sum(laps), 3) if laps and sum(laps) else None,
            "draft_ms_per_lap": round(sum(draft) / sum(laps), 3) if laps and sum(laps) else None}


# ----------------------------------------------------------------------------- projection


def project(curves: dict[str, Any], cells: list[dict[str, Any]], n_stages: int, hop_ms: float,
            parallel: int) -> dict[str, Any]:
    """PROJECTION for ``n_stages`` separate devices (module docstring), per mode and clients."""
    cost = [s["ms"] for s in curves["stages"]]

    def c(i: int, r: float) -> float:
        return projection_mod._interp({int(k): v for k, v in cost[i].items()}, r)

    def lap(r: float) -> float:
        return sum(c(i, r) for i in range(len(cost))) + (n_stages + 1) * hop_ms

    one = next((x for x in cells if x["ring"] == "fifo" and x["mode"] == "none"
                and x["clients"] == 1), None)
    overhead = 0.0
    if one and one["per_request_tok_s_median"]:
        overhead = max(0.0, 1000.0 / one["per_request_tok_s_median"] - lap(1))
    rows = []
    for x in cells:
        if x["ring"] != "slots" or x["clients"] != 1 or not x["tokens_per_lap"]:
            continue
        tpl, rpl, draft = x["tokens_per_lap"], x["rows_per_lap"] or 1.0, x["draft_ms_per_lap"]
        if x["mode"] == "none":  # one row, one token per decode lap (laps also count prefill)
            tpl, rpl, draft = 1.0, 1.0, 0.0
        lat = lap(rpl) + overhead + (draft or 0.0)
        fifo = 1000.0 * tpl / lat
        for n in sorted({y["clients"] for y in cells}):
            a = min(n, parallel)
            pipelined = min(a * 1000.0 * tpl / lat,
                            1000.0 * tpl / max(c(i, rpl) for i in range(len(cost))))
            merged_lap = lap(a * rpl) + overhead + (draft or 0.0)
            merged = a * 1000.0 * tpl / merged_lap
            rows.append({"mode": x["mode"], "clients": n, "in_flight": a,
                         "fifo_tok_s": round(fifo, 2),
                         "pipelined_tok_s": round(pipelined, 2),
                         "merged_tok_s": round(merged, 2),
                         "x_fifo_pipelined": round(pipelined / fifo, 2),
                         "x_fifo_merged": round(merged / fifo, 2)})
    return {"label": "PROJECTION - modelled, not measured", "devices": n_stages,
            "assumptions": [
                f"{n_stages} devices, one stage each, each stage as fast as measured alone on "
                "one core of this host (bench.projection.measure_stage_curves)",
                f"a lap crosses {n_stages + 1} links of {hop_ms:g} ms",
                f"plus {overhead:.1f} ms per lap of measured overhead (FIFO ring, mode none, "
                "1 client) the stage curves do not explain",
                "none: one row and one token per lap; other modes: tokens, rows and drafting "
                "per lap as measured with 1 client (laps include prefill laps)",
                "pipelined: in-flight sequences travel as separate batches (a stage serves "
                "them one after another); merged: one batch per stage holds all their rows",
                "flow's overlap of laps is not modelled (each of its laps counts as one sync "
                "step), so its rows are a lower bound"],
            "overhead_ms_per_lap": round(overhead, 2), "rows": rows}


# ----------------------------------------------------------------------------- main


def _table(cells: list[dict[str, Any]]) -> str:
    head = ("| mode | clients | ring | aggregate tok/s | x fifo [90% interval] | "
            "per-request tok/s | "
            "TTFT ms median | TTFT ms p95 | ring TTFT ms median | host CPU % | "
            "CPU ms/token |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in cells:
        def f(v: Any) -> str:
            return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)
        ci = x.get("x_fifo_ci90")
        xf = f(x.get("x_fifo")) + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
        lines.append(f"| {x['mode']} | {x['clients']} | {x['ring']} | "
                     f"{f(x['aggregate_tok_s'])} | {xf} | "
                     f"{f(x['per_request_tok_s_median'])} | {f(x['ttft_ms_median'])} | "
                     f"{f(x['ttft_ms_p95'])} | {f(x['ring_ttft_ms_median'])} | "
                     f"{f(x.get('host_cpu_pct'))} | {f(x.get('host_cpu_ms_per_token'))} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.concurrency_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="small run: 0.5B target, no draft (retrieval drafting), 2 stages, "
                         "32 tokens, clients 1,2,4, one request each; flags still override")
    ap.add_argument("--target", default=None)
    ap.add_argument("--draft", default=None, help="draft model ('-': none, retrieval)")
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--hop-ms", type=float, default=10.0)
    ap.add_argument("--modes", default="none,sync,flow",
                    help="none and the tree modes (the best mode is the one whose slots ring "
                         "is fastest at 4 clients)")
    ap.add_argument("--clients", default=None, help="client counts (default 1,2,4,8)")
    ap.add_argument("--parallel", type=int, default=4, help="slots of the compared ring")
    ap.add_argument("--requests", type=int, default=None, help="per client (default 2)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="requests of a one-client cell, each sent to both rings (default 6; "
                         "--quick: --requests)")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--n-ctx", type=int, default=4096, help="of each ring (slots share it)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads per stage")
    ap.add_argument("--via", choices=("api", "http"), default="api")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="answers end at their end-of-generation token (default: every answer "
                         "is --tokens long, ignore_eos)")
    ap.add_argument("--control", action="store_true",
                    help="one-client cells also run on a second FIFO ring (fifo_b, built like "
                         "the first): its ratio over fifo is the A/A noise floor the slots "
                         "ring's one-client ratio is read against")
    ap.add_argument("--tree-budgets", default=None,
                    help="tree budgets the cost model chooses from, e.g. 4,8,16,32,64 (default: "
                         "the engine's, CostModel.BUDGETS), on every ring")
    ap.add_argument("--control-tree-budgets", default=None,
                    help="with --control: fifo_b's tree budgets instead (an A/B of budgets on "
                         "the one-client pairs, alternated request by request)")
    ap.add_argument("--no-projection", action="store_true")
    ap.add_argument("--out", default="bench/results/")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    if args.control_tree_budgets and not args.control:
        ap.error("--control-tree-budgets sets the budgets of the --control ring: give --control")

    q = args.quick
    target = args.target or ("qwen2.5-coder-0.5b" if q else "qwen2.5-coder-1.5b")
    draft = args.draft or (None if q else "qwen2.5-coder-0.5b")
    draft = None if draft == "-" else draft
    stages = args.stages or (2 if q else 4)
    n_tokens = args.tokens or (32 if q else 128)
    requests = args.requests or (1 if q else 2)
    n_pairs = args.pairs or (requests if q else 6)
    counts = [int(c) for c in (args.clients or ("1,2,4" if q else "1,2,4,8")).split(",")]
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("none", "sync", "flow", "auto"):
            ap.error(f"unknown mode {m!r}")
    prompts = [p["prompt"] for p in humaneval_prompts(max(8, max(counts) * requests, n_pairs))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = args.name or ("concurrency_bench_quick" if q else "concurrency_bench")
    command = "python -m bench.concurrency_bench " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    from edgespec import Ring
    from edgespec.llm.models import resolve

    host = machine_info()
    rings: dict[str, Any] = {}
    links: list[Links] = []
    links_of: dict[str, Links] = {}
    clients: dict[str, Any] = {}
    cells: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    try:
        built = [("fifo", 1), ("slots", args.parallel)] + ([("fifo_b", 1)] if args.control
                                                             else [])
        for name, par in built:
            lk = Links(args.hop_ms)
            links.append(lk)
            links_of[name] = lk
            t = time.perf_counter()
            extra: dict[str, Any] = {"parallel": par} if par != 1 else {}  # 1: today's ring
            budgets = args.control_tree_budgets if name == "fifo_b" and \
                args.control_tree_budgets else args.tree_budgets
            if budgets:
                extra["cost"] = CostModel(budgets=[int(b) for b in budgets.split(",")])
            rings[name] = Ring.local(target, stages=stages, draft=draft, proxy=lk.proxy,
                                     threads=args.threads, n_ctx=args.n_ctx, spec="none",
                                     **extra)
            clients[name] = (_Http if args.via == "http" else _Api)(rings[name], par,
                                                                    not args.stop_at_eos)
            log(f"{name} ring up (parallel={par}) in {time.perf_counter() - t:.1f} s")
            for m in modes:  # warm-up: weights paged in, the cost model has a few laps
                clients[name].run(f"# warm-up\n{prompts[0]}", 8, m)
        flip = False
        for m in modes:
            for n in counts:
                order = ["slots", "fifo"] if flip else ["fifo", "slots"]
                flip = not flip
                if n == 1 and args.control:
                    order.append("fifo_b")
                got = {}
                pairs = run_pairs(clients, order, prompts, n_pairs, n_tokens, m) \
                    if n == 1 else {}
                for name in order:
                    if n == 1:
                        recs, busy = pairs[name]
                    else:
                        st0 = stage_decodes(rings[name])
                        cpu0, calls0 = host_cpu(), draft_calls(rings[name])
                        emu0 = links_of[name].emu.cpu_s()
                        recs = run_cell(clients[name], prompts, n, requests, n_tokens, m)
                        emu1 = links_of[name].emu.cpu_s()
                        cpu1, calls1 = host_cpu(), draft_calls(rings[name])
                        st1 = stage_decodes(rings[name])
                        busy = cpu1[0] - cpu0[0] if cpu0 and cpu1 else None
                    cell = {"mode": m, "clients": n, "ring": name,
                            "parallel": 1 if name != "slots" else args.parallel,
                            **summarize(recs, paired=n == 1),
                            "load_avg_1m": round(os.getloadavg()[0], 2)}
                    if n > 1 and calls1[0] > calls0[0]:
                        # The drafters' decodes in the cell, and the llama_decode calls that
                        # served several of them at once.
                        cell["draft_decodes"] = calls1[0] - calls0[0]
                        cell["draft_decodes_merged_calls"] = calls1[1] - calls0[1]
                    if n > 1 and len(st0) == len(st1):
                        # Per stage: batches run in the cell, and the decodes among them
                        # that ran several requests' batches at once.
                        cell["stage_batches"] = [b[0] - a[0] for a, b in zip(st0, st1, strict=True)]
                        cell["stage_merged_decodes"] = [b[1] - a[1] for a, b in zip(st0, st1, strict=True)]
                    seconds = elapsed_s(recs, paired=n == 1)
                    if busy is not None and seconds > 0:
                        # Host CPU busy, in % of one core (200 = both cores of a 2-core
                        # host all the time), and busy CPU ms per token generated.
                        cell["host_cpu_pct"] = round(100 * busy / seconds, 1)
                        cell["host_cpu_ms_per_token"] = round(1e3 * busy / cell["tokens"], 1)
                    if n > 1 and seconds > 0:
                        # Of that, the link emulator's (this process's proxy thread for this
                        # ring): measuring apparatus a real ring would not run.
                        cell["emulator_cpu_pct"] = round(100 * (emu1 - emu0) / seconds, 1)
                    raw += [{"mode": m, "clients": n, "ring": name, **r} for r in recs]
                    got[name] = cell
                    log(f"{m:<5} {n} client(s) {name:<5} {cell['aggregate_tok_s']:7.2f} tok/s "
                        f"aggregate, TTFT median {cell['ttft_ms_median']} ms")
                others = [name for name in order if name != "fifo"]
                if n == 1:
                    rate = {name: [r["tokens"] / (r["t_end"] - r["t_submit"])
                                   for r in pairs[name][0]] for name in order}
                    secs = {name: [r["t_end"] - r["t_submit"] for r in pairs[name][0]]
                            for name in order}
                    for name in others:
                        got[name]["pair_x_fifo"] = [
                            round(b / a, 3) for a, b in zip(rate["fifo"], rate[name],
                                                            strict=True)]
                        if all(r["tokens"] == n_tokens for name_ in order
                               for r in pairs[name_][0]):  # equally long answers
                            got[name]["x_fifo_ci90"] = list(ratio_interval(secs["fifo"],
                                                                           secs[name]))
                for name in others:
                    got[name]["x_fifo"] = round(got[name]["aggregate_tok_s"]
                                                / got["fifo"]["aggregate_tok_s"], 3)
                cells += [got["fifo"], got["slots"]] + ([got["fifo_b"]] if "fifo_b" in got
                                                        else [])
    finally:
        for c in clients.values():
            c.close()
        for r in rings.values():
            r.close()
        for lk in links:
            lk.close()

    proj = None
    if not args.no_projection:
        log("projection: measuring stage cost curves")
        curves = projection_mod.measure_stage_curves(resolve(target), stages,
                                                     threads=args.threads)
        proj = {"curves": curves,
                "projection": project(curves, cells, stages, args.hop_ms, args.parallel)}
    settings = {"target": target, "draft": draft, "stages": stages, "hop_ms": args.hop_ms,
                "modes": modes, "clients": counts, "parallel": args.parallel,
                "requests_per_client": requests, "one_client_pairs": n_pairs,
                "control": args.control,
                "tokens": n_tokens, "n_ctx": args.n_ctx,
                "threads": args.threads, "via": args.via, "ignore_eos": not args.stop_at_eos,
                "tree_budgets": [int(b) for b in args.tree_budgets.split(",")]
                if args.tree_budgets else list(CostModel.BUDGETS),
                "control_tree_budgets": args.control_tree_budgets}
    report = {"machine": host, "settings": settings, "command": command, "cells": cells,
              "projection": proj, "requests": raw}
    (out / f"{prefix}.json").write_text(json.dumps(report, indent=1))
    md = [f"# Concurrency benchmark: {target}, {stages} stages, {args.hop_ms:g} ms/hop", "",
          f"Command: `{command}`", "", f"Host: {host.get('cpu')}, {host.get('logical_cpus')} "
          f"logical CPUs, load average at start {host.get('load_avg')}.", "", _table(cells)]
    if proj:
        p = proj["projection"]
        md += ["", f"### {p['label']}", ""] + [f"- {a}" for a in p["assumptions"]] + [
            "", "| mode | clients | in flight | FIFO tok/s | pipelined tok/s | merged tok/s |",
            "|---|---:|---:|---:|---:|---:|"]
        md += [f"| {r['mode']} | {r['clients']} | {r['in_flight']} | {r['fifo_tok_s']} | "
               f"{r['pipelined_tok_s']} | {r['merged_tok_s']} |" for r in p["rows"]]
    (out / f"{prefix}.md").write_text("\n".join(md) + "\n")
    print(_table(cells))
    log(f"wrote {out / (prefix + '.json')} and {prefix}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
