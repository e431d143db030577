"""The record a running `edgespec serve` leaves for `edgespec ring status`: only the head holds
the ring's slots (busy/free, tokens, speed), and a status command run beside it asks the
server's ``/health`` for them. The record (``$EDGESPEC_HOME/serve.json``: URL, pid, host) lives
while the server runs; a record whose process is gone is ignored."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import time
import urllib.request
from pathlib import Path
from typing import Any


def record_path() -> Path:
    from edgespec.llm.models import home

    return home() / "serve.json"


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"  # listening everywhere: this host reaches it on loopback
    return f"[{host}]" if ":" in host else host


class _Record:
    """The record of this server: written once its URL is known, removed when it stops."""

    def __init__(self) -> None:
        self.path = record_path()
        self.written = False

    def write(self, url: str) -> None:
        """(Re)write the record with ``url`` (best effort: a read-only home only means
        `ring status` cannot show the slots)."""
        rec = {"url": url, "pid": os.getpid(), "host": socket.gethostname(),
               "since": time.time()}
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rec))
            tmp.replace(self.path)
            self.written = True


def local_url(host: str, port: int, scheme: str = "http") -> str:
    """The URL this host reaches a server listening on ``host:port`` at."""
    return f"{scheme}://{_url_host(host)}:{port}"


@contextlib.contextmanager
def serve_record(host: str, port: int, scheme: str = "http"):
    """The record for the server's lifetime: written now when the port is known, else by
    ``record.write(url)`` once the server listens."""
    record = _Record()
    if port:
        record.write(local_url(host, port, scheme))
    try:
        yield record
    finally:
        if record.written:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(record.path.read_text()).get("pid") == os.getpid():
                    record.path.unlink()


def running_server() -> str | None:
    """The URL of the `edgespec serve` running on this host, from its record; None if there
    is none (or its process is gone)."""
    try:
        rec = json.loads(record_path().read_text())
        pid, url = int(rec["pid"]), str(rec["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if rec.get("host") != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's process: it exists
    return url


def tls_context(url: str) -> ssl.SSLContext | None:
    """What a CLI command trusts an ``https`` server by: the system's CAs and the
    self-signed certificate `serve --tls-self-signed` keeps beside the ring key, if any."""
    if not url.startswith("https://"):
        return None
    from edgespec.server.tls import CERT_NAME
    from edgespec.wire.auth import default_key_path

    ctx = ssl.create_default_context()
    kept = default_key_path().parent / CERT_NAME
    if kept.exists():
        with contextlib.suppress(OSError, ssl.SSLError):
            ctx.load_verify_locations(cafile=str(kept))
    return ctx


def fetch_json(url: str, path: str, api_key: str | None, timeout: float = 5.0) -> dict[str, Any]:
    """GET ``url + path`` as JSON (with the server's API key, if any)."""
    req = urllib.request.Request(url.rstrip("/") + path)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=timeout,  # noqa: S310 - http(s) only
                                context=tls_context(url)) as r:
        return json.loads(r.read())
