"""One `edgespec serve --local 2 --tls-self-signed --api-key` process shared by the doors'
tests (Ollama, Anthropic Messages, OpenAI Responses, HTTPS): started on first use, stopped
at the end of the session. Its self-signed certificate is made in a home of its own
(``XDG_CONFIG_HOME``: beside that home's ring key), and every client trusts it through that
file, as a home-lab user's would."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from proc_helpers import alive, children

MODEL = "qwen2.5-coder-0.5b-instruct"  # the served id: the GGUF file's stem
KEY = "doors-key"

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}
# Asked this, the 0.5B model calls get_weather(city="Paris") on its own (test_server).
RAINING = "Is it raining in Paris right now?"
RESULT = "Rain, 12 degrees Celsius."
CAT = {"type": "object", "additionalProperties": False, "required": ["name", "age", "indoor"],
       "properties": {"name": {"type": "string", "maxLength": 20},
                      "age": {"type": "integer", "minimum": 0, "maximum": 30},
                      "indoor": {"type": "boolean"}}}
REPLY = {"type": "object", "properties": {"reply": {"type": "string", "maxLength": 100}},
         "required": ["reply"], "additionalProperties": False}


def is_cat(obj: object) -> bool:
    """CAT checked by hand (jsonschema is not a dependency)."""
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "indoor"}
            and isinstance(obj["name"], str) and len(obj["name"]) <= 20
            and type(obj["age"]) is int and 0 <= obj["age"] <= 30
            and isinstance(obj["indoor"], bool))


def uses_result(text: str) -> bool:
    """A final answer that took the tool's result in."""
    low = text.lower()
    return "rain" in low or "12" in low


class DoorsServer:
    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="edgespec-doors-"))
        self.log_path = self.home / "serve.log"
        env = dict(os.environ, OMP_WAIT_POLICY="passive", PYTHONUNBUFFERED="1",
                   XDG_CONFIG_HOME=str(self.home / "config"))
        env.pop("EDGESPEC_KEY_FILE", None)
        exe = str(Path(sys.executable).with_name("edgespec"))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [exe, "serve", "--local", "2", "--port", "0", "--tls-self-signed",
                 "--api-key", KEY], stdout=log, stderr=subprocess.STDOUT, env=env)
        self.ca = str(self.home / "config" / "edgespec" / "serve-cert.pem")
        self.base = self._wait_ready(240)
        self.nodes = children(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tls(self) -> ssl.SSLContext:
        """A client's TLS settings trusting the server's certificate (its file)."""
        return ssl.create_default_context(cafile=self.ca)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"Uvicorn running on (https://[\d.]+:\d+)", self.log())
            if m:
                base = m.group(1)
                status, body = self.http("GET", base + "/v1/models")
                assert status == 200, body
                return base
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited ({self.proc.returncode}):\n{self.log()}")
            time.sleep(0.2)
        raise AssertionError(f"server not ready in {timeout} s:\n{self.log()}")

    def http(self, method: str, url: str, body: object = None, key: str | None = KEY,
             headers: dict[str, str] | None = None) -> tuple[int, dict | str]:
        """A raw request over HTTPS: (status, the body as JSON, else as text)."""
        if not url.startswith("http"):
            url = self.base + url
        data = None if body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        if key:
            hdrs["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=300, context=self.tls()) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            for pid in self.nodes:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(self.home, ignore_errors=True)


_shared: DoorsServer | None = None


def shared() -> DoorsServer:
    """The one server of the session (started on first use, stopped at exit)."""
    global _shared
    if _shared is None:
        _shared = DoorsServer()
        atexit.register(_shared.stop)
    return _shared
