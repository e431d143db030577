"""Chatting over a ring in this process: the conversation's tokens mirror the ring's KV cache, so
a new turn appends only the template text between the previous answer and the new message."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgespec.api import Generation, Ring
from edgespec.chat.terminal import HELP
from edgespec.grammar import Grammar
from edgespec.params import GenerationParams


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
            f"{s.mean_accepted:.2f} tokens/step ({s.mode}), prompt {s.prompt_tokens} tokens, "
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

    def __init__(self, ring: Ring, *, system: str | None, max_tokens: int, spec: str | None,
                 json_schema: dict[str, Any] | None = None, **sampling: float) -> None:
        self.ring = ring
        self.session = ChatSession(ring, system)
        # Checked once here: a bad value ends the command before the ring is asked anything.
        grammar = (None if json_schema is None
                   else Grammar.json_schema(json_schema, param="--json-schema"))
        self.params = GenerationParams(max_tokens=max_tokens, spec=spec, grammar=grammar,
                                       **sampling)
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
        stream = self.ring.stream_tokens(prompt_tokens, self.params, cancel=cancel)
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
