"""Device profiling: decode time per layer at a few batch sizes, measured on the model itself,
and the round trips to other members (``round_trips``, for the ring's order).

A node cuts a small window (a few layers) of the model it is asked about, loads it, and times
decode calls at batch sizes 1, 4 and 16 (the sizes a tree lap uses). Time per layer is what the
planner needs; a short window keeps profiling to seconds even on slow devices. The window is a
middle one where the model has one (``profile_window``): it carries a stub vocabulary, where a
first window holds the token embeddings, which cost more than its layers (the 0.5B's layers
0-1 load at 197 MiB resident, layers 1-2 at 57 MiB, the process included). Profiling runs on
the device before the planner has seen it, so it must fit in less memory than any window the
planner could give it: a middle window of two layers does, where a device with room for a
few middle layers was killed profiling the first two. The free memory reported is read once
the window is closed and its file's pages and freed heap are handed back.

The speed measured is the sustained one: each batch size decodes back to back for at least
``SUSTAIN_S`` (0.5 s) of wall time, and the figure is that time divided by the decodes (not the
best or median call). A device held to a share of a core by a CFS quota (a container's
``--cpus``, a systemd ``CPUQuota``, a cgroup's ``cpu.max``) runs at full speed until the quota
of its period (100 ms unless set otherwise) is spent and then waits for the next period, so a
few short calls fit in one burst and look fast. 0.5 s spans five 100 ms periods: the quota
shows, and a pause the span ends on adds at most one period in five. The profile
reads the quota itself (``info.cpu_quota``) and, under one, makes the span at least five of
its periods (a 1 s period: 5 s per batch size), and cross-checks the result with the
process's CPU time over the span: a quota of q cores runs that CPU time in no less than that
time divided by q, so a span that still ran faster (a burst allowance, ``cpu.max.burst``, spent
inside it) is taken at that bound. Thermal throttling takes tens of seconds to minutes to set
in, far longer than a profile should make a user wait at `ring up`: it is not measured here (a
slow-down after forming shows in the lap timing, and `ring rebalance` re-profiles).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

#: Seconds of back-to-back decodes per batch size (see the module docstring).
SUSTAIN_S = 0.5
#: Under a CPU quota, the span covers at least this many of its periods (a longer period
#: than the usual 100 ms stretches it, up to ``SUSTAIN_MAX_S``).
SUSTAIN_PERIODS = 5
SUSTAIN_MAX_S = 5.0


def sustained_s(wall_s: float, cpu_s: float, quota_cores: float | None) -> float:
    """The wall time a span of work takes when sustained: the time measured, or, under a CPU
    quota of ``quota_cores``, at least the span's CPU time divided by the quota (what the
    quota lets that CPU time run in once no burst is left)."""
    if quota_cores is None or quota_cores <= 0:
        return wall_s
    return max(wall_s, cpu_s / quota_cores)


def profile_window(n_layer: int, layers: int) -> tuple[int, int]:
    """The window of up to ``layers`` layers to profile: a middle one (from layer 1, ending
    before the last), or the first where the model is too short to have a middle."""
    if n_layer >= 3:
        return 1, 1 + max(1, min(layers, n_layer - 2))
    return 0, max(1, min(layers, n_layer - 1))


def profile_layers(model: str | Path, *, cache_dir: str | Path, n_threads: int | None = None,
                   n_gpu_layers: int = 0, batch_sizes: Sequence[int] = (1, 4, 16),
                   layers: int = 2, reps: int = 3, sustain_s: float = SUSTAIN_S) -> dict:
    """Measure sustained ms per layer for each batch size (at least ``reps`` decodes and
    ``sustain_s`` seconds each, after one warm-up call, no faster than the cgroup's CPU quota
    allows: ``sustained_s``); also report free memory."""
    from edgespec.llm.gguf_read import fingerprint, read_info
    from edgespec.llm.shards import cut_window, shard_file_name
    from edgespec.node import info as node_info
    from edgespec.node.offload import device_report
    from edgespec.node.runtime import StageRuntime

    model = Path(model)
    info = read_info(model)
    a, b = profile_window(info.n_layer, layers)
    k = b - a
    fp = fingerprint(model)
    path = cut_window(model, (a, b), Path(cache_dir) / shard_file_name(a, b, fp, model.stem))
    out: dict[str, float] = {}
    held = node_info.cpu_quota()
    quota = None if held is None else held[0]
    if held is not None:
        sustain_s = max(sustain_s, min(SUSTAIN_MAX_S, SUSTAIN_PERIODS * held[1]))
    rt = StageRuntime(path, n_ctx=max(64, 2 * max(batch_sizes)), n_seq_max=1,
                      n_threads=n_threads, n_gpu_layers=n_gpu_layers)
    try:
        rng = np.random.default_rng(0)
        for n in batch_sizes:
            # A first window takes token ids, a middle one the hidden states of the rows.
            rows = (np.arange(n, dtype=np.int32) % max(2, info.n_vocab) if rt.is_first
                    else rng.standard_normal((n, rt.n_embd)).astype(np.float32))
            pos = np.arange(n, dtype=np.int32)
            seqs = [[0]] * n
            rt.forward(rows, pos, seqs)  # warms caches and allocations: not timed
            rt.kv_seq_rm(0, -1, -1)
            calls = 0
            c0, t0 = time.process_time(), time.perf_counter()  # CPU time: every thread's
            while calls < reps or time.perf_counter() - t0 < sustain_s:
                rt.forward(rows, pos, seqs)
                rt.kv_seq_rm(0, -1, -1)
                calls += 1
            span = sustained_s(time.perf_counter() - t0, time.process_time() - c0, quota)
            out[str(n)] = 1e3 * span / calls / k
    finally:
        rt.close()
        node_info.release_free_heap()
    return {"ms_per_layer": out, "layers_profiled": k, "free_ram": node_info.free_ram_bytes(),
            "free_vram": device_report().free_vram, "n_layer": info.n_layer}


#: Seconds to reach and ping another member when the head asks for round trips.
PROBE_TIMEOUT_S = 2.0


def round_trips(addresses: Sequence[tuple[str, int]], key: bytes, node_id: str,
                name: str) -> list[float | None]:
    """The round trip (ms) to each address: a key-proving connection, then the best of three
    pings (the handshake's own round trips are not counted); None where it was not reached."""
    import logging

    from edgespec.wire import control_message
    from edgespec.wire.transport import connect

    out: list[float | None] = []
    for host, port in addresses:
        try:
            with connect(host, port, key, node_id=node_id, timeout=PROBE_TIMEOUT_S) as c:
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    c.request(control_message("ping"), timeout=PROBE_TIMEOUT_S)
                    best = min(best, time.perf_counter() - t0)
            out.append(round(best * 1e3, 3))
        except Exception as e:  # unreachable from here: the head leaves that link out
            logging.getLogger("edgespec.node").info("%s: no round trip to %s:%d: %s", name,
                                                    host, port, e)
            out.append(None)
    return out
