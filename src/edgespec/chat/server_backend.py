"""Chatting with a running `edgespec serve` over its OpenAI API (streamed server-sent events)."""

from __future__ import annotations

import json
import re
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from edgespec.chat.terminal import HELP
from edgespec.params import GenerationParams


class ServerError(RuntimeError):
    """The chat server could not be reached or refused a request (one line for the user)."""

@dataclass
class ServerReply:
    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    first_token_s: float | None = None


class ServerBackend:
    """Chat with a running `edgespec serve` over its OpenAI API (streamed server-sent events).

    The server keeps its ring; this process holds only the conversation's messages. urllib is
    enough for one streamed POST at a time and keeps the chat free of HTTP dependencies.
    """

    def __init__(self, url: str, *, api_key: str | None, system: str | None,
                 max_tokens: int, timeout: float = 600.0,
                 json_schema: dict[str, Any] | None = None,
                 ca_file: str | None = None, **sampling: float) -> None:
        base = url.rstrip("/")
        if not re.match(r"^https?://", base):
            base = "http://" + base
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.api_key = api_key
        # HTTPS: the system's trusted CAs, or the certificate (or CA) in ``ca_file``.
        self.tls = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self.system = system
        # Checked here, before the server is asked anything; greedy unless told (the
        # server's default temperature is OpenAI's, 1).
        GenerationParams(**sampling)
        self.sampling = {"temperature": 0.0, **sampling}
        self.max_tokens = max_tokens
        self.timeout = timeout
        # Every answer constrained to this schema (OpenAI's response_format).
        self.response_format = None if json_schema is None else {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": json_schema,
                                                   "strict": True}}
        self.messages: list[dict[str, str]] = []
        self.reset()
        models = self._get("/v1/models").get("data") or []
        if not models:
            raise ServerError(f"{self.base} lists no model at /v1/models: is it `edgespec serve`?")
        self.model = str(models[0].get("id"))

    def _request(self, path: str, body: dict[str, Any] | None = None,
                 timeout: float | None = None) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base + path, data=data, headers=headers,
                                     method="POST" if body is not None else "GET")
        try:
            return urllib.request.urlopen(req, timeout=timeout or self.timeout,
                                          context=self.tls)
        except urllib.error.HTTPError as e:
            raise ServerError(self._http_error(e)) from None
        except urllib.error.URLError as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, ssl.SSLError):
                raise ServerError(f"{self.base} is not trusted ({reason}): give its "
                                  f"certificate with --ca-file") from None
            raise ServerError(f"no edgespec server answers at {self.base} ({reason}): start "
                              f"`edgespec serve` there, or check --server") from None
        except TimeoutError:
            raise ServerError(f"{self.base} did not answer within "
                              f"{timeout or self.timeout:.0f} s") from None

    def _http_error(self, e: urllib.error.HTTPError) -> str:
        try:
            message = json.loads(e.read() or b"{}").get("error", {}).get("message")
        except (ValueError, AttributeError, OSError):
            message = None
        if e.code == 401:
            return (f"{self.base} refused the request (401): pass its key with --api-key "
                    f"or EDGESPEC_API_KEY")
        return f"{self.base} answered {e.code}: {message or e.reason}"

    def _get(self, path: str) -> dict[str, Any]:
        with self._request(path, timeout=30) as resp:
            try:
                return json.loads(resp.read())
            except ValueError:
                raise ServerError(f"{self.base}{path} did not answer JSON: is it "
                                  f"`edgespec serve`?") from None

    def banner(self) -> str:
        return f"edgespec chat: {self.model} on the server at {self.base}. {HELP}"

    def answer(self, text: str, emit: Callable[[str], None], cancel: threading.Event
               ) -> ServerReply:
        msgs = [*self.messages, {"role": "user", "content": text}]
        body = {"model": self.model, "messages": msgs, "stream": True,
                "max_tokens": self.max_tokens, **self.sampling,
                "stream_options": {"include_usage": True}}
        if self.response_format is not None:
            body["response_format"] = self.response_format
        reply = ServerReply("")
        t0 = time.perf_counter()
        with self._request("/v1/chat/completions", body) as resp:
            for raw in resp:
                if cancel.is_set():
                    break  # closing the stream stops the server's generation at its next step
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ServerError(f"{self.base} sent a malformed event: {data[:80]}") from None
                if "error" in event:
                    raise ServerError(str(event["error"].get("message") or event["error"]))
                if event.get("usage"):
                    reply.usage = dict(event["usage"])
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        if reply.first_token_s is None:
                            reply.first_token_s = time.perf_counter() - t0
                        reply.text += piece
                        emit(piece)
                    if choice.get("finish_reason"):
                        reply.finish_reason = choice["finish_reason"]
        reply.seconds = time.perf_counter() - t0
        self.messages = [*msgs, {"role": "assistant", "content": reply.text}]
        return reply

    def stats_line(self, reply: ServerReply) -> str:
        n = int(reply.usage.get("completion_tokens", 0))
        rate = n / reply.seconds if reply.seconds > 0 else 0.0
        return (f"[{n} tokens in {reply.seconds:.2f} s: {rate:.1f} tok/s, prompt "
                f"{reply.usage.get('prompt_tokens', '?')} tokens, via {self.base}]")

    def stats_json(self, reply: ServerReply) -> dict[str, Any]:
        return {**reply.usage, "seconds": round(reply.seconds, 3),
                "first_token_s": (round(reply.first_token_s, 3)
                                  if reply.first_token_s is not None else None),
                "finish_reason": reply.finish_reason, "server": self.base}

    def notes(self, reply: ServerReply) -> list[str]:
        return []

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
