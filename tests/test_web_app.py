"""The server app without a browser or the real model: the ASGI app of `edgespec serve`
(FastAPI's TestClient drives it in-process) over a real in-process ring of a tiny float32
model. Checks what the page and API clients rely on: the key on every endpoint, the page's
files, /v1/ring's snapshot and generation records, a speculative mode the ring cannot
run refused as the caller's mistake, and unimplemented fields and endpoints refused in
OpenAI's error shape."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from tinygguf import make_tiny_gguf

from edgespec.api import Ring
from edgespec.server.app import create_app


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    target = make_tiny_gguf(tmp_path_factory.mktemp("app") / "tiny.gguf", "qwen2", n_layer=4,
                            n_embd=64, seed=3)
    with Ring.local(target, stages=2, processes=False, n_ctx=512) as r:
        yield r


PATHS = ["/", "/web/app.js", "/web/markdown.js", "/web/style.css", "/v1/ring", "/v1/models",
         "/health"]


def test_page_files_and_ring_snapshot(base):
    client = TestClient(create_app(base, "tiny"))
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("app.js", "markdown.js", "style.css"):
        assert f"web/{name}" in page.text
        assert client.get(f"/web/{name}").status_code == 200
    assert client.get("/web/../server.py").status_code == 404
    assert client.get("/web/nothing.js").json()["error"]["type"] == "invalid_request_error"

    snap = client.get("/v1/ring").json()
    assert snap["status"] == "up" and snap["model"] == "tiny"
    assert [s["layers"] for s in snap["stages"]] == [[0, 2], [2, 4]]
    assert snap["history"] == [] and snap["serving"] == 0
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5,
                                             "temperature": 0, "spec": "sync"})
    assert r.status_code == 200, r.text
    gen = client.get("/v1/ring").json()["history"][-1]
    assert gen["mode"] == "sync" and gen["tokens"] == r.json()["usage"]["completion_tokens"]
    assert gen["ttft_ms"] > 0 and gen["tokens_per_lap"] > 0 and gen["kind"] == "completion"
    # The ring's links and stages as the last answer timed them (what the page labels the
    # ring's arrows with): one entry per stage, one per link of the lap, head to head.
    assert snap["lap_timing"] is None  # no answer yet when the first snapshot was taken
    deadline = time.monotonic() + 10  # snapshots are reused for a moment (live.SNAPSHOT_S)
    while (lap := client.get("/v1/ring").json()["lap_timing"]) is None:
        assert time.monotonic() < deadline, "no lap timing in /v1/ring after an answer"
        time.sleep(0.2)
    assert [s["stage"] for s in lap["stages"]] == [0, 1]
    assert [(x["from"], x["to"]) for x in lap["links"]] == [("head", 0), (0, 1), (1, "head")]
    assert all(x["transfer_ms"] >= 0 for x in lap["links"]) and lap["laps"] > 0


def test_a_mode_the_ring_cannot_run_is_the_callers_400(base):
    no_drafter = Ring(base.chain, base.tokenizer, model_name="tiny")
    client = TestClient(create_app(no_drafter, "tiny"))
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3,
                                             "spec": "flow"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "spec" and "drafter" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3,
                                                "spec": "none"}).status_code == 200
    # The page's menu offers what this ring runs (the one registry, less the tree modes
    # without a drafter); the ring with a drafter offers every mode.
    assert client.get("/v1/ring").json()["modes"] == ["auto", "none"]
    assert TestClient(create_app(base, "tiny")).get("/v1/ring").json()["modes"] == [
        "auto", "none", "sync", "flow"]


def test_unimplemented_fields_and_endpoints_are_refused_in_openais_shape(base):
    """A field or endpoint the server does not implement is an OpenAI error naming it; the
    neutral values clients send by default are served."""
    client = TestClient(create_app(base, "tiny"))
    hi = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": hi, "n": 2})
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {
        "message": "'n' is not supported by this server: send 1 or leave it out",
        "type": "invalid_request_error", "param": "n",
        "code": "unsupported_parameter"}}
    r = client.post("/v1/completions", json={"prompt": "hello", "dry_multiplier": 0.8})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": "unknown field 'dry_multiplier': not supported by this server",
                                 "type": "invalid_request_error", "param": "dry_multiplier",
                                 "code": "unknown_parameter"}
    r = client.post("/v1/chat/completions", json={
        "messages": hi, "max_tokens": 2, "n": 1, "frequency_penalty": 0, "presence_penalty": 0,
        "logit_bias": {}, "logprobs": False, "tool_choice": "none",
        "response_format": {"type": "text"}, "user": "u"})
    assert r.status_code == 200, r.text
    for method, path in [("POST", "/v1/embeddings"), ("POST", "/v1/images/generations"),
                         ("POST", "/v1/audio/transcriptions"), ("GET", "/v1/files"),
                         ("POST", "/v1/batches"), ("GET", "/v1/models/tiny")]:
        r = client.request(method, path, json={"input": "x"})
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_endpoint"
        assert err["message"].startswith(f"{method} {path} is not supported by this server")
    # Routes that exist keep their own answers.
    assert client.get("/web/nothing.js").json()["error"]["message"] == "no such file: nothing.js"
    assert client.get("/v1/chat/completions").status_code == 405


def test_api_key_on_every_endpoint(base):
    key = "s3cret-key"
    client = TestClient(create_app(base, "tiny", api_key=key))
    for path in PATHS + ["/v1/ring/events", "/nowhere"]:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": key},
                        {"Cookie": "edgespec_key=nope"}):
            r = client.get(path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # The page without the key: a form asking for it (and nothing of the ring).
    login = client.get("/")
    assert "password" in login.text and "tiny" not in login.text
    for path in PATHS:
        assert client.get(path, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert client.get(path, headers={"Cookie": f"edgespec_key={key}"}).status_code == 200
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
