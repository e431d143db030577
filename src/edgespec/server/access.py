"""The API key on every endpoint (``serve --api-key``): a bearer token, Anthropic's
``x-api-key`` header or the page's same-site cookie, compared in constant time; a login page
for a browser without it, and for an API client a 401 in its door's error shape."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import unquote

from fastapi.responses import HTMLResponse, Response

from edgespec.server.replies import _error

#: The login page's one script, allowed by its hash in the page's Content-Security-Policy
#: (``listener.HostCheck``): no other inline script runs.
_LOGIN_SCRIPT = """
document.getElementById("f").onsubmit = (e) => { e.preventDefault();
  document.cookie = "edgespec_key=" + encodeURIComponent(document.getElementById("k").value) +
    "; path=/; SameSite=Strict"; location.reload(); };
"""
LOGIN_SCRIPT_HASH = base64.b64encode(hashlib.sha256(_LOGIN_SCRIPT.encode()).digest()).decode()

_LOGIN_PAGE = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>edgespec: API key</title></head><body style="font: 15px system-ui; margin: 3em">
<h1>edgespec</h1><p>This server needs its API key (<code>edgespec serve --api-key</code>).</p>
<form id="f"><input id="k" type="password" autofocus placeholder="API key" size="40">
<button>Open</button></form><script>""" + _LOGIN_SCRIPT + """</script></body></html>"""


def _refusal(path: str, headers: dict[str, str]) -> Response:
    """The 401 in the error shape of the door ``path`` belongs to."""
    from edgespec.server import anthropic, ollama

    why = "missing or wrong API key: send 'Authorization: Bearer <key>'"
    if path.startswith("/api/"):
        return ollama._error(401, why, headers=headers)
    if path == "/v1/messages":
        return anthropic._error(401, why + " or 'x-api-key: <key>'", headers=headers)
    return _error(401, why, "invalid_request_error", code="invalid_api_key", headers=headers)


class _KeyCheck:
    """ASGI middleware: every request must carry the API key, as ``Authorization: Bearer
    <key>`` (API clients) or the page's ``edgespec_key`` cookie (browsers: a same-site
    cookie, so other sites cannot use it). Compared in constant time."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.key = key.encode()

    def _supplied(self, scope: dict) -> bytes:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            return auth[7:].strip()
        if b"x-api-key" in headers:  # Anthropic's clients send the key so
            return headers[b"x-api-key"].strip()
        cookie = headers.get(b"cookie")
        if cookie:
            jar: SimpleCookie = SimpleCookie()
            with contextlib.suppress(Exception):
                jar.load(cookie.decode("latin-1"))
            if "edgespec_key" in jar:
                return unquote(jar["edgespec_key"].value).encode()
        return b""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or hmac.compare_digest(self._supplied(scope), self.key):
            await self.app(scope, receive, send)
            return
        headers = {"WWW-Authenticate": "Bearer"}
        if scope.get("path") == "/" and scope.get("method") == "GET":
            response: Response = HTMLResponse(_LOGIN_PAGE, status_code=401, headers=headers)
        else:
            response = _refusal(str(scope.get("path", "")), headers)
        await response(scope, receive, send)
