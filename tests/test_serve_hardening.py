"""`edgespec serve`'s listener and self-report against strangers and monitors, over real HTTP:
uvicorn with the server's own settings (``server_config``) in this process, over a real
in-process ring of a tiny float32 model (and a local ring of node processes for /health).

- slowloris: connections that dribble their headers never keep a request out, and are
  dropped at the read deadline;
- DNS rebinding / cross-site: a Host the server is not bound for is refused, a JSON endpoint
  refuses a body that is not JSON (415), the page carries a CSP with frame-ancestors 'none';
- the live view's viewer cap holds for a burst of pages opened at once;
- /metrics in Prometheus' format (behind the key when one is set);
- max_tokens beyond the context left is capped, not refused;
- a generation cut by a shutdown says so (error event, no [DONE]; 503 when not streaming);
- /health tells ok / degraded / down (200 / 200 / 503) as node processes die.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tinygguf import make_tiny_gguf

from edgespec.api import Ring
from edgespec.server.app import create_app, server_config
from edgespec.server.listener import MAX_READING_PER_SOURCE, allowed_hosts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("harden") / "tiny.gguf", "qwen2", n_layer=4,
                          n_embd=64, seed=5)


@pytest.fixture(scope="module")
def ring(tiny):
    with Ring.local(tiny, stages=2, processes=False, n_ctx=512, spec="none") as r:
        yield r


class Served:
    """A uvicorn server with `serve`'s settings over ``app``, in a thread of this process."""

    def __init__(self, app, read_timeout: float = 15.0, hosts=None) -> None:
        import uvicorn

        self.app = app
        self.server = uvicorn.Server(server_config(app, "127.0.0.1", 0,
                                                   read_timeout=read_timeout,
                                                   log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict | None = None, timeout: float = 30) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def close(self) -> None:
        self.app.state.shutdown()
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture
def served(ring):
    srv = Served(create_app(ring, "tiny", hosts=allowed_hosts("127.0.0.1", ["ring.lan"])),
                 read_timeout=3.0)
    yield srv
    srv.close()


JSON = {"Content-Type": "application/json"}


def _complete(srv: Served, **body) -> tuple[int, dict]:
    status, _h, raw = srv.request("POST", "/v1/completions",
                                  json.dumps({"prompt": "hello", **body}).encode(), JSON)
    return status, json.loads(raw)


# ------------------------------------------------------------------------------ slowloris

def _dribbler(port: int, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    return s


def test_slow_header_connections_never_keep_a_request_out(served):
    attackers = [_dribbler(served.port, f"127.0.0.{2 + i % 2}") for i in range(80)]
    stop = threading.Event()

    def dribble() -> None:  # one more header line per connection every 0.5 s
        while not stop.wait(0.5):
            for s in attackers:
                try:
                    s.sendall(b"X-a: b\r\n")
                except OSError:
                    pass

    th = threading.Thread(target=dribble, daemon=True)
    th.start()
    try:
        statuses = []
        for _ in range(20):  # from 127.0.0.1: another source than the crowd
            status, _h, body = served.request("GET", "/health", timeout=5)
            statuses.append(status)
        assert statuses == [200] * 20, statuses
        # Also from the crowd's own address: the newcomer pushes out the oldest dribbler.
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.connect(("127.0.0.1", served.port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        s.settimeout(5)
        assert s.recv(100).startswith(b"HTTP/1.1 200")
        s.close()
        # The read deadline (3 s here) ends every dribbler: 408, then closed.
        time.sleep(3.5)
        ended = 0
        for a in attackers:
            a.settimeout(2)
            try:
                data = a.recv(4096)
                ended += data == b"" or data.startswith(b"HTTP/1.1 408")
            except (ConnectionResetError, BrokenPipeError):
                ended += 1
            except TimeoutError:
                pass
        assert ended == len(attackers)
        guard = served.app.state.read_guard
        assert guard.evicted + guard.timed_out >= len(attackers)
    finally:
        stop.set()
        th.join(5)
        for a in attackers:
            a.close()


def test_a_body_sent_too_slowly_is_dropped_and_the_server_serves_on(served):
    s = socket.create_connection(("127.0.0.1", served.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
              b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
    s.settimeout(10)
    t0 = time.monotonic()
    try:
        closed = s.recv(4096) == b""  # the app never answers: the connection just ends
    except ConnectionResetError:
        closed = True
    assert closed and time.monotonic() - t0 < 6  # the read deadline is 3 s here
    s.close()
    status, body = _complete(served, max_tokens=2)
    assert status == 200, body


# ------------------------------------------------------------------- hosts and bodies

def test_a_foreign_host_is_refused_and_learns_nothing(served):
    status, _h, raw = served.request("GET", "/v1/ring", headers={"Host": "attacker.example"})
    assert status == 400
    body = json.loads(raw)
    assert body["error"]["code"] == "host_not_allowed" and "--allow-host" in body["error"]["message"]
    assert b"stages" not in raw
    for host in ("127.0.0.1", f"127.0.0.1:{served.port}", "localhost", "ring.lan:80"):
        status, _h, _raw = served.request("GET", "/v1/ring", headers={"Host": host})
        assert status == 200, host


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", None])
def test_json_endpoints_refuse_bodies_that_are_not_json(served, kind):
    headers = {"Content-Type": kind} if kind else {}
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, _h, raw = served.request("POST", path, body, headers)
        assert status == 415, (path, raw)
        assert json.loads(raw)["error"]["code"] == "unsupported_media_type"
    status, body = _complete(served, max_tokens=2)
    assert status == 200


def test_the_page_forbids_framing_and_foreign_scripts(served):
    status, headers, _ = served.request("GET", "/")
    assert status == 200
    csp = headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
    assert headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff"


def test_viewer_cap_holds_for_pages_opened_at_once(served):
    def open_view(_: int):
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
        conn.request("GET", "/v1/ring/events")
        return conn, conn.getresponse()

    # At most as many opening at once as the listener lets one source have still reading
    # (MAX_READING_PER_SOURCE): past that it drops the oldest of them, a reset that has
    # nothing to do with the viewer cap.
    with ThreadPoolExecutor(MAX_READING_PER_SOURCE) as pool:
        opened = list(pool.map(open_view, range(20)))
    try:
        ok = [r for _c, r in opened if r.status == 200]
        refused = [r for _c, r in opened if r.status == 503]
        assert len(ok) == served.app.state.live.MAX_VIEWERS, [r.status for _c, r in opened]
        assert len(refused) == 20 - len(ok)
    finally:
        for c, _r in opened:
            c.close()


# --------------------------------------------------------------- limits and metrics

def test_max_tokens_beyond_the_context_is_capped(served, ring):
    status, body = _complete(served, max_tokens=100_000, ignore_eos=True)
    assert status == 200, body
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == ring.n_ctx
    assert body["choices"][0]["finish_reason"] == "length"


def test_metrics_count_requests_tokens_and_latency(served):
    status, body = _complete(served, max_tokens=4, ignore_eos=True)
    assert status == 200
    status, headers, raw = served.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = raw.decode()
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
             if ln and not ln.startswith("#")}
    assert lines['edgespec_requests_total{endpoint="completion",outcome="completed"}'] >= 1
    assert lines['edgespec_tokens_total{kind="completion"}'] >= 4
    assert lines["edgespec_time_to_first_token_seconds_count"] >= 1
    assert lines["edgespec_time_per_output_token_seconds_count"] >= 1
    assert lines["edgespec_queue_depth"] == 0
    assert lines['edgespec_ring_status{status="ok"}'] == 1
    assert any(k.startswith("edgespec_stage_compute_seconds_total{") for k in lines)


def test_metrics_need_the_key_when_one_is_set(ring):
    srv = Served(create_app(ring, "tiny", api_key="s3cret"))
    try:
        assert srv.request("GET", "/metrics")[0] == 401
        status, _h, raw = srv.request("GET", "/metrics",
                                      headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and b"edgespec_requests_total" in raw
    finally:
        srv.close()


def test_an_answer_cut_by_shutdown_says_so(tiny):
    with Ring.local(tiny, stages=2, processes=False, n_ctx=4096, spec="none") as r:
        srv = Served(create_app(r, "tiny"))
        try:
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
            conn.request("POST", "/v1/completions", json.dumps(
                {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True,
                 "stream": True}), JSON)
            resp = conn.getresponse()
            assert resp.status == 200
            first = resp.readline()
            assert first.startswith(b"data: {")
            srv.app.state.shutdown()  # what SIGINT / SIGTERM do
            rest = resp.read().decode()
            events = [json.loads(ln[6:]) for ln in rest.splitlines()
                      if ln.startswith("data: {")]
            assert events and events[-1]["error"]["code"] == "shutting_down", rest[-500:]
            assert "[DONE]" not in rest
            assert all(e.get("choices", [{}])[0].get("finish_reason") is None
                       for e in events[:-1])
        finally:
            srv.close()


# ------------------------------------------------------------------------------ health

def _health_until(client, want: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        r = client.get("/health")
        if r.json()["status"] == want or time.monotonic() > deadline:
            return r
        time.sleep(0.5)


def test_health_tells_ok_degraded_and_down_as_nodes_die(tiny):
    from fastapi.testclient import TestClient

    with Ring.local(tiny, stages=2, n_ctx=256, spec="none") as r, \
            TestClient(create_app(r, "tiny")) as client:  # runs the app's health monitor
        r1 = _health_until(client, "ok")
        assert r1.status_code == 200 and r1.json()["status"] == "ok"
        procs = r.local_nodes.procs
        procs[1].kill()
        procs[1].wait(10)
        r2 = _health_until(client, "degraded")
        assert r2.status_code == 200 and r2.json()["status"] == "degraded", r2.json()
        procs[0].kill()
        procs[0].wait(10)
        r3 = _health_until(client, "down")
        assert r3.status_code == 503 and r3.json()["status"] == "down", r3.json()
        view = client.get("/v1/ring").json()
        assert view["status"] == "down"
        # A local ring's nodes are the server's own processes: the hint says to restart
        # the server, not to start `edgespec node` and rebalance.
        assert "--local 2" in view["hint"] and "rebalance" not in view["hint"], view
        assert "next request" not in view["hint"], view  # no node process is left
        assert "Broken pipe" not in view["message"], view
        metrics = client.get("/metrics").text
        assert 'edgespec_ring_status{status="down"} 1.0' in metrics


def test_hosts_allowed_for_a_wildcard_bind_are_this_machines_own():
    hosts = allowed_hosts("0.0.0.0", ["Ring.LAN"])
    assert {"localhost", "127.0.0.1", "::1", socket.gethostname().lower(), "ring.lan"} <= hosts
    assert "attacker.example" not in hosts and "" not in hosts
    only = allowed_hosts("192.168.7.9")
    assert "192.168.7.9" in only and socket.gethostname().lower() not in only
