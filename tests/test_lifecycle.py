"""The ring's life as users live it, on loopback with real `edgespec node` processes and tiny
float32 models (the ring's greedy output must equal the unsplit model's exactly):

- a stage that fails a request ends that request (StageFailure) and the ring keeps serving:
  no rebuild; a request the ring could never run is refused before it is sent;
- one node process hosting consecutive windows (--rounds 2) passes each window a copy of the
  hidden states, not a view of the buffer its next decode overwrites;
- a node killed and restarted on its port is taken back by `ring rebalance`;
- a second head is refused with the holder named while the first keeps serving;
- after a recovery, `ring status` shows the plan in force and the node that left;
- a node dropped by a new `ring up` unloads its window and gives the memory back;
- a killed `serve` leaves no node process and no key on disk.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from proc_helpers import alive, children
from ring_fixtures import unsplit_greedy
from test_node import REPO, NodeProc, _cli, _env, _health
from tinygguf import make_tiny_gguf

from edgespec.api import Ring
from edgespec.errors import RequestError, StageFailure
from edgespec.head.build import build_head
from edgespec.head.config import HeadConfig
from edgespec.head.formation import form_ring
from edgespec.head.remote import head_identity
from edgespec.wire import auth

N = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("life") / "tiny.gguf", "qwen2", n_layer=6,
                          n_embd=64, seed=23)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    return auth.write_key(tmp_path_factory.mktemp("lifekeys") / "ring.key")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return [int(t) for t in np.random.default_rng(9).integers(3, 200, 12)]


@pytest.fixture(scope="module")
def reference(tiny, prompt) -> list[int]:
    return unsplit_greedy(tiny, prompt, N)


def _greedy(ring: Ring, prompt: list[int], n: int = N) -> list[int]:
    ring.reset()
    return ring.generate(prompt, max_tokens=n, spec="none").tokens


# ------------------------------------------------------------------- failure semantics

def test_stage_error_ends_the_request_not_the_ring(tiny, key_file, prompt, reference,
                                                   tmp_path):
    nodes = [NodeProc(f"f{i}", key_file, tmp_path) for i in range(2)]
    rebuilds: list[Exception] = []
    head = head_identity()
    key = auth.load_key(key_file)
    try:
        chain = form_ring([n.address for n in nodes], tiny, key, ranges=[(0, 3), (3, 6)],
                          n_ctx=256, n_seq_max=4, profile=False, log_fn=lambda s: None,
                          head=head)

        def recover(exc: Exception):
            rebuilds.append(exc)
            return form_ring([n.address for n in nodes], tiny, key, ranges=[(0, 3), (3, 6)],
                             n_ctx=256, n_seq_max=4, profile=False, log_fn=lambda s: None,
                             head=head)

        with build_head(Ring, chain, tiny, HeadConfig(spec="none"), n_ctx=256,
                        recover=recover) as ring:
            assert _greedy(ring, prompt) == reference
            # Caller's mistakes are refused before anything reaches the ring.
            for bad in ({"top_p": 0.0}, {"top_k": -1}, {"temperature": -0.5}):
                with pytest.raises(RequestError):
                    ring.generate(prompt, max_tokens=4,
                                  **{"temperature": 0.7, "top_p": 0.9, **bad})
            with pytest.raises(RequestError, match="outside the vocabulary"):
                ring.generate([*prompt, 10**6], max_tokens=4)
            # A stage fails mid-generation: stage 1 loses its KV cache behind the head's back
            # (its next batch then breaks position continuity there).
            stream = ring.stream(prompt, max_tokens=N, spec="none")
            next(stream)
            ring.chain.members[1].request("reset", head=head)
            with pytest.raises(StageFailure, match="position"):
                for _ in stream:
                    pass
            assert rebuilds == []  # a stage error is not a lost node
            # The ring keeps serving, resynchronised: the next answer is exact.
            assert _greedy(ring, prompt) == reference
            assert rebuilds == [] and ring.recovery_log == []
            for n in nodes:
                assert n.proc.poll() is None
    finally:
        for n in nodes:
            n.stop()


def test_a_context_smaller_than_the_tree_pool_is_refused_not_a_crash(tiny):
    from edgespec.node.runtime import InputError, StageRuntime

    with pytest.raises(InputError, match="n_ctx"):
        StageRuntime(tiny, n_ctx=64, n_seq_max=256, n_threads=1)


def test_max_tokens_beyond_the_context_is_capped(tiny, prompt):
    with Ring.local(tiny, stages=2, spec="none", processes=False, n_ctx=256) as ring:
        gen = ring.generate(prompt, max_tokens=100_000)
        room = 256 - len(prompt)
        assert gen.capped_max_tokens == room
        assert len(gen.tokens) <= room
        assert ring.generate(prompt, max_tokens=4).capped_max_tokens is None
        with pytest.raises(RequestError, match="context"):
            ring.generate([5] * 300, max_tokens=4)


@pytest.mark.parametrize("stages,rounds,ranges", [(4, 2, None), (2, 2, [(0, 1), (1, 6)])],
                         ids=["2x2", "1x2"])
def test_several_windows_per_node_match_the_unsplit_model(tiny, stages, rounds, ranges):
    """--rounds 2: each node hosts two windows (on one node, two consecutive ones, handed on
    in-process). Many small prefill chunks back to back, into a fast window followed by a
    slow one: the fast window's capture buffer is overwritten while the slow one still has
    earlier chunks queued, so what it queues must be a copy."""
    long_prompt = [int(t) for t in np.random.default_rng(4).integers(3, 200, 700)]
    ref = unsplit_greedy(tiny, long_prompt, 64)
    with Ring.local(tiny, stages=stages, rounds=rounds, spec="none", n_ctx=1024,
                    ranges=ranges, prefill_chunk=16) as ring:
        assert len(ring.local_nodes.procs) == stages // rounds
        assert ring.generate(long_prompt, max_tokens=64).tokens == ref


# ------------------------------------------------------------------------ life cycle

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def three(key_file, tmp_path):
    nodes = [NodeProc(f"s{i}", key_file, tmp_path, port=_free_port()) for i in range(3)]
    yield nodes
    for n in nodes:
        n.stop()


def _ring_up(tiny, key_file, home, nodes, *extra) -> subprocess.CompletedProcess:
    spec = ",".join(f"{h}:{p}" for h, p in (n.address for n in nodes))
    res = _cli(["ring", "up", "--model", str(tiny), "--nodes", spec, "--key-file",
                str(key_file), "--ctx", "256", "--no-profile", *extra], home)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def _head_home(tiny, key_file, nodes, tmp_path, monkeypatch) -> Path:
    """A head's EDGESPEC_HOME (for the CLI and this process) with a ring up over ``nodes``."""
    home = tmp_path / "head"
    home.mkdir()
    monkeypatch.setenv("EDGESPEC_HOME", str(home))
    _ring_up(tiny, key_file, home, nodes)
    return home


def _status(key_file, home) -> str:
    res = _cli(["ring", "status", "--key-file", str(key_file)], home)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_restarted_node_rejoins_on_rebalance(tiny, key_file, three, prompt, reference,
                                             tmp_path, monkeypatch):
    home = _head_home(tiny, key_file, three, tmp_path, monkeypatch)
    victim = three[1]
    port = victim.address[1]
    victim.proc.kill()  # kill -9: no goodbye; s0 keeps a link to a dead process
    victim.proc.wait(10)
    three[1] = NodeProc("s1", key_file, tmp_path, port=port)
    assert "not loaded" in _status(key_file, home)
    res = _cli(["ring", "rebalance", "--key-file", str(key_file), "--no-profile"], home)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 stage(s) over 3 node(s)" in res.stdout
    status = _status(key_file, home)
    assert "plan in force: 3 stage(s) on 3 node(s), 256 sequences per context" in status
    assert status.count("  loaded") == 3, status
    with Ring.attach(key=str(key_file), spec="none") as ring:
        assert ring.chain.n_stages == 3
        assert _greedy(ring, prompt) == reference


def test_second_head_is_refused_while_the_first_serves(tiny, key_file, three, prompt,
                                                       reference, tmp_path, monkeypatch):
    home = _head_home(tiny, key_file, three, tmp_path, monkeypatch)
    with Ring.attach(key=str(key_file), spec="none") as first:
        assert _greedy(first, prompt) == reference
        env = _env(home)
        second = subprocess.run([sys.executable, "-m", "edgespec", "chat", "--spec", "none"],
                                input="Say hi.\n", capture_output=True, text=True, env=env,
                                cwd=REPO, timeout=120)
        assert second.returncode != 0
        err = second.stderr.strip().splitlines()
        assert err and f"pid {os.getpid()}" in err[-1] and "held by" in err[-1], second.stderr
        assert "--take-over" in err[-1]
        assert "Traceback" not in second.stderr
        # The first head never noticed.
        assert _greedy(first, prompt) == reference
        assert first.recovery_log == []
    # Released when the first head leaves: now the CLI may attach.
    status = _status(key_file, home)
    assert "no head attached" in status, status


def test_status_after_a_recovery_shows_the_plan_in_force(tiny, key_file, three, prompt,
                                                         reference, tmp_path, monkeypatch):
    home = _head_home(tiny, key_file, three, tmp_path, monkeypatch)
    with Ring.attach(key=str(key_file), spec="none") as ring:
        assert _greedy(ring, prompt) == reference
        three[2].proc.kill()
        three[2].proc.wait(10)
        assert _greedy(ring, prompt) == reference  # recovered over s0 and s1
        assert len(ring.recovery_log) == 1 and ring.chain.n_stages == 2
        status = _status(key_file, home)
    assert "plan in force: 2 stage(s) on 2 node(s)" in status, status
    lines = {ln.split()[0]: ln for ln in status.splitlines() if ln.startswith("s")}
    assert lines["s0"].endswith("loaded") and lines["s1"].endswith("loaded"), status
    assert " left (" in lines["s2"], status


def test_node_dropped_by_a_new_ring_up_frees_its_memory(tiny, key_file, three, tmp_path):
    home = tmp_path / "head"
    home.mkdir()
    _ring_up(tiny, key_file, home, three)
    before = _health(three[2].address, key_file)
    assert before["stages"], before
    res = _ring_up(tiny, key_file, home, three[:2])
    assert "s2: windows unloaded" in res.stdout, res.stdout
    after = _health(three[2].address, key_file)
    assert after["stages"] == {}
    assert after["rss"] < before["rss"], (before["rss"], after["rss"])
    assert "unloaded stage(s)" in three[2].log()


def test_killed_serve_leaves_no_node_and_no_key(tiny, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**_env(home), "TMPDIR": str(tmp)}
    port = _free_port()
    serve = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", "--local", "2",
                              "--model", str(tiny), "--port", str(port), "--spec", "none",
                              "--ctx", "256"], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        nodes: list[int] = []
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert serve.poll() is None, serve.stderr.read() if serve.stderr else ""
            time.sleep(0.2)
        nodes = children(serve.pid)
        assert len(nodes) == 2, nodes
        serve.kill()
        serve.wait(10)
        time.sleep(5)
        assert [p for p in nodes if alive(p)] == []
        assert list(tmp.glob("edgespec-local-*")) == []
    finally:
        if serve.poll() is None:
            serve.kill()
        for p in children(serve.pid):
            os.kill(p, signal.SIGKILL)


def test_a_ring_opened_in_a_short_lived_thread_outlives_it(tiny, prompt, reference):
    """Nodes die with their head, not with the thread that happened to start them."""
    import threading

    box: list[Ring] = []
    t = threading.Thread(target=lambda: box.append(Ring.local(tiny, stages=2, spec="none")))
    t.start()
    t.join()
    with box[0] as ring:
        time.sleep(1.0)
        assert all(p.poll() is None for p in ring.local_nodes.procs)
        assert _greedy(ring, prompt) == reference
