"""A node dies in the middle of a generation: the head notices, re-plans over the survivors,
replays the committed history and finishes the same generation, losing and repeating nothing."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from edgespec.api import Ring

pytestmark = pytest.mark.real_model

PROMPT = "def merge_sort(items):\n    \"\"\"Sort a list with merge sort.\"\"\"\n"
N = 96


def test_sigkill_one_of_three_stages_mid_generation(real_model_path):
    with Ring.local(real_model_path, stages=3, spec="none") as ring:
        reference = ring.generate(PROMPT, max_tokens=N)
        assert len(reference.tokens) == N
        ring.reset()
        victim = ring.local_nodes.procs[1]  # the middle stage's process
        killed = threading.Event()
        pieces = []
        stream = ring.stream(PROMPT, max_tokens=N)
        for seen, piece in enumerate(stream, start=1):
            pieces.append(piece)
            if seen == 30 and not killed.is_set():
                os.kill(victim.pid, signal.SIGKILL)
                killed.set()
        gen = stream.result
        assert killed.is_set()
        assert gen.tokens == reference.tokens  # nothing lost, nothing repeated
        assert "".join(pieces) == reference.text
        assert gen.stats.recoveries == 1
        assert ring.chain.n_stages == 2
        print(f"recovery took {ring.recovery_log[-1]['seconds']:.2f} s")  # `pytest -s` shows it
        # And the rebuilt ring keeps working for the next request.
        ring.reset()
        assert ring.generate(PROMPT, max_tokens=8).tokens == reference.tokens[:8]
