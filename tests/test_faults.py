"""Faults the soak (``bench/soak.py``) met, each on loopback with real `edgespec node`
processes and a tiny float32 model (greedy output equals the unsplit model's exactly):

- a node stopped (SIGTERM) while a generation runs through it: the head finds the node gone
  and recovers, and the answer is whole and right (a stopping node closes its connections
  before it unloads its stages, so no stage answers "not hosted" under a live link);
- a request to a node whose connection already ended fails at once, not at its deadline;
- a node that answers but whose disk fills while its shards arrive is left out of the ring
  the head re-forms, which serves on over the others;
- a node re-planned while the node after it stopped reading (its link down) loads the new
  plan at once, though a stage of it was blocked sending to that node.
"""

from __future__ import annotations

# ruff: noqa: F811 (the fixtures of test_lifecycle, imported, are taken by name)
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from ring_fixtures import unsplit_greedy
from test_lifecycle import (  # noqa: F401
    _env,
    _free_port,
    _greedy,
    _head_home,
    key_file,
    prompt,
    three,
    tiny,
)
from test_node import REPO, NodeProc, _batch

from edgespec.api import Ring
from edgespec.errors import NodeLost
from edgespec.llm.gguf_read import fingerprint
from edgespec.tree.kvop import KvOp
from edgespec.wire import FieldTag, Kind, Message, auth, control_message
from edgespec.wire.frames import batch_message
from edgespec.wire.server import FrameServer
from edgespec.wire.transport import connect

N = 48


@pytest.fixture(scope="module")
def reference(tiny, prompt) -> list[int]:
    return unsplit_greedy(tiny, prompt, N)


def test_a_node_stopped_mid_answer_is_recovered_from(tiny, key_file, three, prompt, reference,
                                                     tmp_path, monkeypatch):
    _head_home(tiny, key_file, three, tmp_path, monkeypatch)
    with Ring.attach(key=str(key_file), spec="none") as ring:
        assert _greedy(ring, prompt, N) == reference
        for round_ in range(3):  # stop a node at a few points of an answer
            victim = three[1] if round_ % 2 == 0 else three[2]
            got: list = []
            t = threading.Thread(target=lambda got=got: got.append(_greedy(ring, prompt, N)))
            t.start()
            time.sleep(0.05 * round_)
            victim.proc.send_signal(signal.SIGTERM)
            t.join(120)
            assert got == [reference], round_
            victim.proc.wait(30)
            idx = three.index(victim)
            three[idx] = NodeProc(victim.name, key_file, tmp_path, port=victim.address[1])
            ring.rebalance(profile=False)
            assert ring.chain.n_stages == 3


def test_a_request_to_a_closed_connection_fails_at_once(tiny, key_file, three, tmp_path,
                                                        monkeypatch):
    _head_home(tiny, key_file, three, tmp_path, monkeypatch)
    with Ring.attach(key=str(key_file), spec="none") as ring:
        member = ring.chain.members[1]
        three[1].proc.kill()
        three[1].proc.wait(10)
        member.thread.join(10)
        assert not member.thread.is_alive()
        t0 = time.monotonic()
        with pytest.raises(NodeLost, match="connection closed"):
            member.request("ping", timeout=300)
        assert time.monotonic() - t0 < 60


def test_a_reload_does_not_wait_for_a_next_node_that_stopped_reading(tiny, key_file, tmp_path):
    """The link down that makes the head re-plan also stops the node after this one reading:
    this node's stage, blocked sending to it, must not hold the new plan's load until the
    link comes back (the node drops the old plan's links first, which fails that send)."""
    node = NodeProc("s0", key_file, tmp_path)
    key = auth.load_key(key_file)
    stalled = threading.Event()
    load = {"model_path": str(tiny), "fingerprint": fingerprint(tiny),
            "windows": [[0, 0, 3, False]], "n_ctx": 256, "n_seq_max": 4}
    rows = 200
    try:
        with FrameServer(key, node_id="stalled-next") as nxt, \
                connect(*node.address, key, node_id="head") as head:
            nxt.register(Kind.HIDDEN, lambda conn, frame: stalled.wait(120) and None)
            head.request(control_message("load", **load), timeout=60)
            host, port = nxt.address
            head.request(control_message("connect", links={
                "0": {"host": host, "port": port, "stage": 1}}), timeout=30)
            clear = Message(Kind.KV_OPS, {FieldTag.KV_OPS: KvOp.clear(), FieldTag.META: {"stage": 0}})
            for lap in range(1, 400):  # 20 MB of hidden states for a link nobody reads
                head.send(batch_message(_batch(np.arange(rows) % 200 + 3, np.arange(rows),
                                               [[0]] * rows, lap=lap), stage=0))
                head.send(clear)
            time.sleep(2)
            t0 = time.monotonic()
            head.request(control_message("load", **load), timeout=120)
            took = time.monotonic() - t0
            stalled.set()
        assert took < 10, f"the load waited {took:.1f} s for the old plan's stage"
    finally:
        stalled.set()
        assert node.stop() == 0, node.log()


def _can_mount() -> bool:
    """Whether a private mount namespace with a tmpfs can be made here (root, unshare)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    res = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                          "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return res.returncode == 0


@pytest.mark.skipif(not _can_mount(), reason="needs root, util-linux's unshare and a tmpfs "
                    "mount in a mount namespace of its own")
def test_a_node_whose_disk_fills_with_shards_is_left_out(tiny, key_file, three, prompt,
                                                         reference, tmp_path, monkeypatch):
    _head_home(tiny, key_file, three, tmp_path, monkeypatch)
    with Ring.attach(key=str(key_file), spec="none") as ring:
        assert _greedy(ring, prompt, N) == reference
        victim = three[2]
        port = victim.address[1]
        victim.proc.kill()
        victim.proc.wait(10)
        # Back on its port, without the model file (an empty tmpfs over its folder) and
        # with a 16 KiB disk: the re-formed ring sends it shards until the disk is full.
        small = tmp_path / "small"
        small.mkdir()
        script = (f"mount -t tmpfs -o size=1m tmpfs {tiny.parent} && "
                  f"mount -t tmpfs -o size=16k tmpfs {small} && exec \"$@\"")
        out, err = tmp_path / "small-node.out", tmp_path / "small-node.err"
        proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
             sys.executable, "-m", "edgespec", "node", "--port", str(port), "--bind",
             "127.0.0.1", "--no-mdns", "--name", "s2", "--key-file", str(key_file),
             "--threads", "1", "--cache", str(small)],
            stdout=open(out, "w"), stderr=open(err, "w"),  # noqa: SIM115
            env=_env(tmp_path / "home-s2"), cwd=REPO)
        try:
            deadline = time.monotonic() + 60
            while "edgespec node s2 (" not in out.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.1)
            assert _greedy(ring, prompt, N) == reference
            assert ring.chain.n_stages == 2
            assert "No space left on device" in err.read_text()
        finally:
            proc.kill()
            proc.wait(10)


def test_a_dropped_last_window_frees_its_samplers_at_once():
    """A last window's samplers (and the grammar matchers they keep, which hold llguidance's
    view of the vocabulary) go with its worker, with no cycle left for a collection that a
    quiet node may not run: reloads under grammar traffic would otherwise pile them up."""
    import gc
    import types
    import weakref

    from edgespec.node.info import release_free_heap
    from edgespec.node.worker import StageWorker

    gc.disable()
    try:
        worker = StageWorker([types.SimpleNamespace(model=None)], is_last=True)
        samplers = weakref.ref(worker.samplers)
        del worker
        assert samplers() is None
    finally:
        gc.enable()

    class Cycle:
        pass

    a, b = Cycle(), Cycle()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    gc.disable()
    try:
        del a, b
        release_free_heap()  # what a node runs after unloading its windows
        assert gone() is None
    finally:
        gc.enable()
