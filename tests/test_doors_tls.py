"""HTTPS on `edgespec serve` and what every door shares: the self-signed certificate (made
once, kept, made anew when it lacks a name), curl and the clients trusting it through its
file, a client without it refused by TLS at once (not by a timeout), the chat's server
backend with ``--ca-file``, and /health, /metrics and the page's live records counting every
door's requests alike (``doors_server``: one real server on the real 0.5B model)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time

import pytest
from cryptography import x509
from doors_server import KEY, MODEL, shared

from edgespec.server.tls import exposure_warnings, fingerprint, self_signed

openai = pytest.importorskip("openai")


def test_self_signed_is_made_once_and_anew_for_a_new_name(tmp_path):
    cert, key = self_signed(tmp_path, ["192.168.1.20", "lab.local"])
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    san = x509.load_pem_x509_certificate(cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert {"localhost", "lab.local"} <= set(san.get_values_for_type(x509.DNSName))
    assert {"127.0.0.1", "192.168.1.20"} <= {str(a) for a in
                                            san.get_values_for_type(x509.IPAddress)}
    first = fingerprint(cert)
    assert re.fullmatch(r"([0-9A-F]{2}:){31}[0-9A-F]{2}", first)
    assert self_signed(tmp_path, ["lab.local"]) == (cert, key) and fingerprint(cert) == first
    self_signed(tmp_path, ["10.0.0.5"])  # a name the kept one lacks: made anew
    assert fingerprint(cert) != first


def test_serving_beyond_loopback_warns_of_no_key_and_of_a_key_over_plain_http():
    assert exposure_warnings("127.0.0.1", None, None) == []
    assert "without --api-key" in exposure_warnings("0.0.0.0", None, None)[0]
    assert "plain HTTP" in exposure_warnings("192.168.1.20", "k", None)[0]
    assert exposure_warnings("0.0.0.0", "k", ("cert", "key")) == []


def test_the_cli_trusts_the_kept_certificate(tmp_path, monkeypatch):
    from edgespec.cli.served import tls_context

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("EDGESPEC_KEY_FILE", raising=False)
    assert tls_context("http://127.0.0.1:8080") is None
    before = len(tls_context("https://127.0.0.1:8080").get_ca_certs())
    self_signed(tmp_path / "edgespec")
    assert len(tls_context("https://127.0.0.1:8080").get_ca_certs()) == before + 1


def test_serve_tls_flags(tmp_path, monkeypatch):
    import argparse

    from edgespec.cli.run import _tls_files

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("EDGESPEC_KEY_FILE", raising=False)

    def flags(**kw) -> argparse.Namespace:
        base = {"tls_cert": None, "tls_key": None, "tls_self_signed": False,
                "host": "127.0.0.1", "allow_host": []}
        return argparse.Namespace(**{**base, **kw})

    assert _tls_files(flags()) is None
    cert, key = _tls_files(flags(tls_self_signed=True, host="0.0.0.0",
                                 allow_host=["lab.local"]))
    assert cert == str(tmp_path / "edgespec" / "serve-cert.pem")
    assert _tls_files(flags(tls_cert=cert, tls_key=key)) == (cert, key)
    for bad, why in (({"tls_cert": cert}, "go together"),
                     ({"tls_cert": cert, "tls_key": str(tmp_path / "nope")}, "no such file"),
                     ({"tls_self_signed": True, "tls_cert": cert, "tls_key": key}, "not both")):
        with pytest.raises(ValueError, match=why):
            _tls_files(flags(**bad))


@pytest.fixture(scope="module")
def srv():
    return shared()


@pytest.mark.real_model
def test_the_server_says_its_fingerprint(srv):
    assert f"SHA-256 {fingerprint(srv.ca)}" in srv.log()


@pytest.mark.real_model
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_curl_with_the_certificate_and_without(srv):
    ok = subprocess.run(["curl", "-sS", "--cacert", srv.ca, "-H", f"Authorization: Bearer "
                         f"{KEY}", srv.base + "/health"], capture_output=True, text=True,
                        timeout=30)
    assert ok.returncode == 0 and json.loads(ok.stdout)["status"] in ("ok", "degraded")
    t0 = time.monotonic()
    refused = subprocess.run(["curl", "-sS", srv.base + "/health"], capture_output=True,
                             text=True, timeout=30)
    assert refused.returncode == 60, refused.stderr  # the peer's certificate is not trusted
    assert time.monotonic() - t0 < 5


@pytest.mark.real_model
def test_a_client_without_the_certificate_is_refused_by_tls(srv):
    bare = openai.OpenAI(base_url=srv.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(openai.APIConnectionError) as e:
        bare.models.list()
    assert time.monotonic() - t0 < 5
    cause = e.value.__cause__
    while cause is not None and "CERTIFICATE_VERIFY_FAILED" not in str(cause):
        cause = cause.__cause__ or cause.__context__
    assert cause is not None, repr(e.value)


@pytest.mark.real_model
def test_chat_over_https_with_ca_file(srv):
    from edgespec.chat.server_backend import ServerBackend, ServerError

    backend = ServerBackend(srv.base, api_key=KEY, system=None, temperature=0.0,
                            max_tokens=8, ca_file=srv.ca)
    reply = backend.answer("What is the capital of Japan?", lambda _: None, threading.Event())
    assert reply.text
    with pytest.raises(ServerError, match="--ca-file"):
        ServerBackend(srv.base, api_key=KEY, system=None, temperature=0.0, max_tokens=8)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.real_model
def test_every_door_is_counted_alike(srv):
    """One chat through each door: /health's completed, /metrics' chat requests and tokens,
    and the page's per-generation records (/v1/ring) each grow by one per door."""
    def counts() -> tuple[int, float, int]:
        health = srv.http("GET", "/health")[1]
        metrics = srv.http("GET", "/metrics")[1]
        ring = srv.http("GET", "/v1/ring")[1]
        return (health["completed"], _metric(
            metrics, 'edgespec_requests_total{endpoint="chat",outcome="completed"}'),
            len(ring["history"]))

    before = counts()
    ask = "What is 2 + 3?"
    doors = [("/v1/chat/completions", {"model": MODEL, "max_tokens": 4, "messages": [
                 {"role": "user", "content": ask}]}),
             ("/v1/responses", {"model": MODEL, "max_output_tokens": 4, "input": ask}),
             ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [
                 {"role": "user", "content": ask}]}),
             ("/api/chat", {"model": MODEL, "stream": False, "options": {"num_predict": 4},
                            "messages": [{"role": "user", "content": ask}]})]
    for path, body in doors:
        status, answer = srv.http("POST", path, body)
        assert status == 200, (path, answer)
    after = counts()
    assert after[0] - before[0] == after[1] - before[1] == len(doors)
    assert after[2] - before[2] == len(doors)  # (the page keeps the last 500)
    assert "POST /api/chat" in srv.log() and "POST /v1/messages" in srv.log()


@pytest.mark.real_model
@pytest.mark.parametrize("path,body", [
    ("/api/chat", {"options": {"num_predict": 400, "temperature": 0}}),
    ("/v1/messages", {"max_tokens": 400, "stream": True}),
    ("/v1/responses", {"max_output_tokens": 400, "stream": True})])
def test_a_client_that_hangs_up_mid_stream_stops_its_generation(srv, path, body):
    import http.client
    from urllib.parse import urlsplit

    ask = "Write a long story about a dragon."
    body = {"model": MODEL, **body, **({"input": ask} if path == "/v1/responses" else
                                       {"messages": [{"role": "user", "content": ask}]})}
    before = srv.http("GET", "/health")[1]["abandoned"]
    where = urlsplit(srv.base)
    conn = http.client.HTTPSConnection(where.hostname, where.port, context=srv.tls(),
                                       timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the stream has begun
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = srv.http("GET", "/health")[1]
        if health["abandoned"] > before and health["serving"] == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the generation went on after the hang-up: {health}")
