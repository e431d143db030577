"""What the web page's live view costs the ring: tokens/s with the page open vs closed.

    .venv/bin/python -m bench.web_live_bench --prompts 4 --tokens 128 --reps 3 \
        --out bench/results/

Starts ``edgespec serve --local STAGES`` (its own process, as a user runs it) and sends the
same greedy ``/v1/completions`` requests (the first ``--prompts`` HumanEval problems, spec
``--spec``) in alternating blocks: page closed, then the page open in headless chromium
(Playwright, Debian's ``/usr/bin/chromium``) with its live view connected (ring snapshots,
token-tree events, charts) and drawing, then closed again, ... ``--reps`` times each. A third
condition reads the same live stream from a plain Python client (no browser), which separates
what serving the live view costs from a browser drawing it on the same host. Blocks
alternate so load from other users of a shared host hits both alike. Before the first block
every prompt runs once unrecorded (warm-up, KV and drafter state alike for both).

Per block, tokens/s is the server's own figure (generated tokens / decode seconds, summed over
the block's requests, from ``/v1/ring``'s per-generation records); the row reports the median
block of each condition and their ratio, plus client wall-clock tokens/s. Output: a JSON line
in ``<out>/web_live_bench.jsonl`` and a table in ``<out>/web_live_bench.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.ring_bench import humaneval_prompts

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=600) as r:
        return json.loads(r.read())


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    exe = str(Path(sys.executable).with_name("edgespec"))
    cmd = [exe, "serve", "--local", str(args.stages), "--port", "0", "--model", args.model]
    if args.draft:
        cmd += ["--draft", args.draft]
    env = dict(os.environ, OMP_WAIT_POLICY="passive", PYTHONUNBUFFERED="1")
    log = open(log_path, "w")  # noqa: SIM115 (lives as long as the server)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", log_path.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log_path.read_text()}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start")


class StreamReader:
    """The live stream read by plain Python (no browser): what serving the live view costs
    the server, apart from a browser drawing it on the same host."""

    def __init__(self, base: str) -> None:
        host, port = base.split("//")[1].split(":")
        # No read timeout: a timed-out socket file raises at once on every later read (a
        # busy loop that would steal a core from the ring); close() shuts the socket down.
        self.conn = http.client.HTTPConnection(host, int(port))
        self.conn.request("GET", "/v1/ring/events")
        self.resp = self.conn.getresponse()
        self.events = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                line = self.resp.readline()
            except (OSError, ValueError):
                return
            if not line:
                return
            self.events += line.startswith(b"event: ")

    def close(self) -> int:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(5)
        self.conn.close()
        return self.events


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def run_block(base: str, prompts: list[dict], args: argparse.Namespace, pid: int) -> dict:
    """Every prompt once; the server's decode figures for exactly these requests, and the CPU
    time the server (head) and its node processes spent meanwhile: unlike tokens/s, CPU
    time per token barely moves with other users' load on a shared host."""
    before = len(_get(base + "/v1/ring")["history"])
    nodes = _children(pid)
    cpu0 = (_cpu_s(pid), sum(_cpu_s(n) for n in nodes))
    t0 = time.perf_counter()
    texts = []
    for p in prompts:
        r = _post(base + "/v1/completions", {"prompt": p["prompt"], "max_tokens": args.tokens,
                                             "temperature": 0, "spec": args.spec})
        texts.append(r["choices"][0]["text"])
    wall = time.perf_counter() - t0
    head_cpu = _cpu_s(pid) - cpu0[0]
    nodes_cpu = sum(_cpu_s(n) for n in nodes) - cpu0[1]
    gens = _get(base + "/v1/ring")["history"][before:]
    assert len(gens) == len(prompts), (len(gens), len(prompts))
    tokens = sum(g["tokens"] for g in gens)
    decode_s = sum(g["tokens"] / g["tokens_per_s"] for g in gens if g["tokens_per_s"] > 0)
    return {"tokens": tokens, "decode_s": round(decode_s, 4),
            "tokens_per_s": round(tokens / decode_s, 3), "wall_tokens_per_s":
            round(tokens / wall, 3), "texts": texts,
            "head_cpu_ms_per_token": round(head_cpu * 1e3 / tokens, 3),
            "nodes_cpu_ms_per_token": round(nodes_cpu * 1e3 / tokens, 3),
            "tokens_per_lap": round(tokens / max(1, sum(g["laps"] for g in gens)), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--spec", default="flow", choices=("none", "sync", "flow", "auto"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="blocks per condition")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = humaneval_prompts(args.prompts)
    log_dir = tempfile.TemporaryDirectory(prefix="web-live-bench-")
    proc, base = start_server(args, Path(log_dir.name) / "serve.log")
    blocks: dict[str, list[dict]] = {"closed": [], "stream": [], "open": []}
    stream_events = []
    tree_updates = []
    try:
        run_block(base, prompts, args, proc.pid)  # warm-up, not recorded
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            for rep in range(args.reps):
                conds = ["closed", "stream", "open"]
                # The order rotates per rep, so no condition always follows another.
                for cond in conds[rep % 3:] + conds[:rep % 3]:
                    page = reader = None
                    if cond == "stream":
                        reader = StreamReader(base)
                    if cond == "open":
                        page = browser.new_page(viewport={"width": 1400, "height": 900})
                        page.goto(base + "/")
                        page.wait_for_selector("#ring g[data-stage]", timeout=60_000)
                    b = run_block(base, prompts, args, proc.pid)
                    if page is not None:
                        time.sleep(0.5)  # the last batch of tree events reaches the page
                        tree_updates.append(int(page.evaluate(
                            "document.getElementById('tree').dataset.updates || '0'")))
                        page.close()
                    if reader is not None:
                        stream_events.append(reader.close())
                    blocks[cond].append(b)
                    print(f"rep {rep} {cond:6s}: {b['tokens_per_s']:.2f} tok/s "
                          f"(wall {b['wall_tokens_per_s']:.2f})", flush=True)
            browser.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        log_dir.cleanup()

    def med(cond: str, key: str) -> float:
        return statistics.median(b[key] for b in blocks[cond])

    closed, opened = med("closed", "tokens_per_s"), med("open", "tokens_per_s")
    streamed = med("stream", "tokens_per_s")
    # Each open block against the closed block of the same rep (same minutes of host load).
    paired = [round(o["tokens_per_s"] / c["tokens_per_s"], 4)
              for c, o in zip(blocks["closed"], blocks["open"], strict=True)]
    paired_stream = [round(o["tokens_per_s"] / c["tokens_per_s"], 4)
                     for c, o in zip(blocks["closed"], blocks["stream"], strict=True)]
    same_text = all(b["texts"] == blocks["closed"][0]["texts"]
                    for c in blocks for b in blocks[c])
    row = {
        "model": args.model, "draft": args.draft, "stages": args.stages, "spec": args.spec,
        "prompts": args.prompts, "tokens": args.tokens, "reps": args.reps,
        "closed_tokens_per_s": closed, "open_tokens_per_s": opened,
        "open_over_closed": round(opened / closed, 4),
        "paired_open_over_closed": paired,
        "paired_median": statistics.median(paired),
        "stream_tokens_per_s": streamed,
        "paired_stream_over_closed": paired_stream,
        "paired_stream_median": statistics.median(paired_stream),
        "stream_events_per_block": stream_events,
        "closed_wall_tokens_per_s": med("closed", "wall_tokens_per_s"),
        "open_wall_tokens_per_s": med("open", "wall_tokens_per_s"),
        "blocks": {c: [{k: v for k, v in b.items() if k != "texts"} for b in bs]
                   for c, bs in blocks.items()},
        "tree_view_updates_per_open_block": tree_updates,
        "same_text_every_block": same_text,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                 "python": platform.python_version()},
        "command": "python -m bench.web_live_bench " + " ".join(argv or sys.argv[1:]),
    }
    with open(out / "web_live_bench.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    for c in blocks:
        row[f"{c}_head_cpu_ms_per_token"] = med(c, "head_cpu_ms_per_token")
        row[f"{c}_nodes_cpu_ms_per_token"] = med(c, "nodes_cpu_ms_per_token")

    def line(label: str, c: str) -> str:
        tps = med(c, "tokens_per_s")
        return (f"| {label} | {tps:.2f} | {med(c, 'wall_tokens_per_s'):.2f} | "
                f"{tps / closed:.3f} | {med(c, 'head_cpu_ms_per_token'):.2f} | "
                f"{med(c, 'nodes_cpu_ms_per_token'):.2f} |\n")

    md = (f"| page | tokens/s (server, median of {args.reps} blocks) | wall tokens/s | "
          f"x closed | head CPU ms/token | nodes CPU ms/token |\n"
          f"|---|---:|---:|---:|---:|---:|\n" + line("closed", "closed")
          + line("live stream read by a script (no browser)", "stream")
          + line("open in chromium, live view streaming", "open") + "\n"
          f"{args.model}{' + draft ' + args.draft if args.draft else ''}, {args.stages} stages, "
          f"spec {args.spec}, HumanEval 0-{args.prompts - 1}, greedy, {args.tokens} tokens; "
          f"blocks alternate (order rotating per rep). Per rep, open over closed: "
          f"{paired} (median {statistics.median(paired):.3f}); script-read stream over "
          f"closed: {paired_stream} (median {statistics.median(paired_stream):.3f}). "
          f"Same text in every block: {same_text}. "
          f"Tree-view redraws per open block: {tree_updates}.\n\n`{row['command']}`\n")
    (out / "web_live_bench.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
