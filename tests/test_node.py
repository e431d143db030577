"""Node daemon robustness on loopback: real `edgespec node` processes, real sockets, tiny
float32 models (so the ring's greedy output must equal the unsplit model's exactly).

- a peer holding another ring key is refused with a clear log line, while a ring through the
  same node keeps generating;
- malformed frames (garbage after a valid handshake, a batch for a stage the node does not
  host, bad token/seq ids or hidden widths, bad positions) are answered with ERROR (or the
  connection is closed) and the node keeps serving;
- the profile op, the planner, and `edgespec ring status` / `ring down` with dead nodes.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from lab import stop_process
from ring_fixtures import unsplit_greedy
from tinygguf import make_tiny_gguf

from edgespec.api import Ring
from edgespec.batch import Batch
from edgespec.errors import RingError
from edgespec.head.addresses import pick_address
from edgespec.head.build import build_head
from edgespec.head.config import HeadConfig
from edgespec.head.formation import form_ring
from edgespec.head.memory import ModelMemory
from edgespec.head.planner import (
    NodeProfile,
    PlanError,
    fit_plan,
    plan_ring,
    roomy_ends,
)
from edgespec.llm.gguf_read import fingerprint
from edgespec.tree.kvop import KvOp, KvOpCode
from edgespec.wire import FieldTag, Kind, Message, auth, control_message, encode_frame
from edgespec.wire.frames import batch_message
from edgespec.wire.transport import RemoteError, TransportError, connect

REPO = Path(__file__).resolve().parents[1]
N_TOKENS = 24
_LISTEN = re.compile(r"edgespec node \S+ \((\w+)\) on ([\d.]+):(\d+)")


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["EDGESPEC_HOME"] = str(home)
    env.pop("EDGESPEC_KEY_FILE", None)
    env["OMP_WAIT_POLICY"] = "passive"  # several llama.cpp contexts share the cores
    return env


class NodeProc:
    """One `edgespec node` on 127.0.0.1 (any port, no mDNS), logging to files."""

    def __init__(self, name: str, key_file: Path, workdir: Path, port: int = 0) -> None:
        self.name = name
        home = workdir / f"home-{name}"
        home.mkdir(parents=True, exist_ok=True)
        self.out, self.err = workdir / f"{name}.out", workdir / f"{name}.err"
        # Appended, so a node restarted under the same name keeps its earlier log.
        seen = self.out.stat().st_size if self.out.exists() else 0
        with open(self.out, "a") as fo, open(self.err, "a") as fe:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "edgespec", "node", "--port", str(port), "--bind", "127.0.0.1",
                 "--no-mdns", "--name", name, "--key-file", str(key_file), "--threads", "1"],
                stdout=fo, stderr=fe, env=_env(home), cwd=REPO)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = _LISTEN.search(self.out.read_text()[seen:])
            if m:
                self.node_id, self.address = m.group(1), (m.group(2), int(m.group(3)))
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"node {name} did not start:\n{self.err.read_text()}")

    def log(self) -> str:
        return self.err.read_text()

    def stop(self) -> int | None:
        return stop_process(self.proc)


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("node") / "tiny.gguf", "qwen2", n_layer=4,
                          n_embd=64, seed=11)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("keys")
    return auth.write_key(d / "ring.key"), auth.write_key(d / "other.key")


@pytest.fixture(scope="module")
def ring(tiny_model, keys, tmp_path_factory):
    """Two node processes with two layers each, and a head over them (mode none)."""
    work = tmp_path_factory.mktemp("ring")
    nodes = [NodeProc(f"r{i}", keys[0], work) for i in range(2)]
    try:
        chain = form_ring([n.address for n in nodes], tiny_model, auth.load_key(keys[0]),
                          ranges=[(0, 2), (2, 4)], n_ctx=512, n_seq_max=4, profile=False,
                          log_fn=lambda s: None)
        head = build_head(Ring, chain, tiny_model, HeadConfig(spec="none"), n_ctx=512)
        head.nodes = nodes
        yield head
        head.close()
        for n in nodes:
            assert n.stop() == 0, n.log()
    finally:
        for n in nodes:
            n.stop()


@pytest.fixture(scope="module")
def prompt(ring) -> list[int]:
    rng = np.random.default_rng(5)
    return [int(t) for t in rng.integers(3, ring.tokenizer.n_vocab, 10)]


@pytest.fixture(scope="module")
def reference(tiny_model, prompt) -> list[int]:
    return unsplit_greedy(tiny_model, prompt, N_TOKENS)


def _generate(ring: Ring, prompt: list[int]) -> list[int]:
    ring.reset()
    return ring.generate(prompt, max_tokens=N_TOKENS, spec="none").tokens


def _health(address, key_file: Path) -> dict:
    with connect(*address, auth.load_key(key_file), node_id="probe") as c:
        return c.request(control_message("health"), timeout=30).meta


# ----------------------------------------------------------------------------- auth

def test_ring_matches_unsplit_model(ring, prompt, reference):
    assert _generate(ring, prompt) == reference


def test_wrong_key_refused_while_ring_generates(ring, keys, prompt, reference):
    wrong = auth.load_key(keys[1])
    refusals: list[str] = []
    got: list[list[int]] = []

    def generate() -> None:
        got.append(_generate(ring, prompt))

    t = threading.Thread(target=generate)
    t.start()
    # Knock on both nodes while the ring is busy: each attempt must be refused, and must
    # not disturb the laps going through the same nodes.
    while t.is_alive() or len(refusals) < 4:
        for node in ring.nodes:
            with pytest.raises(auth.AuthError) as exc:
                connect(*node.address, wrong, node_id="intruder")
            refusals.append(str(exc.value))
        time.sleep(0.01)
    t.join()
    assert got == [reference]
    assert all("ring key mismatch" in r for r in refusals), refusals
    for node in ring.nodes:
        log = node.log()
        assert re.search(r"refused peer 127\.0\.0\.1:\d+: ring key mismatch", log), log
        assert node.proc.poll() is None
    assert _generate(ring, prompt) == reference


# ----------------------------------------------------------------------------- bad frames

def test_garbage_after_handshake_is_answered_and_closed(ring, keys, prompt, reference):
    node = ring.nodes[0]
    conn = connect(*node.address, auth.load_key(keys[0]), node_id="fuzzer")
    # A valid handshake, then bytes that are no frame at all: the stream's framing is lost,
    # so the node says why and closes this connection only.
    conn._sock.sendall(b"\x00garbage, not an edgespec frame\xff" * 4)
    reply = conn.recv(timeout=30)
    assert reply.kind == Kind.ERROR and reply.meta["code"] == "bad_frame", reply
    with pytest.raises(TransportError):
        conn.recv(timeout=30)
    conn.close()

    # A well-framed frame with a forged MAC: trust is lost, same answer.
    conn = connect(*node.address, auth.load_key(keys[0]), node_id="forger")
    header, chunks = encode_frame(control_message("health"))
    body = b"".join(bytes(c) for c in chunks)
    conn._sock.sendall(header._replace(seq=1).pack() + body + b"\x00" * 16)
    reply = conn.recv(timeout=30)
    assert reply.kind == Kind.ERROR and reply.meta["code"] == "auth", reply
    with pytest.raises(TransportError):
        conn.recv(timeout=30)
    conn.close()

    assert _health(node.address, keys[0])["name"] == node.name
    assert _generate(ring, prompt) == reference


def _batch(tokens, pos, seq_ids, lap: int = 5) -> Batch:
    n = len(pos)
    return Batch(np.asarray(tokens, np.int32), np.asarray(pos, np.int32), seq_ids,
                 np.arange(n, dtype=np.int32), np.ones(n, bool), lap=lap)


def test_malformed_batches_get_error_replies(ring, keys, prompt, reference):
    first, second = ring.nodes
    n_vocab = ring.tokenizer.n_vocab
    ok = _batch([5, 6], [0, 1], [[0], [0]])
    hidden = np.zeros((2, 64), np.float32)
    cases = [
        # (node, message, code, text in the error)
        (first, batch_message(ok, stage=7), "bad_payload", "stage 7 is not hosted"),
        (second, batch_message(ok, stage=0), "bad_payload", "stage 0 is not hosted"),
        (first, batch_message(ok, hidden, stage=0), "bad_payload", "takes token ids"),
        (second, batch_message(ok, stage=1), "bad_payload", "takes hidden states"),
        (first, batch_message(_batch([5, 6], [0, 1], [[0], [9]]), stage=0), "bad_payload",
         "seq id 9 outside 0..3"),
        (first, batch_message(_batch([5, n_vocab + 3], [0, 1], [[0], [0]]), stage=0),
         "bad_payload", f"token id {n_vocab + 3} outside the vocabulary"),
        (second, batch_message(ok, np.zeros((2, 48), np.float32), stage=1), "bad_payload",
         "takes hidden states [2, 64], got [2, 48]"),
        (first, Message(Kind.KV_OPS, {FieldTag.KV_OPS: [KvOp(1, 0, -1, -1)],
                                      FieldTag.META: {"stage": 3}}), "bad_payload",
         "stage 3 is not hosted"),
        (first, Message(Kind.RESULT, {FieldTag.TARGETS: np.zeros(1, np.int32)}),
         "unsupported", "does not handle RESULT"),
        (first, control_message("no_such_op"), "unknown_op", "no_such_op"),
        (first, control_message("connect", links={"9": "head"}), "bad_payload",
         "stage 9 is not hosted"),
    ]
    # One connection for all of them: a bad payload costs an ERROR reply, not the connection.
    with connect(*first.address, auth.load_key(keys[0]), node_id="fuzzer") as c1, \
            connect(*second.address, auth.load_key(keys[0]), node_id="fuzzer") as c2:
        conns = {first.name: c1, second.name: c2}
        for node, msg, code, text in cases:
            with pytest.raises(RemoteError) as exc:
                conns[node.name].request(msg, timeout=30)
            assert exc.value.code == code and text in exc.value.message, (code, text, exc.value)
        for node in (first, second):
            assert conns[node.name].request(control_message("health")).meta["ok"]
    # Nothing of it reached the stages or the head: the ring is intact.
    assert _generate(ring, prompt) == reference


def test_bad_positions_fail_the_lap_not_the_node(ring, prompt, reference):
    """Positions are checked against the KV cache when the batch's turn comes, so the error
    reaches the head (as the lap's result) and the stage goes on with the next batch."""
    ring.reset()
    chain = ring.chain
    # A gap: seq 0 is empty, so its first row must be at position 0.
    chain.submit(_batch([5, 6], [3, 4], [[0], [0]]))
    with pytest.raises(RingError, match=r"stage 0 .*position 3, expected 0"):
        chain.next_result(timeout=60)
    # A row shared by two seqs whose histories differ, after a valid prefix of seq 0.
    chain.submit(_batch([5, 6], [0, 1], [[0], [0]], lap=6))
    assert len(chain.next_result(timeout=60).targets) == 2
    chain.submit(_batch([7], [2], [[0, 1]], lap=7))
    with pytest.raises(RingError, match="histories differ|expected"):
        chain.next_result(timeout=60)
    # KV operations on a sequence the stage does not have.
    chain.kv([KvOp(1, 99, -1, -1)])
    with pytest.raises(RingError, match="seq id 99"):
        chain.next_result(timeout=60)
    assert _generate(ring, prompt) == reference


def test_kv_ops_of_a_batch_pruned_whole_still_reach_later_stages(ring, prompt, reference):
    """A FlowSpec segment pruned entirely at stage 0 is answered from there, but its KV
    operations (here the prefix copy giving seq 1 its history) must still reach stage 1: the
    next row of seq 1 continues that history on every stage."""
    ring.reset()
    chain = ring.chain
    chain.submit(_batch([5, 6, 7], [0, 1, 2], [[0], [0], [0]], lap=11))
    assert len(chain.next_result(timeout=60).targets) == 3
    chain.prune([0], lap=12)  # same connection as the batch below: it lands first
    doomed = _batch([8], [3], [[1]], lap=12)
    doomed.pre_ops = [KvOp(KvOpCode.CP, 0, 0, 3, 1)]  # seq 0 -> seq 1, positions [0, 3)
    chain.submit(doomed)
    res = chain.next_result(timeout=60)
    assert (res.lap, len(res.nodes)) == (12, 0)  # pruned: nothing of it came back
    chain.submit(_batch([9], [3], [[1]], lap=13))  # continues seq 1 at position 3
    res = chain.next_result(timeout=60)
    assert res.lap == 13 and len(res.targets) == 1
    assert _generate(ring, prompt) == reference


def test_next_node_refusal_reaches_the_head(ring, prompt, reference):
    """Stage 0 wired to a stage its next node does not host (a wiring mistake): the next node
    refuses every batch on the node-to-node link, and stage 0's node relays that ERROR to the
    head, which fails the lap at once instead of waiting for a result that never comes."""
    chain = ring.chain
    first = chain.members[0]
    host, port = chain.members[1].address
    first.request("connect", links={"0": {"host": host, "port": port, "stage": 5}})
    try:
        ring.reset()
        chain.submit(_batch([5, 6], [0, 1], [[0], [0]]))
        with pytest.raises(RingError, match=r"next_refused: .*stage 5 is not hosted"):
            chain.next_result(timeout=60)
    finally:
        first.request("connect", links={"0": {"host": host, "port": port, "stage": 1}})
    assert "stage 5 is not hosted" in ring.nodes[0].log()
    assert _generate(ring, prompt) == reference


# ----------------------------------------------------------------------------- profile

def test_profile_op(ring, keys, tiny_model):
    node = ring.nodes[1]
    fp = fingerprint(tiny_model)
    with connect(*node.address, auth.load_key(keys[0]), node_id="planner") as c:
        meta = c.request(control_message("profile", model_path=str(tiny_model), fingerprint=fp),
                         timeout=120).meta
        assert sorted(meta["ms_per_layer"], key=int) == ["1", "4", "16"]
        assert all(v > 0 for v in meta["ms_per_layer"].values())
        assert meta["layers_profiled"] == 2 and meta["n_layer"] == 4 and meta["free_ram"] > 0
        meta = c.request(control_message("profile", model_path=str(tiny_model),
                                         batch_sizes=[2, 8]), timeout=120).meta
        assert sorted(meta["ms_per_layer"], key=int) == ["2", "8"]
        bad = [
            ({"batch_sizes": [0]}, "bad_payload", "batch_sizes"),
            ({"batch_sizes": [100000]}, "bad_payload", "batch_sizes"),
            ({"batch_sizes": "16"}, "bad_payload", "batch_sizes"),
            ({"fingerprint": "0" * 16}, "handler_failed", "fingerprint mismatch"),
            ({"model_path": str(tiny_model) + ".missing"}, "handler_failed", "is not on node"),
        ]
        for extra, code, text in bad:
            body = {"model_path": str(tiny_model), "fingerprint": fp, **extra}
            with pytest.raises(RemoteError) as exc:
                c.request(control_message("profile", **body), timeout=60)
            assert exc.value.code == code and text in exc.value.message, exc.value
        assert c.request(control_message("health")).meta["stages"]  # still serving its stage


# ----------------------------------------------------------------------------- planner

def _prof(name: str, ms: float | dict, free_mem: int = 0, rtt: float = 0.0) -> NodeProfile:
    per = ms if isinstance(ms, dict) else {1: ms}
    return NodeProfile(name, name, "10.0.0.1", 7654, ms_per_layer=per, free_mem=free_mem,
                       rtt_ms=rtt)


def _counts(plan) -> list[int]:
    out = [0] * len(plan.nodes)
    for w in plan.windows:
        out[w.node] += w.n_layers
    return out


def _check_cover(plan, n_layer: int) -> None:
    assert plan.windows[0].start == 0 and plan.windows[-1].stop == n_layer
    for a, b in zip(plan.windows, plan.windows[1:], strict=False):
        assert a.stop == b.start and b.stage == a.stage + 1
    assert all(w.n_layers >= 1 for w in plan.windows)


def test_planner_shares_follow_speed():
    plan = plan_ring(28, 100, [_prof("a", 1.0), _prof("b", 2.0), _prof("c", 4.0)])
    assert _counts(plan) == [16, 8, 4]  # speeds 4:2:1
    assert [w.node for w in plan.windows] == [0, 1, 2]
    _check_cover(plan, 28)
    # Estimated lap: each window's compute, plus the hops (half an RTT each, none here).
    assert plan.est_lap_ms == pytest.approx(16 * 1.0 + 8 * 2.0 + 4 * 4.0)
    # The batch size picks the nearest measured curve point.
    fast_at_16 = _prof("a", {1: 1.0, 16: 8.0})
    plan16 = plan_ring(24, 100, [fast_at_16, _prof("b", {1: 2.0, 16: 2.0})], batch=16)
    assert _counts(plan16) == [5, 19]  # speeds 1/8 : 1/2 at batch 16
    assert "estimated lap time" in plan.table() and "b" in plan.table()


def test_planner_rounding_and_minimum_share():
    plan = plan_ring(10, 100, [_prof("a", 1.0), _prof("b", 1.0), _prof("c", 1.0)])
    assert sorted(_counts(plan)) == [3, 3, 4]
    # A very slow node still gets one layer (or it should not be in the ring).
    plan = plan_ring(24, 100, [_prof("fast", 1.0), _prof("slow", 1000.0)])
    assert _counts(plan) == [23, 1]
    with pytest.raises(PlanError, match="more nodes than layers"):
        plan_ring(2, 100, [_prof(x, 1.0) for x in "abc"])


def test_planner_memory_caps():
    # The fastest node can hold 5 layers (RESERVE, 90%, of its free memory); the rest flows
    # to the others in proportion to their speeds.
    nodes = [_prof("fast", 1.0, free_mem=625), _prof("b", 2.0), _prof("c", 2.0)]
    plan = plan_ring(25, 100, nodes)
    assert _counts(plan) == [5, 10, 10]
    _check_cover(plan, 25)
    # Caps on every node, enough in total: each at most its cap.
    nodes = [_prof("a", 1.0, free_mem=1000), _prof("b", 1.0, free_mem=2000)]
    assert _counts(plan_ring(20, 100, nodes)) == [9, 11]


_MIB = 1 << 20
# 12 layers of 10 MiB, no KV cache at n_ctx 0, and a vocabulary whose logits buffer is 195 MiB
# at 256 sequences, 49 MiB at 64.
_MEM = ModelMemory(layer_weights=[10 * _MIB] * 12, kv_per_token=[0] * 12, embd_bytes=20 * _MIB,
                   head_bytes=30 * _MIB, n_vocab=200_000)


def _fit(nodes, **kw):
    return fit_plan(12, 10 * _MIB, nodes, memory=_MEM, n_ctx=0, **kw)


def test_fit_plan_takes_the_most_sequences_that_fit():
    roomy = [_prof(x, 1.0, free_mem=400 * _MIB) for x in "abc"]
    fit = _fit(roomy)
    assert (fit.n_seq_max, fit.order, fit.notes) == (256, [0, 1, 2], [])
    # 250 MiB each: the ends' logits buffers at 256 sequences do not fit, at 128 they do.
    short = [_prof(x, 1.0, free_mem=250 * _MIB) for x in "abc"]
    with pytest.raises(PlanError):
        plan_ring(12, 10 * _MIB, short, memory=_MEM, n_ctx=0, n_seq_max=256)
    fit = _fit(short)
    assert fit.n_seq_max == 128 and fit.order == [0, 1, 2]
    assert any("128 sequences" in n for n in fit.notes), fit.notes
    assert sum(w.n_layers for w in fit.plan.windows) == 12
    # Sequences given are kept, fitting or not.
    with pytest.raises(PlanError):
        _fit(short, n_seq_max=256)


def test_fit_plan_puts_the_roomiest_nodes_at_the_ends():
    # A small device found last cannot hold the last window (head, logits) at any number of
    # sequences; in the middle it holds a few layers.
    nodes = [_prof("a", 1.0, free_mem=250 * _MIB), _prof("b", 1.0, free_mem=260 * _MIB),
             _prof("s", 1.0, free_mem=140 * _MIB)]
    assert roomy_ends(nodes) == [0, 2, 1]  # the roomiest (b) holds the last window
    fit = _fit(nodes)
    assert [n.name for n in fit.plan.nodes] == ["a", "s", "b"]
    assert fit.order == [0, 2, 1] and any("hold the ends" in n for n in fit.notes)
    layers = {fit.plan.nodes[w.node].name: w.n_layers for w in fit.plan.windows}
    assert layers["s"] > 0 and sum(layers.values()) == 12
    # Ranges given are the user's, node by node: their order stays, and the plan fails.
    with pytest.raises(PlanError):
        _fit(nodes, ranges=[(0, 4), (4, 8), (8, 12)])


def test_planner_refuses_when_memory_is_short():
    nodes = [_prof("a", 1.0, free_mem=500), _prof("b", 1.0, free_mem=500)]
    with pytest.raises(PlanError, match="can hold 8 of 24 layers"):
        plan_ring(24, 100, nodes)
    # A node that cannot hold a single layer is named, not silently given one.
    nodes = [_prof("a", 1.0), _prof("tiny", 1.0, free_mem=50)]
    with pytest.raises(PlanError, match="tiny"):
        plan_ring(24, 100, nodes)


def test_planner_rounds_visit_nodes_in_ring_order():
    plan = plan_ring(24, 100, [_prof("a", 1.0), _prof("b", 1.0)], rounds=2)
    assert [(w.node, w.start, w.stop) for w in plan.windows] == [
        (0, 0, 6), (1, 6, 12), (0, 12, 18), (1, 18, 24)]
    plan = plan_ring(20, 100, [_prof("a", 1.0), _prof("b", 3.0), _prof("c", 1.0)], rounds=3)
    assert [w.node for w in plan.windows] == [0, 1, 2] * 3
    _check_cover(plan, 20)
    # Shares 60/7, 20/7, 60/7: floors 8, 2, 8; the two spare layers go to the largest
    # remainders (b, then a, the first of the tie).
    assert _counts(plan) == [9, 3, 8]
    with pytest.raises(PlanError, match="rounds need at least"):
        plan_ring(24, 100, [_prof("fast", 1.0), _prof("slow", 100.0)], rounds=2)
    with pytest.raises(PlanError, match="rounds must be"):
        plan_ring(24, 100, [_prof("a", 1.0)], rounds=0)


def test_planner_range_overrides():
    nodes = [_prof("a", 1.0, rtt=2.0), _prof("b", 1.0, rtt=4.0)]
    plan = plan_ring(24, 100, nodes, ranges=[(0, 4), (4, 10), (10, 20), (20, 24)], rounds=2)
    assert [(w.node, w.start, w.stop) for w in plan.windows] == [
        (0, 0, 4), (1, 4, 10), (0, 10, 20), (1, 20, 24)]
    # Hops: half the head RTT of each window's node, plus the way back from the last one.
    assert plan.est_lap_ms == pytest.approx(24 * 1.0 + (1 + 2 + 1 + 2) + 2)
    for ranges, text in [([(0, 12)], "ranges given"), ([(0, 12), (13, 24)], "contiguous"),
                         ([(0, 12), (12, 20)], "end at layer 20")]:
        with pytest.raises(PlanError, match=text):
            plan_ring(24, 100, nodes, ranges=ranges)


def test_pick_address_prefers_the_heads_own_network():
    from edgespec.head.addresses import _local_networks

    assert pick_address(["0.0.0.0", "fe80::1%eth0"]) is None
    assert pick_address(["127.0.0.1", "2001:db8::5"]) == "2001:db8::5"
    assert pick_address(["2001:db8::5", "203.0.113.9"]) == "203.0.113.9"
    assert pick_address(["127.0.0.1"]) == "127.0.0.1"
    lan = [n for n in _local_networks() if not n.is_loopback and n.num_addresses > 2]
    if lan:
        mine = str(next(lan[0].hosts()))
        assert pick_address(["203.0.113.9", "172.31.250.1", mine]) == mine


# ----------------------------------------------------------------------------- CLI status

def _cli(args: list[str], home: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True,
                          text=True, env=_env(home), cwd=REPO, timeout=timeout)


def test_ring_status_and_down_with_dead_nodes(tiny_model, keys, tmp_path):
    import json

    home = tmp_path / "head"
    home.mkdir()
    key = str(keys[0])
    res = _cli(["ring", "status", "--key-file", key], home)
    assert res.returncode == 1 and "no ring is up" in res.stderr, res.stderr

    nodes = [NodeProc(f"s{i}", keys[0], tmp_path) for i in range(3)]
    black_hole = socket.socket()
    try:
        spec = ",".join(f"{h}:{p}" for h, p in (n.address for n in nodes))
        res = _cli(["ring", "up", "--model", str(tiny_model), "--nodes", spec,
                    "--key-file", key, "--ctx", "256"], home)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "ring is up: 3 stages on 3 node(s)" in res.stdout

        def status() -> dict[str, str]:
            r = _cli(["ring", "status", "--key-file", key], home)
            assert r.returncode == 0, r.stdout + r.stderr
            return {line.split()[0]: line for line in r.stdout.splitlines()
                    if line.startswith("s")}

        rows = status()
        assert sorted(rows) == ["s0", "s1", "s2"]
        for i, n in enumerate(nodes):
            assert re.search(rf"^s{i}\s+127\.0\.0\.1:{n.address[1]}\s+\d+:\d+\s+[\d.]+GB\s+"
                             rf"cpu\s+[\d.]+\s+loaded$", rows[f"s{i}"]), rows[f"s{i}"]

        # s1 dies; s2's address now leads to a host that accepts TCP but never answers.
        assert nodes[1].stop() == 0
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(4)
        state_file = home / "ring.json"
        state = json.loads(state_file.read_text())
        state["nodes"][2]["port"] = black_hole.getsockname()[1]
        state_file.write_text(json.dumps(state))
        rows = status()
        # s0 still holds its window, but its link to the dead s1 is gone: status says so.
        assert rows["s0"].endswith("loaded, link down"), rows
        assert re.search(r"unreachable \(.*(refused|Refused)", rows["s1"]), rows
        assert re.search(r"unreachable \(.*timed out", rows["s2"]), rows

        res = _cli(["ring", "down", "--key-file", key], home)
        assert res.returncode == 0, res.stderr
        assert "s0: windows unloaded" in res.stdout
        assert "s1: unreachable" in res.stderr and "s2: unreachable" in res.stderr
        assert not state_file.exists()
        assert _health(nodes[0].address, keys[0])["stages"] == {}
    finally:
        black_hole.close()
        for n in nodes:
            n.stop()
    assert nodes[0].proc.returncode == 0 and nodes[2].proc.returncode == 0


def test_the_last_node_takes_fewer_layers_for_the_output_head():
    """The last window also runs the output head, whose bytes read per row are those of
    several layers (here 30 MiB against 10 MiB layers: 3 layers' work): equal nodes get equal
    work per lap, so the last gets 3 layers fewer, and the estimate counts the head."""
    nodes = [_prof(x, 1.0, free_mem=400 * _MIB) for x in "abc"]
    assert _MEM.head_layers() == pytest.approx(3.0)
    plan = plan_ring(12, 10 * _MIB, nodes, memory=_MEM, n_ctx=0)
    assert _counts(plan) == [5, 5, 2]  # 15 layers' work: 5 each, 3 of the last's the head
    assert plan.est_lap_ms == pytest.approx(15.0)
    # Without the memory model (no sizes known) the split is by layers alone.
    assert _counts(plan_ring(12, 10 * _MIB, nodes)) == [4, 4, 4]
    # The last node still holds a window of its own where the head alone outweighs its share.
    slow_last = [*nodes[:2], _prof("c", 4.0, free_mem=400 * _MIB)]
    assert _counts(plan_ring(12, 10 * _MIB, slow_last, memory=_MEM, n_ctx=0))[-1] == 1
