"""Text through a loaded model's vocabulary: tokenize, detokenize, render its chat template."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# isort: off
# llm.llamacpp sets OMP_WAIT_POLICY before llama_cpp is first imported (docs/design.md 3.7).
from edgespec.llm.llamacpp import Model
import llama_cpp

# isort: on

__all__ = ["Tokenizer"]


class Tokenizer:
    """Tokenize, detokenize and apply the chat template of a loaded model (vocab-only is enough)."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.vocab = model.vocab
        self.n_vocab = model.n_vocab
        self.bos_id: int = llama_cpp.llama_vocab_bos(self.vocab)
        self.eos_id: int = llama_cpp.llama_vocab_eos(self.vocab)
        self.add_bos: bool = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> token ids. ``add_special`` adds BOS when the model asks for it;
        ``parse_special`` turns special-token text (``<|im_start|>``) into its id."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
            if n < 0:
                raise RuntimeError(f"tokenization failed for {text[:40]!r}")
        return list(buf[:n])

    def piece(self, token: int, special: bool = True) -> bytes:
        """The bytes one token stands for (may be a partial UTF-8 sequence)."""
        self._check_ids([token])
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def decode(self, ids: Sequence[int], remove_special: bool = False, unparse_special: bool = False) -> str:
        """Token ids -> text (invalid UTF-8 replaced)."""
        ids = list(ids)
        if not ids:
            return ""
        self._check_ids(ids)
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        cap = 16 * len(ids) + 16
        buf = ctypes.create_string_buffer(cap)
        n = llama_cpp.llama_detokenize(self.vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
        if n < 0:
            cap = -n + 1
            buf = ctypes.create_string_buffer(cap)
            n = llama_cpp.llama_detokenize(self.vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ``<|im_end|>``...)."""
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def chat_prompt(
        self,
        messages: Iterable[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` ([{"role":..., "content":...}]) with the model's chat template
        through llama-cpp-python's Jinja2 formatter (as ``Llama.create_chat_completion`` does).
        ``tools``: OpenAI's tool list, handed to the template as its ``tools`` (a template
        that takes them lists them in the prompt; messages may then carry ``tool_calls`` and
        role ``tool``, see ``edgespec.head.tools``)."""
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        tmpl = template or self.model.chat_template()
        if not tmpl:
            raise ValueError(f"{self.model.path} has no chat template; pass template=")
        bos = self.piece(self.bos_id).decode("utf-8", errors="replace") if self.bos_id >= 0 else ""
        eos = self.piece(self.eos_id).decode("utf-8", errors="replace") if self.eos_id >= 0 else ""
        formatter = Jinja2ChatFormatter(tmpl, eos_token=eos, bos_token=bos,
                                        add_generation_prompt=add_generation_prompt)
        return formatter(messages=[dict(m) for m in messages],  # type: ignore[arg-type]
                         tools=None if tools is None else [dict(t) for t in tools]).prompt

    def chat_tokens(
        self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat prompt (the template writes its own special tokens)."""
        prompt = self.chat_prompt(messages, add_generation_prompt, tools=tools)
        return self.encode(prompt, add_special=False, parse_special=True)

    def _check_ids(self, ids: Sequence[int]) -> None:
        for t in ids:
            if not 0 <= int(t) < self.n_vocab:
                raise ValueError(f"token id {t} outside the vocabulary (0..{self.n_vocab - 1})")
