"""CPU use per process over a window: which part of a ring on one host spends the CPU.

The concurrency benchmark records the whole host's CPU per cell; this tool splits it by
process (every node process of a ``Ring.local`` ring, the head's process). Run it beside a
benchmark, then read any window of the record:

    python -m bench.proc_cpu record /tmp/cpu.jsonl &          # a line every 2 s, Ctrl-C ends
    python -m bench.proc_cpu window /tmp/cpu.jsonl 180 230     # seconds since the first line

A line holds, per process whose command line matches ``--match`` (default ``python``), its
user+system CPU seconds from ``/proc/<pid>/stat`` (dead threads included). ``window`` prints
JSON: every process busy in the window with its CPU as % of one core, largest first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def snapshot(match: str) -> dict:
    procs = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if match not in cmd:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        procs[pid] = {"cmd": cmd.strip()[:160], "cpu_s": (int(fields[11]) + int(fields[12])) / TICK}
    return {"t": time.time(), "procs": procs}


def window(lines: list[dict], t0: float, t1: float, min_pct: float = 0.5) -> dict:
    base = lines[0]["t"]
    a = min(lines, key=lambda s: abs(s["t"] - base - t0))
    b = min(lines, key=lambda s: abs(s["t"] - base - t1))
    seconds = b["t"] - a["t"]
    if seconds <= 0:
        raise SystemExit("the window holds no time: give t0 < t1 within the record")
    rows = []
    for pid, p in b["procs"].items():
        before = a["procs"].get(pid)
        if before is None:
            continue
        pct = 100 * (p["cpu_s"] - before["cpu_s"]) / seconds
        if pct >= min_pct:
            rows.append({"pid": int(pid), "cpu_pct": round(pct, 1), "cmd": p["cmd"]})
    rows.sort(key=lambda r: -r["cpu_pct"])
    return {"window_s": round(seconds, 1), "total_pct": round(sum(r["cpu_pct"] for r in rows), 1),
            "processes": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.proc_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="append a snapshot every --every seconds")
    rec.add_argument("file")
    rec.add_argument("--every", type=float, default=2.0)
    rec.add_argument("--match", default="python")
    win = sub.add_parser("window", help="CPU per process between two times of a record")
    win.add_argument("file")
    win.add_argument("t0", type=float)
    win.add_argument("t1", type=float)
    args = ap.parse_args(argv)
    if args.cmd == "record":
        with open(args.file, "a") as out:
            try:
                while True:
                    out.write(json.dumps(snapshot(args.match)) + "\n")
                    out.flush()
                    time.sleep(args.every)
            except KeyboardInterrupt:
                return 0
    lines = [json.loads(line) for line in Path(args.file).read_text().splitlines() if line]
    if len(lines) < 2:
        print(f"{args.file}: fewer than two snapshots", file=sys.stderr)
        return 1
    print(json.dumps(window(lines, args.t0, args.t1), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
