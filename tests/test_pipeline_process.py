"""prima.cpp-style windows: 2 processes x 2 windows each (a lap visits each process twice),
on a tiny model, against the unsplit model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pipeline_fixtures import LocalPipeline
from stage_fixtures import tiny_dir, tiny_qwen2, two_by_two  # noqa: F401 - fixtures
from tinygguf import make_tiny_gguf

from edgespec.llm.shards import shard_model
from edgespec.node.runtime import FingerprintMismatchError, InputError, StageRuntime

KW = dict(n_ctx=512, n_batch=64, n_threads=1, n_seq_max=4)


def test_two_processes_two_rounds(tiny_qwen2: Path, tmp_path: Path) -> None:  # noqa: F811
    m = shard_model(tiny_qwen2, tmp_path, n_stages=4, progress=False)
    pipe, procs = two_by_two(m.shard_paths(tmp_path), **KW)
    prompts = [[10, 20, 30, 40], [50, 60, 70], [80, 90, 100, 110, 120]]
    with pipe, LocalPipeline([StageRuntime(tiny_qwen2, **KW)]) as ref:
        assert procs[0].pid != procs[1].pid
        assert [w.layer_range for w in pipe.windows] == [(0, 1), (1, 2), (2, 3), (3, 4)]
        for p in prompts:
            pipe.reset()
            ref.reset()
            assert np.abs(pipe.prefill(p) - ref.prefill(p)).max() <= 1e-3
        pipe.reset()
        ref.reset()
        assert pipe.generate_greedy(prompts, 64) == ref.generate_greedy(prompts, 64)

        # Errors cross the process boundary with their type; the windows stay usable.
        with pytest.raises(InputError, match="hidden width"):
            pipe.windows[1].forward(np.zeros((2, 10), np.float32), 0)
        other = make_tiny_gguf(tmp_path / "other" / "m.gguf", n_layer=4, n_embd=64, seed=11)
        om = shard_model(other, tmp_path / "other", n_stages=4, progress=False)
        with pytest.raises(FingerprintMismatchError):
            procs[0].add_window(om.shard_paths(tmp_path / "other")[1])
        pipe.reset()
        ref.reset()
        assert np.abs(pipe.prefill(prompts[0]) - ref.prefill(prompts[0])).max() <= 1e-3
