"""Operating a ring that `edgespec serve` holds, as a user does from another terminal, with real
`edgespec node` processes on loopback and a tiny float32 model:

- `serve` says what it serves when ready (model, ring, the page's URL);
- `ring down` is refused with one line naming the server, and the saved state stays;
- a node lost and restarted: /health says degraded, `ring rebalance` goes through the server
  and takes the node back, and answers stay the same;
- `ring rebalance --take-over` takes the ring on purpose: the server reports down and does not
  take the nodes back.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from test_lifecycle import _cli, _env, _free_port, _ring_up, key_file, three, tiny  # noqa: F401
from test_node import REPO, NodeProc

from edgespec.head.state import state_path


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _complete(base: str) -> tuple[int, dict]:
    req = urllib.request.Request(base + "/v1/completions", json.dumps(
        {"prompt": "one two three", "max_tokens": 6, "temperature": 0}).encode(),
        {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health_until(base: str, want: str, timeout: float = 40.0) -> tuple[int, dict]:
    deadline = time.monotonic() + timeout
    while True:
        status, body = _get(base + "/health")
        if body.get("status") == want or time.monotonic() > deadline:
            return status, body
        time.sleep(0.5)


def test_a_ring_held_by_serve_is_operated_through_it(tiny, key_file, three, tmp_path,  # noqa: F811
                                                     monkeypatch):
    home = tmp_path / "head"
    home.mkdir()
    monkeypatch.setenv("EDGESPEC_HOME", str(home))
    _ring_up(tiny, key_file, home, three)
    port = _free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", "--port",
                                  str(port), "--spec", "none"], stdout=log,
                                 stderr=subprocess.STDOUT, env=_env(home), cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while "page: http" not in log_path.read_text():
            assert serve.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        text = log_path.read_text()
        # Ready: the model, the ring (3 stages on the 3 nodes) and where to go.
        assert re.search(r"edgespec serve: model \S+", text), text
        assert "ring: 3 stage(s)" in text and all(n.name in text for n in three), text
        assert f"page: {base}/" in text, text
        status, first = _complete(base)
        assert status == 200, first

        # `ring down` while the server holds the ring: refused, nothing changed.
        res = _cli(["ring", "down", "--key-file", str(key_file)], home)
        assert res.returncode == 1, res.stdout + res.stderr
        err = res.stderr.strip().splitlines()
        assert len(err) == 1 and "edgespec serve" in err[0] and "held by" in err[0], res.stderr
        assert state_path().exists()
        assert _complete(base)[1]["choices"][0]["text"] == first["choices"][0]["text"]

        # A node dies: the next request re-plans over the other two; /health says degraded.
        victim_port = three[2].address[1]
        three[2].proc.kill()
        three[2].proc.wait(10)
        status, body = _complete(base)
        assert status == 200, body
        status, health = _health_until(base, "degraded")
        assert status == 200 and health["status"] == "degraded", health
        # It comes back; `ring rebalance` goes through the server and takes it back.
        three[2] = NodeProc("s2", key_file, tmp_path, port=victim_port)
        res = _cli(["ring", "rebalance", "--key-file", str(key_file), "--no-profile"], home,
                   timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "rebalancing through it" in res.stdout and "3 stage(s)" in res.stdout, res.stdout
        status, health = _health_until(base, "ok")
        assert status == 200 and health["status"] == "ok", health
        status, again = _complete(base)
        assert status == 200 and again["choices"][0]["text"] == first["choices"][0]["text"]
        status, ring = _get(base + "/v1/ring")
        assert len(ring["stages"]) == 3

        # Taken on purpose: the server reports down and leaves the nodes to the taker.
        res = _cli(["ring", "rebalance", "--key-file", str(key_file), "--no-profile",
                    "--take-over"], home, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        status, body = _complete(base)
        assert status == 503 and "taken over" in body["error"]["message"], body
        status, health = _health_until(base, "down")
        assert status == 503 and "taken over" in health.get("message", ""), health
        time.sleep(3)
        status, body = _complete(base)
        assert status == 503, body
        res = _cli(["ring", "status", "--key-file", str(key_file)], home)
        assert res.returncode == 0 and "no head attached" in res.stdout, res.stdout
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                serve.kill()
