"""`edgespec serve --parallel S`: the server admits up to S requests at once (one per
slot of the ring), queues up to ``max_queue`` more in arrival order and answers 429 beyond,
frees a slot as soon as its client hangs up, and shows the slots in ``/health``, ``/v1/ring``
and `edgespec ring status`.

The gate is checked on its own (threads, no model). The rest runs a real uvicorn server in this
process over ``Ring.local`` (two node processes, the real Qwen2.5-Coder-0.5B, parallel=2) and
talks to it over real HTTP: concurrent streams hold both slots, a third request waits and a
fourth gets 429; a client that disconnects frees its slot for the waiting one while the other
stream still runs; greedy answers of concurrent requests equal the same requests served alone
(prompts without a near-tie in their first tokens, as in tests/test_server.py); usage carries
the time to first token.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

# --------------------------------------------------------------------- a served ring

PARALLEL = 2
MAX_QUEUE = 1
# A completion that keeps going (counting) for as long as it is allowed: it holds its slot.
LONG = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 400, "temperature": 0}
# Prompts whose greedy path has no near-tie in the first 8 tokens (tests/test_server.py).
COMPLETE = [
    "def add(a, b):\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "def factorial(n):\n    if n == 0:\n",
    "def fibonacci(n):\n    if n <= 1:\n        return n\n",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, port, ring): a real server over a 2-stage local ring with 2 slots."""
    import uvicorn

    from edgespec.api import Ring
    from edgespec.server.app import create_app

    ring = Ring.local("qwen2.5-coder-0.5b", stages=2, spec="none", n_ctx=2048,
                      parallel=PARALLEL)
    app = create_app(ring, "m", max_queue=MAX_QUEUE)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        for _ in range(600):
            if server.started:
                break
            threading.Event().wait(0.05)
        assert server.started
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", port, ring
    finally:
        app.state.shutdown()
        server.should_exit = True
        th.join(30)
        app.state.scheduler.wait_idle(30)
        ring.close()


def _post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return json.loads(r.read())


class _Stream:
    """A streaming completion over its own connection, read chunk by chunk."""

    def __init__(self, port: int, body: dict) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        self.conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200

    def next_text(self) -> str:
        """The next chunk with text (blocks until the generation produced one)."""
        while True:
            line = self.resp.readline()
            assert line, "stream ended"
            if line.startswith(b"data: {"):
                d = json.loads(line[6:])
                text = d["choices"][0]["text"]
                if text:
                    return text

    def finish(self) -> str:
        out = []
        for line in self.resp:
            if line.startswith(b"data: {"):
                out.append(json.loads(line[6:])["choices"][0]["text"])
        self.conn.close()
        return "".join(out)

    def hang_up(self) -> None:
        self.conn.sock.close()  # the client goes away mid-answer
        self.conn.close()


def _busy(health: dict) -> int:
    return sum(1 for s in health["slots"] if s["state"] == "busy")


def test_health_and_v1_ring_show_the_slots(served):
    url, _port, ring = served
    h = _health(url)
    assert h["parallel"] == PARALLEL == ring.parallel
    assert [s["slot"] for s in h["slots"]] == list(range(PARALLEL))
    for s in h["slots"]:
        assert {"state", "tokens", "tokens_per_s", "prompt_tokens", "history_tokens",
                "kv_parked"} <= set(s)
    with urllib.request.urlopen(url + "/v1/ring", timeout=60) as r:
        snap = json.loads(r.read())
    assert snap["parallel"] == PARALLEL and len(snap["slots"]) == PARALLEL


def test_two_streams_hold_both_slots_third_waits_fourth_gets_429(served):
    url, port, _ring = served
    a, b = _Stream(port, LONG), _Stream(port, LONG)
    try:
        a.next_text()
        b.next_text()  # both generating at once: two slots busy, nothing queued
        h = _health(url)
        assert h["serving"] == PARALLEL and h["queued"] == 0 and _busy(h) == PARALLEL
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_post, url, {"prompt": "def add(a, b):\n", "max_tokens": 4,
                                               "temperature": 0})
            for _ in range(600):  # until the server has queued it
                if _health(url)["queued"] == 1:
                    break
                threading.Event().wait(0.05)
            assert _health(url)["queued"] == 1
            status, body = _post(url, {"prompt": "x", "max_tokens": 2})
            assert status == 429
            assert body["error"]["code"] == "rate_limit_exceeded"
            assert set(body["error"]) == {"message", "type", "param", "code"}
            a.hang_up()  # frees its slot at once: the waiting request runs while b still does
            status, body = waiting.result(timeout=300)
            assert status == 200 and body["usage"]["completion_tokens"] == 4
            h = _health(url)
            assert _busy(h) == 1 and h["serving"] == 1  # b, still counting
    finally:
        b.hang_up()
    for _ in range(600):
        h = _health(url)
        if h["serving"] == 0 and _busy(h) == 0:
            break
        threading.Event().wait(0.05)
    assert h["serving"] == 0 and _busy(h) == 0 and h["abandoned"] >= 2 and h["rejected"] >= 1


def test_concurrent_answers_equal_answers_served_alone(served):
    url, _port, _ring = served

    def ask(p: str) -> tuple[int, dict]:
        return _post(url, {"prompt": p, "max_tokens": 8, "temperature": 0})

    alone = [ask(p) for p in COMPLETE]
    # Four at once through two slots (and a queue of one): each its own history.
    with ThreadPoolExecutor(len(COMPLETE)) as pool:
        together = []
        for i in range(0, len(COMPLETE), PARALLEL + MAX_QUEUE):
            together += list(pool.map(ask, COMPLETE[i:i + PARALLEL + MAX_QUEUE]))
    for (s1, b1), (s2, b2) in zip(alone, together, strict=True):
        assert s1 == s2 == 200, (b1, b2)
        assert b1["choices"][0]["text"] == b2["choices"][0]["text"]
        # The ring's own time to first token (request start to first token) in the usage.
        assert b2["usage"]["time_to_first_token_ms"] > 0


def test_ring_status_shows_the_slots_of_the_running_server(served, tmp_path, monkeypatch,
                                                           capsys):
    from edgespec.cli import main
    from edgespec.cli.served import running_server, serve_record

    url, port, _ring = served
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))  # no ring is up here: the server's own
    # main() points the root logger at this test's captured stderr: put it back afterwards,
    # or later tests' log records go to a closed stream.
    root, ours = logging.getLogger(), logging.getLogger("edgespec")
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setattr(ours, "level", ours.level)
    assert running_server() is None
    with serve_record("127.0.0.1", port):
        assert running_server() == url
        assert main(["ring", "status"]) == 0
        out = capsys.readouterr().out
        assert f"slots (edgespec serve at {url}): {PARALLEL}" in out
        assert out.count(" free ") + out.count(" busy ") >= PARALLEL
        # Where each slot's history is: parked between turns, live, or none.
        assert sum(out.count(f" {kv}\n") for kv in ("parked", "live", "-")) == PARALLEL
        assert main(["ring", "status", "--json"]) == 0
        view = json.loads(capsys.readouterr().out)
        assert view["parallel"] == PARALLEL and len(view["slots"]) == PARALLEL
    assert running_server() is None  # the record goes with the server


def test_stop_sequence_and_max_tokens_free_the_slot_as_the_answer_ends(served):
    url, _port, _ring = served
    # The ring releases the slot before the answer is handed over: once the reply is here,
    # every slot is free again.
    status, body = _post(url, {**LONG, "stop": [" 13,"]})
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert "13" not in body["choices"][0]["text"] and body["usage"]["completion_tokens"] < 40
    assert _busy(_health(url)) == 0
    status, body = _post(url, {**LONG, "max_tokens": 3})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert _busy(_health(url)) == 0
