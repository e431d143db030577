"""Device profiling: decode time per layer at a few batch sizes, measured on the model itself.

A node cuts a small first window (a few layers) of the model it is asked about, loads it, and
times decode calls at batch sizes 1, 4 and 16 (the sizes a tree lap uses). Time per layer is
what the planner needs; a short window keeps profiling to seconds even on slow devices.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def profile_layers(model: str | Path, *, cache_dir: str | Path, n_threads: int | None = None,
                   n_gpu_layers: int = 0, batch_sizes: Sequence[int] = (1, 4, 16),
                   layers: int = 2, reps: int = 3) -> dict:
    """Measure ms per layer for each batch size; also report free memory."""
    from edgespec.llm.gguf_read import fingerprint, read_info
    from edgespec.llm.shards import cut_window, shard_file_name
    from edgespec.node.info import free_ram_bytes, free_vram_bytes
    from edgespec.node.runtime import StageRuntime

    model = Path(model)
    info = read_info(model)
    k = max(1, min(layers, info.n_layer - 1))
    fp = fingerprint(model)
    path = cut_window(model, (0, k), Path(cache_dir) / shard_file_name(0, k, fp, model.stem))
    out: dict[str, float] = {}
    rt = StageRuntime(path, n_ctx=max(64, 2 * max(batch_sizes)), n_seq_max=1,
                      n_threads=n_threads, n_gpu_layers=n_gpu_layers)
    try:
        for b in batch_sizes:
            tokens = np.arange(b, dtype=np.int32) % max(2, info.n_vocab)
            pos = np.arange(b, dtype=np.int32)
            seqs = [[0]] * b
            times = []
            for r in range(reps + 1):
                t = time.perf_counter()
                rt.forward(tokens, pos, seqs)
                dt = time.perf_counter() - t
                rt.kv_seq_rm(0, -1, -1)
                if r:  # the first call warms caches and allocations
                    times.append(dt)
            out[str(b)] = 1e3 * float(np.median(times)) / k
    finally:
        rt.close()
    return {"ms_per_layer": out, "layers_profiled": k, "free_ram": free_ram_bytes(),
            "free_vram": free_vram_bytes(), "n_layer": info.n_layer}
