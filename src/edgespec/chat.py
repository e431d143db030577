"""`edgespec chat`: an interactive chat over a ring, or over a running `edgespec serve`.

Over a ring, turns are built token by token: the conversation so far stays in the ring's KV
cache, and a new turn appends only the template text between the previous answer and the new
user message (rendered by the model's own chat template through llama.cpp), so it never
re-prefills earlier turns. With ``--server URL`` the same loop talks to an `edgespec serve`
over its OpenAI API instead, so a second terminal can chat without taking the ring from the
server. Ctrl-C stops the answer being streamed and keeps the session.

On a terminal the prompt line is edited with readline (arrow keys, history kept under the
edgespec home), and warnings logged while an answer streams (a ring recovery, say) are printed
on lines of their own instead of inside the answer text.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from edgespec.api import Generation, Ring

COMMANDS = (
    ("/help", "list these commands"),
    ("/reset", "start a new conversation"),
    ("/stats", "statistics of the last answer (JSON)"),
    ("/exit", "leave the chat (also /quit or Ctrl-D)"),
)
HELP = "commands: " + ", ".join(name for name, _ in COMMANDS) + " (Ctrl-C stops an answer)"
HISTORY_FILE = "chat_history"
HISTORY_LENGTH = 1000


class ServerError(RuntimeError):
    """The chat server could not be reached or refused a request (one line for the user)."""


# ---------------------------------------------------------------------------- the screen

class Screen:
    """The answer stream and out-of-band notices share one terminal.

    The screen remembers whether the cursor is in the middle of an answer line; a notice then
    starts a new line first, so it never lands inside the answer text, and the answer goes on
    below it. Safe to call from the generation thread and the logging machinery at once.
    """

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err
        self._lock = threading.Lock()
        self._mid_line = False

    def write(self, text: str) -> None:
        """Answer text or prompts, on ``out``."""
        if not text:
            return
        with self._lock:
            self.out.write(text)
            self.out.flush()
            self._mid_line = not text.endswith("\n")

    def notice(self, text: str) -> None:
        """A status or warning line of its own, on ``err``."""
        with self._lock:
            if self._mid_line:
                self.out.write("\n")
                self.out.flush()
                self._mid_line = False
            self.err.write(text.rstrip("\n") + "\n")
            self.err.flush()


class _NoticeHandler(logging.Handler):
    """Routes log records to ``Screen.notice`` while a chat runs."""

    def __init__(self, screen: Screen, level: int) -> None:
        super().__init__(level)
        self.screen = screen

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.screen.notice(f"[{record.levelname.lower()}] {record.getMessage()}")
        except Exception:  # logging must never break the chat
            self.handleError(record)


@contextlib.contextmanager
def notices_on(screen: Screen) -> Iterator[None]:
    """Send the package's log records to ``screen`` for the duration of the chat.

    Warnings and errors always; lower levels only when the package logger is set to show them
    (``edgespec -v``). The package logger stops propagating meanwhile, so a record is not also
    printed by the root handler in the middle of an answer."""
    logger = logging.getLogger("edgespec")
    level = logging.DEBUG if logger.getEffectiveLevel() <= logging.DEBUG else logging.WARNING
    handler = _NoticeHandler(screen, level)
    saved = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved


# ----------------------------------------------------------------------------- input lines

class LineReader:
    """Reads the user's lines: with readline on a terminal, plainly from a pipe."""

    def __init__(self, inp: TextIO, screen: Screen) -> None:
        self.inp = inp
        self.screen = screen
        self.history_path: Path | None = None
        self._readline: Any = None
        self.interactive = (inp is sys.stdin and screen.out is sys.stdout
                            and _isatty(inp) and _isatty(screen.out))
        if self.interactive:
            try:
                import readline  # line editing for input(); absent on some platforms
            except ImportError:
                readline = None  # type: ignore[assignment]
            if readline is not None:
                self._readline = readline
                self._load_history()

    def _load_history(self) -> None:
        from edgespec.llm.models import home

        self.history_path = home() / HISTORY_FILE
        rl = self._readline
        rl.set_history_length(HISTORY_LENGTH)
        with contextlib.suppress(OSError):
            rl.read_history_file(self.history_path)

    def _remember(self, line: str) -> None:
        if self._readline is None or self.history_path is None or not line.strip():
            return
        try:
            self.history_path.parent.mkdir(parents=True, exist_ok=True)
            if not self.history_path.exists():
                self.history_path.touch(mode=0o600)
            self._readline.append_history_file(1, self.history_path)
            self._readline.set_history_length(HISTORY_LENGTH)
        except OSError:  # no history is no reason to stop chatting
            self.history_path = None

    def read(self, prompt: str) -> str | None:
        """One line without its newline; None at end of input. Ctrl-C propagates."""
        if self.interactive:
            try:
                line = input(prompt)
            except EOFError:
                return None
            self._remember(line)
            return line
        self.screen.write(prompt)
        line = self.inp.readline()
        if not line:
            return None
        return line.rstrip("\r\n")


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# -------------------------------------------------------------------------------- backends

class Backend(Protocol):
    """What the chat loop talks to: a ring in this process, or a server."""

    def banner(self) -> str: ...

    def answer(self, text: str, emit: Callable[[str], None], cancel: threading.Event
               ) -> Any: ...

    def stats_line(self, reply: Any) -> str: ...

    def stats_json(self, reply: Any) -> dict[str, Any]: ...

    def notes(self, reply: Any) -> list[str]: ...

    def reset(self) -> None: ...


class ChatSession:
    """A conversation whose tokens mirror exactly what the ring's KV cache holds."""

    def __init__(self, ring: Ring, system: str | None = None) -> None:
        self.ring = ring
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict[str, str]] = []
        if self.system:
            self.messages.append({"role": "system", "content": self.system})
        self.tokens: list[int] = []  # the conversation as token ids (prompt + answers)

    def turn_tokens(self, user_text: str) -> list[int]:
        """Token ids of the whole conversation with the new user turn and the generation
        prompt; earlier tokens are exactly the ones already sent (so the ring reuses them)."""
        tok = self.ring.tokenizer
        msgs = [*self.messages, {"role": "user", "content": user_text}]
        rendered = tok.chat_prompt(msgs, add_generation_prompt=True)
        if self.tokens:
            so_far = tok.decode(self.tokens, unparse_special=True)
            if rendered.startswith(so_far):
                suffix = rendered[len(so_far):]
                return self.tokens + tok.encode(suffix, add_special=False, parse_special=True)
        return tok.encode(rendered, add_special=False, parse_special=True)

    def record(self, user_text: str, prompt_tokens: list[int], gen: Generation,
               eog_token: int | None) -> None:
        self.messages.append({"role": "user", "content": user_text})
        self.messages.append({"role": "assistant", "content": gen.text})
        answer = list(gen.tokens) + ([eog_token] if eog_token is not None else [])
        self.tokens = prompt_tokens + answer


def _eog_of(ring: Ring) -> int | None:
    """The end-of-turn token the template expects after an answer."""
    tok = ring.tokenizer
    ids = tok.encode("<|im_end|>", add_special=False, parse_special=True)
    if len(ids) == 1 and tok.is_eog(ids[0]):
        return ids[0]
    return tok.eos_id if tok.eos_id >= 0 else None


def stats_line(gen: Generation) -> str:
    s = gen.stats
    return (f"[{s.tokens} tokens in {s.decode_s:.2f} s: {s.tokens_per_s:.1f} tok/s, "
            f"{s.mean_accepted:.2f} tokens/round ({s.mode}), prompt {s.prompt_tokens} tokens, "
            f"{s.prefill_tokens} computed]")


_DRAFT_COPY = re.compile(r"^(?P<stem>.+)\.[0-9a-f]{12}\.(?P<quant>[a-z0-9_]+)\.gguf$")


def drafter_label(ring: Ring) -> str:
    """What drafts for ``ring``, in words: the draft model's file, or retrieval."""
    info = getattr(ring, "drafter_info", None)
    drafter = getattr(ring, "drafter", None) or getattr(ring, "_drafter", None)
    for described in (info, drafter):  # a description the ring gives of its drafter
        if isinstance(described, str) and described:
            return described
        if isinstance(described, dict) and described:
            return ", ".join(f"{k} {v}" for k, v in described.items() if v is not None)
    if drafter is None:
        return "no drafter"
    inner = getattr(drafter, "model", None)  # a hybrid drafter holds the model drafter
    path = getattr(drafter, "model_path", None) or getattr(inner, "model_path", None)
    if path is None:
        return "retrieval (n-grams of the conversation; no draft model)"
    name = Path(path).name
    m = _DRAFT_COPY.match(name)
    label = f"{m['stem']} ({m['quant'].upper()} copy)" if m else name
    return f"draft model {label}" + (" after retrieval" if inner is not None else "")


class RingBackend:
    """Chat over a ``Ring`` held by this process."""

    def __init__(self, ring: Ring, *, system: str | None, temperature: float,
                 max_tokens: int, spec: str | None) -> None:
        self.ring = ring
        self.session = ChatSession(ring, system)
        self.kwargs = {"temperature": temperature, "max_tokens": max_tokens, "spec": spec}
        self.max_tokens = max_tokens

    def banner(self) -> str:
        ring = self.ring
        text = (f"edgespec chat: {ring.model_name} over {ring.chain.n_stages} stage(s), "
                f"drafting with {drafter_label(ring)}. {HELP}")
        if self.max_tokens >= ring.n_ctx:
            text += (f"\n(--max-tokens {self.max_tokens} is more than the context of "
                     f"{ring.n_ctx} tokens: an answer ends where the context is full)")
        return text

    def answer(self, text: str, emit: Callable[[str], None], cancel: threading.Event
               ) -> Generation | None:
        prompt_tokens = self.session.turn_tokens(text)
        stream = self.ring.stream_tokens(prompt_tokens, cancel=cancel, **self.kwargs)
        for piece in stream:
            emit(piece)
        gen = stream.result
        if gen is not None:
            self.session.record(text, prompt_tokens, gen, _eog_of(self.ring))
        return gen

    def stats_line(self, reply: Generation) -> str:
        return stats_line(reply)

    def stats_json(self, reply: Generation) -> dict[str, Any]:
        return reply.stats.as_dict()

    def notes(self, reply: Generation) -> list[str]:
        cap = getattr(reply, "capped_max_tokens", None)
        if cap is None:
            return []
        return [f"(max_tokens {self.max_tokens} capped to {cap}: the room left in the "
                f"context of {self.ring.n_ctx} tokens)"]

    def reset(self) -> None:
        self.session.reset()
        self.ring.reset()


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
                 temperature: float, max_tokens: int, timeout: float = 600.0) -> None:
        base = url.rstrip("/")
        if not re.match(r"^https?://", base):
            base = "http://" + base
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.api_key = api_key
        self.system = system
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.timeout = timeout
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
            return urllib.request.urlopen(req, timeout=timeout or self.timeout)
        except urllib.error.HTTPError as e:
            raise ServerError(self._http_error(e)) from None
        except urllib.error.URLError as e:
            reason = getattr(e, "reason", e)
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
                "max_tokens": self.max_tokens, "temperature": self.temperature,
                "stream_options": {"include_usage": True}}
        reply = ServerReply("")
        t0 = time.perf_counter()
        with self._request("/v1/chat/completions", body) as resp:
            for raw in resp:
                if cancel.is_set():
                    break  # closing the stream stops the server's generation at its next round
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


# ------------------------------------------------------------------------------- the loop

def run_chat(ring: Ring, *, system: str | None = None, temperature: float = 0.0,
             max_tokens: int = 512, spec: str | None = None, stdin: TextIO | None = None,
             stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Chat over ``ring``; returns the exit code (1 if an answer failed)."""
    backend = RingBackend(ring, system=system, temperature=temperature, max_tokens=max_tokens,
                          spec=spec)
    return chat_loop(backend, stdin=stdin, stdout=stdout, stderr=stderr)


def run_server_chat(url: str, *, api_key: str | None = None, system: str | None = None,
                    temperature: float = 0.0, max_tokens: int = 512,
                    stdin: TextIO | None = None, stdout: TextIO | None = None,
                    stderr: TextIO | None = None) -> int:
    """Chat with the `edgespec serve` at ``url``; returns the exit code."""
    backend = ServerBackend(url, api_key=api_key or os.environ.get("EDGESPEC_API_KEY"),
                            system=system, temperature=temperature, max_tokens=max_tokens)
    return chat_loop(backend, stdin=stdin, stdout=stdout, stderr=stderr)


def chat_loop(backend: Backend, *, stdin: TextIO | None = None, stdout: TextIO | None = None,
              stderr: TextIO | None = None) -> int:
    """The read-answer loop. Returns 0, or 1 when an answer failed (so a script that pipes
    questions into the chat learns about it)."""
    screen = Screen(stdout or sys.stdout, stderr or sys.stderr)
    reader = LineReader(stdin or sys.stdin, screen)
    failed = False
    last: Any = None
    screen.write(backend.banner() + "\n")
    with notices_on(screen):
        while True:
            screen.write("\n")
            try:
                line = reader.read("> ")
            except KeyboardInterrupt:
                screen.write("\n")
                continue
            if line is None:
                screen.write("\n")
                return 1 if failed else 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                cmd = text.split()[0].lower()
                if cmd in ("/exit", "/quit"):
                    return 1 if failed else 0
                if cmd == "/help":
                    width = max(len(name) for name, _ in COMMANDS)
                    screen.write("".join(f"  {name:<{width}}  {what}\n"
                                         for name, what in COMMANDS)
                                 + "  Ctrl-C stops the answer being written\n")
                elif cmd == "/reset":
                    backend.reset()
                    screen.write("(conversation cleared)\n")
                elif cmd == "/stats":
                    if last is None:
                        screen.write("(no answer yet)\n")
                    else:
                        screen.write(json.dumps(backend.stats_json(last), indent=2) + "\n")
                else:
                    screen.write(f"unknown command {cmd}; {HELP}\n")
                continue
            reply, error = _stream_answer(backend, text, screen)
            if error is not None:
                failed = True
                screen.notice(f"(error: {error})")
                continue
            if reply is None:
                continue
            last = reply
            for note in backend.notes(reply):
                screen.notice(note)
            screen.write("\n" + backend.stats_line(reply) + "\n")


def _stream_answer(backend: Backend, text: str, screen: Screen
                   ) -> tuple[Any, BaseException | None]:
    """Stream one answer from a worker thread; Ctrl-C cancels it at the next round and keeps
    what was shown. Returns (reply, error)."""
    cancel = threading.Event()
    pieces: queue.Queue = queue.Queue()
    done = object()
    holder: dict[str, Any] = {}

    def work() -> None:
        try:
            holder["reply"] = backend.answer(text, pieces.put, cancel)
        except Exception as e:  # shown to the user; the session goes on
            holder["error"] = e
        finally:
            pieces.put(done)

    t = threading.Thread(target=work, name="edgespec-chat", daemon=True)
    t.start()
    while True:
        try:
            item = pieces.get()
            if item is done:
                break
            screen.write(item)
        except KeyboardInterrupt:
            # The ring finishes its current round; the pieces of that round still print, and
            # the mark goes after them, where the answer really ends.
            cancel.set()
    while t.is_alive():
        try:
            t.join()
        except KeyboardInterrupt:  # a second Ctrl-C while the round ends: already stopping
            cancel.set()
    if cancel.is_set():
        screen.write(" [stopped]")
    return holder.get("reply"), holder.get("error")
