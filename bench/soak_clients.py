"""The soak's users: six clients and a probe against one `edgespec serve`, run as their own
process on a device of the lab's LAN (``bench/soak.py`` starts it there).

    python -m bench.soak_clients --url http://10.231.0.2:8080 --until UNIX_TIME --out F.jsonl

Each client cycles through its kinds of request, through the server's doors with their
official clients: chat (greedy, with log probabilities), streamed chat, json_schema answers,
tool calls, a stream cancelled after a few pieces, a plain request whose client hangs up
(a 1 s read timeout), a long prompt, and the Anthropic, Ollama and OpenAI Responses doors.
A request whose attempt fails with a connection error, a 429 or a 5xx is tried again a second
later, as a user's tool would, until ``REQUEST_BOUND_S`` from its start; any other error
ends it. One JSON line per request: its kind, start and end (unix time), every attempt's
outcome and status, the answer's text (and a greedy chat's per-token log probabilities).
Requests go out as plain HTTP (httpx), not through the official clients: those retry on
their own and hide the attempts, and the soak counts every attempt against /metrics (the
doors are tested with the official clients in ``tests/test_doors_*.py``).
The probe asks for one token every half second, so the soak can tell when the ring serves
again after a fault. The last line is the server's /metrics after every client stopped.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

#: Longest a request may take, its retries included (the soak's stated bound).
REQUEST_BOUND_S = 120.0
#: Tokens per answer (short, so every client passes through many requests).
MAX_TOKENS = 24

GREEDY_PROMPTS = [
    "Write a Python function that returns the largest of three numbers.",
    "What is a hash map? Answer in two sentences.",
    "Write a bash command that prints the ten largest files in a folder.",
    "Explain what a Python generator is, briefly.",
]
LONG_PROMPT = ("Summarise this log in one sentence.\n" + "\n".join(
    f"2026-12-05 10:{i // 60:02d}:{i % 60:02d} worker-{i % 7} processed batch {i} in "
    f"{(i * 37) % 900 + 100} ms, queue depth {(i * 13) % 40}" for i in range(24)))
SCHEMA = {"type": "object", "properties": {"language": {"type": "string"},
                                           "year": {"type": "integer"}},
          "required": ["language", "year"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

#: Each client's kinds, in turn.
CLIENTS = [
    ["chat", "schema", "anthropic"],
    ["stream", "tools", "ollama"],
    ["chat", "cancel", "responses"],
    ["stream", "long", "disconnect"],
    ["schema", "chat", "tools"],
    ["stream", "anthropic", "cancel"],
]


class Retry(Exception):
    """An attempt that failed in a way a client tries again (connection, 429, 5xx)."""

    def __init__(self, status: int | None, reason: str) -> None:
        super().__init__(reason)
        self.status = status


class Final(Exception):
    """An attempt that failed in a way a client does not try again (a 4xx)."""

    def __init__(self, status: int | None, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _status_error(r: httpx.Response) -> Exception:
    text = r.text[:300]
    if r.status_code == 429 or r.status_code >= 500:
        return Retry(r.status_code, text)
    return Final(r.status_code, text)


class Clients:
    def __init__(self, url: str, model: str) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(60.0, connect=5.0))

    def _post(self, path: str, body: dict, timeout: float | None = None) -> dict:
        try:
            r = self.http.post(path, json=body, timeout=timeout or 60.0)
        except httpx.TransportError as e:
            raise Retry(None, f"{type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise _status_error(r)
        return r.json()

    def _stream(self, path: str, body: dict, stop_after: int | None = None
                ) -> tuple[str, bool, str | None]:
        """(text, cancelled, request id) of a streamed chat; ``stop_after`` pieces then
        hang up."""
        pieces: list[str] = []
        rid = None
        try:
            with self.http.stream("POST", path, json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    r.read()
                    raise _status_error(r)
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        raise Retry(500, f"stream error: {ev['error']}")
                    if rid is None:
                        rid = ev.get("id")
                    elif ev.get("id") != rid:
                        raise Final(None, f"a piece of request {ev.get('id')} in {rid}")
                    for ch in ev.get("choices", []):
                        pieces.append((ch.get("delta") or {}).get("content") or "")
                    if stop_after is not None and len(pieces) >= stop_after:
                        return "".join(pieces), True, rid
        except httpx.TransportError as e:
            raise Retry(None, f"{type(e).__name__}: {e}") from None
        return "".join(pieces), False, rid

    def chat_body(self, prompt: str, **kw: Any) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": MAX_TOKENS, **kw}

    # One function per kind: (prompt key, attempt) where the attempt returns the record's
    # answer fields or raises Retry / Final.
    def attempt(self, kind: str, n: int) -> tuple[str | None, Callable[[], dict]]:
        greedy = GREEDY_PROMPTS[n % len(GREEDY_PROMPTS)]
        key = f"g{n % len(GREEDY_PROMPTS)}"
        if kind in ("chat", "long"):
            prompt, extra = (greedy, {}) if kind == "chat" else (LONG_PROMPT, {"max_tokens": 12})

            def run() -> dict:
                out = self._post("/v1/chat/completions", self.chat_body(
                    prompt, temperature=0, logprobs=True, top_logprobs=2, **extra))
                ch = out["choices"][0]
                lp = [[t["token"], [[a["token"], a["logprob"]] for a in t["top_logprobs"]]]
                      for t in (ch.get("logprobs") or {}).get("content") or []]
                return {"text": ch["message"]["content"], "logprobs": lp,
                        "finish": ch["finish_reason"], "id": out["id"]}
            return (key if kind == "chat" else "long"), run
        if kind == "stream":
            def run() -> dict:
                text, _, rid = self._stream("/v1/chat/completions",
                                            self.chat_body(greedy, temperature=0))
                return {"text": text, "id": rid}
            return key, run
        if kind == "schema":
            def run() -> dict:
                out = self._post("/v1/chat/completions", self.chat_body(
                    "Name a programming language and the year it appeared, as JSON.",
                    max_tokens=48, temperature=0.8,
                    response_format={"type": "json_schema", "json_schema": {
                        "name": "language", "schema": SCHEMA, "strict": True}}))
                text = out["choices"][0]["message"]["content"]
                return {"text": text, "valid": _schema_valid(text), "id": out["id"]}
            return None, run
        if kind == "tools":
            def run() -> dict:
                out = self._post("/v1/chat/completions", self.chat_body(
                    "What is the weather in Lisbon?", tools=TOOLS, tool_choice="required",
                    max_tokens=48, temperature=0.7))
                calls = out["choices"][0]["message"].get("tool_calls") or []
                ok = bool(calls) and all(_tool_valid(c) for c in calls)
                return {"text": json.dumps(calls), "valid": ok, "id": out["id"]}
            return None, run
        if kind == "cancel":
            def run() -> dict:
                text, cancelled, rid = self._stream("/v1/chat/completions", self.chat_body(
                    greedy, temperature=0.9, max_tokens=64), stop_after=3)
                return {"text": text, "cancelled": cancelled, "id": rid}
            return None, run
        if kind == "disconnect":
            def run() -> dict:
                try:
                    out = self._post("/v1/chat/completions", self.chat_body(
                        LONG_PROMPT, max_tokens=64, temperature=0.9), timeout=1.0)
                except Retry as e:
                    if e.status is None and "Timeout" in str(e):
                        return {"text": "", "cancelled": True}
                    raise
                return {"text": out["choices"][0]["message"]["content"], "cancelled": False}
            return None, run
        if kind == "anthropic":
            def run() -> dict:
                out = self._post("/v1/messages", {
                    "model": self.model, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "messages": [{"role": "user", "content": greedy}]})
                return {"text": "".join(b.get("text", "") for b in out["content"]),
                        "id": out["id"]}
            return key, run
        if kind == "ollama":
            def run() -> dict:
                out = self._post("/api/chat", {
                    "model": self.model, "stream": False,
                    "options": {"temperature": 0, "num_predict": MAX_TOKENS},
                    "messages": [{"role": "user", "content": greedy}]})
                return {"text": out["message"]["content"]}
            return key, run
        if kind == "responses":
            def run() -> dict:
                out = self._post("/v1/responses", {
                    "model": self.model, "input": greedy, "temperature": 0,
                    "max_output_tokens": MAX_TOKENS})
                text = "".join(c.get("text", "") for item in out.get("output", [])
                               if item.get("type") == "message" for c in item["content"])
                return {"text": text, "id": out["id"]}
            return key, run
        raise ValueError(f"unknown kind {kind!r}")


def _schema_valid(text: str) -> bool:
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == {"language", "year"}
            and isinstance(v["language"], str) and isinstance(v["year"], int))


def _tool_valid(call: dict) -> bool:
    try:
        args = json.loads(call["function"]["arguments"])
    except (KeyError, ValueError, TypeError):
        return False
    return call["function"]["name"] == "get_weather" and isinstance(args.get("city"), str)


def one_request(clients: Clients, client: int, kind: str, n: int) -> dict:
    """One request to its end: an answer, or the error that ended it (after retries)."""
    key, run = clients.attempt(kind, n)
    rec: dict[str, Any] = {"client": client, "kind": kind, "key": key, "t0": time.time(),
                           "attempts": []}
    while True:
        a0 = time.time()
        try:
            rec.update(run())
            rec["attempts"].append({"t0": a0, "t1": time.time(), "status": 200})
            rec["result"] = "cancelled" if rec.get("cancelled") else "answer"
            break
        except (Retry, Final) as e:
            rec["attempts"].append({"t0": a0, "t1": time.time(), "status": e.status,
                                    "error": str(e)[:300]})
            if isinstance(e, Final) or time.time() + 1.0 - rec["t0"] > REQUEST_BOUND_S:
                rec["result"] = "error"
                rec["error"] = str(e)[:300]
                rec["retryable"] = isinstance(e, Retry)
                break
            time.sleep(1.0)
    rec["t1"] = time.time()
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--until", type=float, required=True, help="unix time to stop starting")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="edgespec")
    ap.add_argument("--requests", type=int, default=None,
                    help="stop starting requests after this many in all (default: no cap)")
    args = ap.parse_args()
    started = [0]  # requests started by every client together
    clients = Clients(args.url, args.model)
    lock = threading.Lock()
    out = open(args.out, "a")  # noqa: SIM115 (closed at the end of main)

    def write(rec: dict) -> None:
        with lock:
            out.write(json.dumps(rec) + "\n")
            out.flush()

    def user(i: int) -> None:
        n = i  # clients start on different prompts
        while time.time() < args.until:
            with lock:
                if args.requests is not None and started[0] >= args.requests:
                    return
                started[0] += 1
            kind = CLIENTS[i][n % len(CLIENTS[i])]
            write(one_request(clients, i, kind, n))
            n += 1
            time.sleep(0.2)

    def probe() -> None:
        http = httpx.Client(base_url=clients.url, timeout=httpx.Timeout(30.0, connect=2.0))
        body = clients.chat_body("Say yes.", max_tokens=1, temperature=0)
        while time.time() < args.until:
            t0 = time.time()
            try:
                r = http.post("/v1/chat/completions", json=body)
                status: int | None = r.status_code
            except httpx.TransportError:
                status = None
            write({"probe": True, "t0": t0, "t1": time.time(), "status": status})
            time.sleep(max(0.0, 0.5 - (time.time() - t0)))

    threads = [threading.Thread(target=user, args=(i,), daemon=True)
               for i in range(len(CLIENTS))]
    threads.append(threading.Thread(target=probe, daemon=True))
    print("clients started", flush=True)
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_BOUND_S + max(0.0, args.until - time.time()) + 30)
    time.sleep(1.0)
    try:
        metrics = clients.http.get("/metrics", timeout=10).text
    except httpx.HTTPError as e:
        metrics = f"unreachable: {e}"
    write({"metrics": metrics, "stuck": [t.name for t in threads if t.is_alive()]})
    out.close()


if __name__ == "__main__":
    main()
