"""Constrained output: what a request's text must match (``Grammar``), and the llguidance
matchers that hold a text's place in it (docs/design.md 6.10).

A ``Grammar`` is made where a request enters (``response_format``, ``json_schema=``, a forced
tool call) and travels to the last stage as llguidance's grammar text; the last stage masks
every wanted row's logits with the tokens the grammar allows after that row's own path
(``edgespec.node.sampler``), so a drafted row is accepted only where the constrained target
would draw it. The head keeps a matcher of its own for the text accepted so far, to draft the
tokens the grammar forces (``edgespec.drafters.constrained``).

llguidance rather than xgrammar: both are on the package index, but xgrammar needs torch,
transformers and triton (gigabytes, wrong for a Jetson or a laptop in a ring), while
llguidance is one small wheel without dependencies, reads a llama.cpp vocabulary directly,
and its matchers roll back token by token, which a tree's branches need.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance

from edgespec.errors import RequestError

#: Bytes of grammar text one request may carry (it rides in every batch's META).
MAX_GRAMMAR_BYTES = 64 * 1024


@dataclass(frozen=True)
class Grammar:
    """What the generated text must match: ``kind`` (``json_schema``, ``json_object``,
    ``lark``, ``gbnf``, ``regex``), the ``source`` as given, and ``text``, llguidance's grammar that the
    last stage compiles. ``param``: the request field it came from, named by its errors."""

    kind: str
    source: str
    text: str
    param: str = field(default="grammar", compare=False)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, param: str = "json_schema"
                    ) -> Grammar:
        """Text that is one JSON value valid against ``schema`` (a dict or its JSON text),
        with whitespace between tokens as the model writes it (llguidance's default)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise RequestError(f"{param}: the schema is not valid JSON ({e})", param) from None
        if not isinstance(schema, Mapping):
            raise RequestError(f"{param}: a JSON schema must be an object, got "
                               f"{type(schema).__name__}", param)
        source = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        return cls._made("json_schema", source, llguidance.LLMatcher.grammar_from_json_schema,
                         param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> Grammar:
        """Text that is one JSON object (any keys and values)."""
        return cls._made("json_object", '{"type":"object"}',
                         llguidance.LLMatcher.grammar_from_json_schema, param)

    @classmethod
    def lark(cls, source: str, param: str = "grammar") -> Grammar:
        """A Lark grammar in llguidance's dialect (``%json {...}`` embeds a schema)."""
        return cls._made("lark", source, llguidance.LLMatcher.grammar_from_lark, param)

    @classmethod
    def gbnf(cls, source: str, param: str = "grammar") -> Grammar:
        """A grammar in llama.cpp's GBNF (llama-server's ``grammar``; ``root`` is the start),
        translated to llguidance's Lark by llguidance."""
        from llguidance.gbnf_to_lark import gbnf_to_lark

        if not isinstance(source, str):
            raise RequestError(f"{param}: a GBNF grammar must be text", param)
        try:
            lark = gbnf_to_lark(source)
        except Exception as e:  # noqa: BLE001 - the translator raises plain Exception too
            raise RequestError(f"{param}: not a GBNF grammar: {e}", param) from None
        made = cls.lark(lark, param)
        return cls("gbnf", source, made.text, param)

    @classmethod
    def regex(cls, source: str, param: str = "regex") -> Grammar:
        """Text that matches the regular expression ``source`` whole (Rust regex syntax)."""
        return cls._made("regex", source, llguidance.LLMatcher.grammar_from_regex, param)

    @classmethod
    def from_response_format(cls, value: Any, param: str = "response_format"
                             ) -> Grammar | None:
        """OpenAI's ``response_format``: ``{"type": "text"}`` (None), ``{"type":
        "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name": ...,
        "schema": {...}, "strict": ...}}`` (a schema is always followed strictly here)."""
        if value is None:
            return None
        if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
            raise RequestError(f"'{param}' must be an object with a 'type': text, json_object "
                               "or json_schema", param)
        kind = value["type"]
        extra = set(value) - {"type", "json_schema"}
        if extra or (kind != "json_schema" and "json_schema" in value):
            raise RequestError(f"'{param}': unexpected key "
                               f"{sorted(extra or {'json_schema'})[0]!r}", param)
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object(param)
        if kind != "json_schema":
            raise RequestError(f"'{param}.type' must be text, json_object or json_schema, got "
                               f"{kind!r}", param)
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise RequestError(f"'{param}.json_schema' must be an object with a 'name' and a "
                               "'schema'", param)
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise RequestError(f"'{param}.json_schema': unexpected key {sorted(unknown)[0]!r}",
                               param)
        if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
            raise RequestError(f"'{param}.json_schema.strict' must be true or false", param)
        return cls.json_schema(spec.get("schema", {}), param)

    @classmethod
    def _made(cls, kind: str, source: Any, to_text: Any, param: str) -> Grammar:
        if not isinstance(source, str):
            raise RequestError(f"{param}: the grammar must be text, got "
                               f"{type(source).__name__}", param)
        if len(source.encode()) > MAX_GRAMMAR_BYTES:
            raise RequestError(f"{param}: the grammar is longer than {MAX_GRAMMAR_BYTES} bytes",
                               param)
        text = to_text(source)
        # Errors that need no vocabulary (a bad schema, an undefined rule) are the caller's,
        # here; the rest when the ring checks it against its vocabulary (``check``).
        error = llguidance.LLMatcher.validate_grammar(text)
        if error:
            raise RequestError(f"{param}: {error.strip()}", param)
        return cls(kind, source, text, param)

    def check(self, tokenizer: llguidance.LLTokenizer) -> None:
        """RequestError naming ``param`` if the grammar does not compile for this vocabulary."""
        error = llguidance.LLMatcher.validate_grammar(self.text, tokenizer)
        if error:
            raise RequestError(f"{self.param}: {error.strip()}", self.param)


# ------------------------------------------------------------------------- vocabularies

_tokenizers_lock = threading.Lock()


def vocab_tokenizer(model: Any) -> llguidance.LLTokenizer:
    """llguidance's view of a loaded llama.cpp model's vocabulary (``edgespec.llm.llamacpp.
    Model``; a vocabulary-only load is enough), as wide as its logits, ending at any of its
    end-of-generation tokens. Made once per model object (about 0.7 s for 152k tokens) and
    kept on it: it calls into the model's vocabulary, so it lives and dies with that model
    (``Model.close`` drops it), never with another load of the same file."""
    with _tokenizers_lock:
        tok = getattr(model, "guidance", None)
        if tok is None:
            import llama_cpp
            from llguidance.llamacpp import lltokenizer_from_vocab

            vocab = model.vocab if not getattr(model, "closed", False) else None
            if vocab is None:
                raise ValueError(f"model {model.path} is closed")
            ends = [t for t in range(model.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
            with warnings.catch_warnings():  # it reads each token's attributes through a
                warnings.simplefilter("ignore", DeprecationWarning)  # deprecated alias
                tok = lltokenizer_from_vocab(vocab, n_vocab=model.n_vocab, eos_token=ends)
            model.guidance = tok
        return tok


class Follower:
    """A matcher that follows a text token by token and moves to any other text by rolling
    back to the common prefix (llguidance keeps the matcher's history for that).

    ``move(tokens)`` puts it after ``tokens`` and returns how many of them the grammar
    allowed (fewer: the matcher stands after that many, and the text is outside the
    grammar from there)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        error = self.matcher.get_error()
        if error:
            raise ValueError(f"grammar does not compile: {error}")
        self.text: list[int] = []  # the tokens consumed, in order

    def move(self, tokens: Sequence[int]) -> int:
        keep, limit = 0, min(len(self.text), len(tokens))
        while keep < limit and self.text[keep] == tokens[keep]:
            keep += 1
        if keep < len(self.text):
            self.matcher.rollback(len(self.text) - keep)
            del self.text[keep:]
        rest = [int(t) for t in tokens[keep:]]
        if rest:
            took = self.matcher.try_consume_tokens(rest)
            self.text.extend(rest[:took])
        return len(self.text)

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (none where it leaves a choice)."""
        return list(self.matcher.compute_ff_tokens())
