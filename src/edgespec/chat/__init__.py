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

import json
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol, TextIO

from edgespec.api import Ring
from edgespec.chat.ring_backend import RingBackend
from edgespec.chat.server_backend import ServerBackend, ServerError
from edgespec.chat.terminal import COMMANDS, HELP, LineReader, Screen, notices_on

__all__ = ["ServerError", "chat_loop", "run_chat", "run_server_chat"]


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

# ------------------------------------------------------------------------------- the loop

def run_chat(ring: Ring, *, system: str | None = None, max_tokens: int = 512,
             spec: str | None = None, json_schema: dict[str, Any] | None = None,
             stdin: TextIO | None = None, stdout: TextIO | None = None,
             stderr: TextIO | None = None, **sampling: float) -> int:
    """Chat over ``ring``; returns the exit code (1 if an answer failed). ``json_schema``:
    every answer is one JSON value valid against it; ``sampling``: sampler fields
    (``edgespec.sampling.FIELDS``: ``temperature``, ``top_p``, ...; greedy by default)."""
    backend = RingBackend(ring, system=system, max_tokens=max_tokens, spec=spec,
                          json_schema=json_schema, **sampling)
    return chat_loop(backend, stdin=stdin, stdout=stdout, stderr=stderr)


def run_server_chat(url: str, *, api_key: str | None = None, system: str | None = None,
                    max_tokens: int = 512, json_schema: dict[str, Any] | None = None,
                    ca_file: str | None = None, stdin: TextIO | None = None,
                    stdout: TextIO | None = None, stderr: TextIO | None = None,
                    **sampling: float) -> int:
    """Chat with the `edgespec serve` at ``url``; returns the exit code. ``json_schema``:
    sent as every request's ``response_format``; ``ca_file``: the certificate an HTTPS
    server is trusted by; ``sampling``: sampler fields sent with every request (greedy
    unless ``temperature`` is given)."""
    backend = ServerBackend(url, api_key=api_key or os.environ.get("EDGESPEC_API_KEY"),
                            system=system, max_tokens=max_tokens, json_schema=json_schema,
                            ca_file=ca_file, **sampling)
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
    """Stream one answer from a worker thread; Ctrl-C cancels it at the next step and keeps
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
            # The ring finishes its current step; the pieces of that step still print, and
            # the mark goes after them, where the answer really ends.
            cancel.set()
    while t.is_alive():
        try:
            t.join()
        except KeyboardInterrupt:  # a second Ctrl-C while the step ends: already stopping
            cancel.set()
    if cancel.is_set():
        screen.write(" [stopped]")
    return holder.get("reply"), holder.get("error")
