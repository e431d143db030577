"""Summarise a py-spy raw (collapsed) profile: share of samples per thread, per leaf frame,
and inclusive shares of the frames that make up a lap (see ``bench.lap_profile``)."""

from __future__ import annotations

import collections
import sys

KEYS = ["llama_decode", "ggml_graph_compute", "ggml_compute_forward_mul_mat", "_run_slot",
        "run (edgespec/chain.py", "rt_forward", "forward (edgespec/stage.py", "_fill",
        "_validate", "recv", "send", "sendmsg", "seal", "open", "message_batch",
        "result_message", "pick_targets", "get (queue.py", "wait (threading.py", "_on_batch",
        "heartbeat", "argmax"]


def main(path: str) -> None:
    tot = 0
    threads: collections.Counter = collections.Counter()
    leaf: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, n_s = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(n_s)
            tot += n
            frames = stack.split(";")
            threads[frames[0][:60]] += n
            leaf[frames[-1][:110]] += n
            for k in KEYS:
                if any(k in fr for fr in frames):
                    incl[k] += n
    print("total samples", tot)
    for title, counter, top in (("threads", threads, 8), ("leaf", leaf, 25),
                                ("inclusive", incl, 40)):
        print("--", title)
        for k, v in counter.most_common(top):
            print(f"{v / tot * 100:5.1f}% {k}")


if __name__ == "__main__":
    main(sys.argv[1])
