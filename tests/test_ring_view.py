"""One view of the ring (docs/design.md 5.3): `edgespec ring status --json`, run without a
head, and `GET /v1/ring` of a server holding the same ring show the same thing. A ring of two
real `edgespec node` processes on loopback is brought up with `edgespec ring up`, attached by a
Python head, served through the server's app, and asked both ways."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient
from tinygguf import make_tiny_gguf

from edgespec.api import Ring
from edgespec.errors import RingError
from edgespec.head.local import LocalNodes
from edgespec.head.state import load_state
from edgespec.server.app import create_app
from edgespec.wire.auth import write_key


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec", *args], capture_output=True,
                          text=True, timeout=300)


def test_ring_status_json_and_v1_ring_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    monkeypatch.delenv("EDGESPEC_KEY_FILE", raising=False)
    model = make_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", n_layer=4, n_embd=64, seed=5)
    key = write_key(tmp_path / "ring.key")
    nodes = LocalNodes(2, key)
    try:
        spec = ",".join(f"{h}:{p}" for h, p in nodes.addresses)
        up = _cli(["ring", "up", "--model", str(model), "--nodes", spec, "--no-profile",
                   "--ctx", "512", "--key-file", str(key)])
        assert up.returncode == 0, up.stdout + up.stderr
        state = load_state()
        assert [n.address for n in state.nodes] == nodes.addresses

        with Ring.attach(key=str(key), spec="none") as ring:
            served = TestClient(create_app(ring, "tiny")).get("/v1/ring").json()
            res = _cli(["ring", "status", "--json", "--key-file", str(key)])
            assert res.returncode == 0, res.stdout + res.stderr
            status = json.loads(res.stdout)
    finally:
        nodes.close()

    # Same shape: what `ring status` shows is what the server shows (which adds its queue,
    # generation records and per-batch times).
    assert set(status) <= set(served), set(status) - set(served)
    for a, b in zip(status["stages"], served["stages"], strict=True):
        assert set(a) <= set(b), set(a) - set(b)
    assert [set(n) for n in status["nodes"]] == [set(n) for n in served["nodes"]]
    # Same content, as far as it does not move between two probes (memory, round trips).
    assert status["model"] == served["model"] == "tiny"
    assert status["n_ctx"] == served["n_ctx"] == 512
    # The tiny ring has room for every sequence: nothing gave way.
    assert status["sequences"] == served["sequences"] == state.n_seq_max == 256
    assert status["status"] == served["status"] == "up"
    keep = ("stage", "layers", "node", "address", "alive", "backend")
    assert [{k: s[k] for k in keep} for s in status["stages"]] == \
        [{k: s[k] for k in keep} for s in served["stages"]]
    # Two windows covering the 4 layers (the planner gives the last fewer: it runs the head).
    (a, b), (c, d) = [s["layers"] for s in served["stages"]]
    assert a == 0 and b == c and d == 4 and b - a >= d - c, served["stages"]
    assert [s["address"] for s in served["stages"]] == [f"{h}:{p}" for h, p in nodes.addresses]
    keep = ("name", "address", "plan", "held", "state", "left", "holder", "node_id")
    assert [{k: n[k] for k in keep} for n in status["nodes"]] == \
        [{k: n[k] for k in keep} for n in served["nodes"]]
    assert [n["state"] for n in served["nodes"]] == ["loaded", "loaded"]
    # The attached head holds the ring: both views name it.
    assert all(n["holder"] and n["holder"]["what"] for n in served["nodes"])
    # Only the head knows its mode; without one the field is there, empty.
    assert served["spec"] == "none" and status["spec"] is None



OLD_STATE = {  # as `edgespec ring up` wrote it before the state was typed
    "model": "/models/qwen2.5-coder-1.5b.gguf", "created": 1764600000.5,
    "nodes": [{"name": "desk", "host": "192.168.1.20", "port": 7821},
              {"name": "laptop", "host": "192.168.1.31", "port": 7821}],
    "plan": {"n_layer": 28, "est_lap_ms": 41.5, "windows": [[0, 0, 0, 16], [1, 1, 16, 28]]},
    "left": [{"name": "jetson", "host": "192.168.1.40", "port": 7821, "since": 1764500000.0,
              "reason": "lost: node jetson stopped answering"}],
    "encoding": "f16", "n_ctx": 2048, "key_file": None}


def test_state_file_written_before_still_loads(tmp_path):
    path = tmp_path / "ring.json"
    path.write_text(json.dumps(OLD_STATE, indent=2))
    st = load_state(path)
    assert [(n.name, n.address) for n in st.nodes] == [("desk", ("192.168.1.20", 7821)),
                                                      ("laptop", ("192.168.1.31", 7821))]
    assert [(w.stage, w.node, w.start, w.stop) for w in st.windows] == [(0, 0, 0, 16),
                                                                        (1, 1, 16, 28)]
    assert (st.encoding, st.n_ctx, st.key_file, st.n_layer) == ("f16", 2048, None, 28)
    assert st.named_nodes()[-1] == ("jetson", ("192.168.1.40", 7821))
    assert st.left[0].reason == "lost: node jetson stopped answering"
    # Written back in the same format, with the sequences the ring holds (256 before the
    # plan could choose fewer).
    assert st.to_dict() == {**OLD_STATE, "n_seq_max": 256}
    path.write_text(json.dumps({**OLD_STATE, "n_seq_max": 64}))
    assert load_state(path).n_seq_max == 64
    # The oldest files have no `left`, `encoding`, `n_ctx` or `key_file`: defaults.
    bare = {k: OLD_STATE[k] for k in ("model", "nodes", "plan")}
    path.write_text(json.dumps(bare))
    st = load_state(path)
    assert (st.left, st.encoding, st.n_ctx, st.key_file, st.n_seq_max) == (
        [], "f32", 4096, None, 256)


@pytest.mark.parametrize("broken, says", [
    ({"nodes": [{"host": "a", "port": "7821"}]}, "nodes[0]: field 'port' must be an integer"),
    ({"plan": {"n_layer": 28, "windows": [[0, 5, 0, 28]]}}, "names node 5 of 2"),
    ({"plan": {"windows": []}}, "plan: missing field 'n_layer'"),
    ({"model": None}, "field 'model' must be text, got None"),
    ({"n_ctx": True}, "field 'n_ctx' must be an integer"),
])
def test_malformed_state_is_one_clear_error_naming_the_file(tmp_path, broken, says):
    path = tmp_path / "ring.json"
    path.write_text(json.dumps({**OLD_STATE, **broken}))
    with pytest.raises(RingError) as e:
        load_state(path)
    assert says in str(e.value) and str(path) in str(e.value)
    assert "edgespec ring up" in str(e.value)
