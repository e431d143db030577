"""The web page of `edgespec serve`, driven in a real headless chromium (Playwright for Python
driving Debian's chromium) against `edgespec serve --local 2 --api-key ...` on the real
Qwen2.5-Coder-0.5B.

Checked: without the key every endpoint answers 401 (the page, its files, its live stream,
the API, /health), the page asks for the key and then works; a message gets a streamed
answer; the ring view lists both nodes with their layer windows; the token tree view
updates while the answer streams; Stop ends an answer midway (the server stops that
generation); and after a node is killed the page says the ring is down, how to bring it
back, and once the next request has re-planned the ring it shows the new plan.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import time
from pathlib import Path

import pytest
from proc_helpers import alive
from test_server import ServerProcess, http

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"Debian's chromium is not installed ({CHROMIUM}): `apt-get install chromium` "
                "(.ci/run installs it)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.real_model

KEY = "k-" + secrets.token_hex(12)
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("serve-web"), api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    """The page, logged in through its own key form."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # The page works under its own Content-Security-Policy: any violation is an error.
    pg.on("console", lambda m: errors.append(m.text)
          if "Content Security Policy" in m.text else None)
    resp = pg.goto(server.base + "/")
    assert resp.status == 401  # no key yet: the key form
    pg.fill("input[type=password]", KEY)
    pg.click("button")
    pg.wait_for_selector("#ring g[data-stage]", timeout=60_000)
    yield pg
    ctx.close()
    assert not errors, errors
    # The page is gone: its live stream ends and the engine's listener with it.
    if server.proc.poll() is None:
        deadline = time.monotonic() + 30
        while http("GET", server.base + "/health", key=KEY)[1]["viewers"] and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert http("GET", server.base + "/health", key=KEY)[1]["viewers"] == 0


def wait_js(page, expression: str, timeout: float = 30_000) -> None:
    """Wait until ``expression`` is true in the page. Polled from here: Playwright's own
    wait_for_function builds its predicate with eval, which the page's CSP forbids."""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true within {timeout / 1000:g} s: {expression}"
        time.sleep(0.1)


def _raw_status(base: str, method: str, path: str, headers: dict[str, str]) -> int:
    """The status line only (the live stream never ends by itself)."""
    host, port = base.split("//")[1].split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 2\r\n"
                     f"Content-Type: application/json\r\n{head}\r\n{{}}".encode())
        line = b""
        while b"\r\n" not in line:
            part = sock.recv(4096)
            if not part:
                break
            line += part
    return int(line.split()[1])


ENDPOINTS = [("GET", "/"), ("GET", "/web/app.js"), ("GET", "/web/style.css"),
             ("GET", "/v1/ring"), ("GET", "/v1/ring/events"), ("GET", "/v1/models"),
             ("GET", "/health"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("GET", "/nowhere")]


def test_every_endpoint_needs_the_key(server):
    for method, path in ENDPOINTS:
        for headers in ({}, {"Authorization": "Bearer wrong"},
                        {"Cookie": "edgespec_key=wrong"}, {"Authorization": KEY}):
            assert _raw_status(server.base, method, path, headers) == 401, (method, path,
                                                                            headers)
    status, body = http("GET", server.base + "/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    # With the key (bearer, or the page's cookie) the same endpoints answer.
    for method, path in ENDPOINTS[:7]:
        assert _raw_status(server.base, method, path, {"Authorization": f"Bearer {KEY}"}) \
            == 200, path
        assert _raw_status(server.base, method, path, {"Cookie": f"edgespec_key={KEY}"}) \
            == 200, path
    r = server.client().chat.completions.create(
        model="qwen2.5-coder-0.5b", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": "What is 2 + 3? Answer with the number only."}])
    assert r.choices[0].message.content == "5"


def _ring(server) -> dict:
    status, ring = http("GET", server.base + "/v1/ring", key=KEY)
    assert status == 200, ring
    return ring


def _watch_answer(page, timeout: float = 300.0) -> dict:
    """Poll the page while the last answer streams: the text lengths and tree-view updates
    seen before it was done."""
    seen_lengths: set[int] = set()
    seen_updates: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = page.evaluate("""() => {
            const m = [...document.querySelectorAll('.msg.assistant')].pop();
            return {streaming: !!m && m.classList.contains('streaming'),
                    done: !!m && m.classList.contains('done'),
                    length: m ? m.querySelector('.body').textContent.length : 0,
                    updates: document.getElementById('tree').dataset.updates || '0'};
        }""")
        if state["done"]:
            return {"lengths": seen_lengths, "updates": seen_updates}
        if state["streaming"]:
            if state["length"]:
                seen_lengths.add(state["length"])
            seen_updates.add(state["updates"])
        time.sleep(0.05)
    raise AssertionError("the answer never finished")


def test_chat_streams_an_answer_and_the_ring_and_tree_views_follow(page, server):
    ring = _ring(server)
    assert [s["layers"] for s in ring["stages"]] == [[0, 12], [12, 24]]
    # The ring view: both nodes in ring order, with their windows and devices.
    stages = page.locator("#ring g[data-stage]")
    assert stages.count() == 2
    for i, st in enumerate(ring["stages"]):
        text = stages.nth(i).text_content()
        a, b = st["layers"]
        assert f"stage {i} · layers {a}–{b - 1}" in text and st["node"] in text
        assert "CPU" in text
    assert "ring up" in page.text_content("#ring-state")

    page.select_option("#spec", "flow")
    page.fill("#input", "Write a Python function that returns the n-th Fibonacci number.")
    page.press("#input", "Enter")
    seen = _watch_answer(page)
    answer = page.locator(".msg.assistant .body").last
    assert "def " in answer.text_content() and answer.locator("pre code").count() >= 1
    assert "finish:" in page.locator(".msg.assistant .meta").last.text_content()
    # Streamed: the text grew in steps the page showed while the answer was under way.
    assert len(seen["lengths"]) >= 3, seen
    # The tree view redrew during the answer (FlowSpec rows as they were verified).
    assert len(seen["updates"]) >= 3, seen
    wait_js(page, "document.querySelectorAll('#tree g.t-accepted, #tree g.t-rejected,"
                           " #tree g.t-bonus').length > 0")
    # The session charts picked up the generation.
    history = _ring(server)["history"]
    wait_js(page, f"document.querySelectorAll('#chart-ttft rect.bar').length === "
                           f"{len(history)}")  # one bar per generation of the session
    gen = history[-1]
    assert gen["mode"] == "flow" and gen["tokens"] > 0 and gen["ttft_ms"] > 0
    # The ring's arrows carry the last answer's per-link transfer times (lap timing).
    wait_js(page, "document.querySelectorAll('#ring text.link-ms').length === 2",
                           timeout=30_000)
    assert " ms" in page.locator("#ring text.link-ms").first.text_content()


def test_stop_ends_an_answer_midway(page, server):
    _, before = http("GET", server.base + "/health", key=KEY)
    page.fill("#input", "Count from 1 to 400, separated by commas.")
    page.press("#input", "Enter")
    wait_js(page, """(() => {
        const m = [...document.querySelectorAll('.msg.assistant')].pop();
        return m && m.querySelector('.body').textContent.length > 20; })()""", timeout=300_000)
    page.click("#stop")
    page.wait_for_selector(".msg.assistant.done")
    assert page.locator(".msg.assistant .meta").last.text_content() == "stopped"
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    # The server stopped that generation (it asked for 1024 tokens): the ring is free.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        _, health = http("GET", server.base + "/health", key=KEY)
        if health["serving"] == 0 and health["abandoned"] > before["abandoned"]:
            break
        time.sleep(0.1)
    assert health["abandoned"] == before["abandoned"] + 1 and health["serving"] == 0
    assert health["completed"] == before["completed"]


def test_ring_down_then_the_new_plan_after_recovery(page, server):
    """Runs last: it kills a node of the module's ring."""
    page.click("#new-chat")
    victim = server.nodes[-1]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while alive(victim) and time.monotonic() < deadline:
        time.sleep(0.1)
    page.wait_for_selector("#down:not([hidden])", timeout=60_000)
    banner = page.text_content("#down")
    assert "The ring is down" in banner and "lost node" in banner
    # A local ring's nodes are the server's own processes: the way back is a restart of the
    # server (or the next request, over the node still running), not `ring rebalance`.
    assert "--local 2" in banner and "next request" in banner and "rebalance" not in banner
    assert "ring down" in page.text_content("#ring-state")

    page.fill("#input", "What is 2 + 3? Answer with the number only.")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant.done", timeout=300_000)
    assert page.locator(".msg.assistant .body").last.text_content().strip() == "5"
    # The new plan: one node holds every layer; the page says a recovery happened.
    wait_js(page, "document.querySelectorAll('#ring g[data-stage]').length === 1",
                           timeout=60_000)
    assert "layers 0–23" in page.text_content("#ring g[data-stage]")
    assert "recovered 1×" in page.text_content("#ring-note")
    assert page.is_hidden("#down")
    assert [s["layers"] for s in _ring(server)["stages"]] == [[0, 24]]
    _, health = http("GET", server.base + "/health", key=KEY)
    assert health["viewers"] == 1 and health["recoveries"] == 1
    # SIGTERM with the page open: its live stream ends and the server exits cleanly.
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()
