"""`edgespec chat`: an interactive chat over a ring.

Turns are built token by token: the conversation so far stays in the ring's KV cache, and a
new turn appends only the template text between the previous answer and the new user message
(rendered by the model's own chat template through llama.cpp), so it never re-prefills earlier
turns. Ctrl-C stops the answer being streamed and keeps the session.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from typing import TextIO

from .api import Generation, Ring

HELP = "commands: /reset (new conversation), /stats (last answer's statistics), /exit"


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


def _eog_of(ring: Ring, gen: Generation) -> int | None:
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


def run_chat(ring: Ring, *, system: str | None = None, temperature: float = 0.0,
             max_tokens: int = 512, spec: str | None = None, stdin: TextIO | None = None,
             stdout: TextIO | None = None) -> int:
    """The interactive loop (returns the exit code)."""
    inp = stdin or sys.stdin
    out = stdout or sys.stdout
    session = ChatSession(ring, system)
    last: Generation | None = None
    out.write(f"edgespec chat: {ring.model_name} over {ring.chain.n_stages} stage(s). {HELP}\n")
    out.flush()
    while True:
        out.write("\n> ")
        out.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if not line:
            out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd = text.split()[0].lower()
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/reset":
                session.reset()
                ring.reset()
                out.write("(conversation cleared)\n")
            elif cmd == "/stats":
                if last is None:
                    out.write("(no answer yet)\n")
                else:
                    out.write(json.dumps(last.stats.as_dict(), indent=2) + "\n")
            else:
                out.write(f"unknown command {cmd}; {HELP}\n")
            out.flush()
            continue
        prompt_tokens = session.turn_tokens(text)
        gen = _stream_answer(ring, prompt_tokens, out, temperature=temperature,
                             max_tokens=max_tokens, spec=spec)
        if gen is None:
            continue
        last = gen
        session.record(text, prompt_tokens, gen, _eog_of(ring, gen))
        out.write("\n" + stats_line(gen) + "\n")
        out.flush()


def _stream_answer(ring: Ring, prompt_tokens: list[int], out: TextIO, **kwargs) -> Generation | None:
    """Stream one answer; Ctrl-C cancels it at the next lap and keeps what was shown."""
    cancel = threading.Event()
    pieces: queue.Queue = queue.Queue()
    done = object()
    holder: dict[str, object] = {}

    def work() -> None:
        try:
            stream = ring.stream_tokens(prompt_tokens, cancel=cancel, **kwargs)
            for piece in stream:
                pieces.put(piece)
            holder["gen"] = stream.result
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
            out.write(item)
            out.flush()
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
        out.write(" [stopped]")
    if "error" in holder:
        out.write(f"\n(error: {holder['error']})\n")
        return None
    return holder.get("gen")  # type: ignore[return-value]
