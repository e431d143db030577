"""One request's generation settings (``GenerationParams``), checked once where the request
enters (the HTTP server's request models, the chat CLI, Python's ``Ring`` methods) and carried
unchanged to the engine. A value that passed the constructor is valid for every ring; what
depends on the ring (the context left after the prompt, the speculative modes it can run, the
vocabulary) is checked once more by ``Ring.prepare``, which fits ``max_tokens`` to the context.

The server, the chat CLI and the head import it; it imports errors, the sampling fields
(``edgespec.sampling``) and the names of the speculative modes
(``edgespec.head.engine.registry``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edgespec import sampling as fields
from edgespec.errors import RequestError
from edgespec.grammar import Grammar
from edgespec.head.engine.registry import SPEC_MODES
from edgespec.sampling import SamplerSettings


def _number(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    if kind is int and value != int(value):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    return kind(value)


@dataclass(frozen=True)
@fields.with_fields
class GenerationParams:
    """How to generate: sampling, stop strings, limits and the speculative mode. Frozen and
    checked on construction (``RequestError`` naming the field), so one that exists is valid.

    The sampler chain's fields (``edgespec.sampling.FIELDS``: ``temperature``, ``top_p``,
    ``seed``, the penalties, ...; ``edgespec chat --help`` lists them) are fields of this
    class too, with the table's defaults and bounds (temperature 0: greedy)."""

    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    spec: str | None = None  # None: the ring's default mode
    ignore_eos: bool = False  # go on past end-of-generation to max_tokens (benchmarks)
    #: Added to the logits of these token ids before every draw (OpenAI's ``logit_bias``: -100
    #: bans a token, +100 forces it); a mapping of ids (ints or their decimal strings) to
    #: values in [-100, 100], kept as sorted (id, value) pairs.
    logit_bias: Any = ()
    #: None: no log probabilities; n in 0..20: each token's, and the n most likely tokens'
    #: there (``Generation.logprobs``), from the distribution the last stage draws from.
    logprobs: int | None = None
    #: What the text must match (``edgespec.grammar.Grammar``: a JSON schema, any JSON
    #: object, a Lark grammar or a regex); None: free text.
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the fields once, here
        for knob in fields.FIELDS:
            set_(self, knob.name, knob.check(getattr(self, knob.name)))
        set_(self, "seed", self.seed % (1 << 64))
        set_(self, "max_tokens", _number("max_tokens", self.max_tokens, int))
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise RequestError(f"stop must be a string or a list of strings, got {stop!r}",
                               "stop")
        set_(self, "stop", tuple(s for s in stop if s))
        if self.spec is not None and self.spec not in SPEC_MODES:
            raise RequestError(f"spec must be one of {', '.join(SPEC_MODES)}, got "
                               f"{self.spec!r}", "spec")
        set_(self, "ignore_eos", bool(self.ignore_eos))
        set_(self, "logit_bias", fields.check_bias(self.logit_bias))
        if self.logprobs is not None:
            set_(self, "logprobs", fields.check_logprobs(self.logprobs))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise RequestError(f"grammar must be an edgespec.grammar.Grammar, got "
                               f"{type(self.grammar).__name__}", "grammar")

    @classmethod
    def of(cls, params: GenerationParams | None = None, **fields: Any) -> GenerationParams:
        """``params`` with ``fields`` replaced (or new params from ``fields``); TypeError
        names a field that does not exist. What the text must match may also be given as
        ``json_schema`` (a dict or its JSON), ``response_format`` (OpenAI's), ``regex`` or
        ``lark``: each becomes the ``grammar``."""
        shapes = {"json_schema": Grammar.json_schema, "response_format":
                  Grammar.from_response_format, "regex": Grammar.regex, "lark": Grammar.lark}
        given = [k for k in (*shapes, "grammar") if fields.get(k) is not None]
        if len(given) > 1:
            raise RequestError(f"give one of {', '.join(given)}: each sets what the text must "
                               "match", given[1])
        for key, make in shapes.items():
            if key in fields:
                value = fields.pop(key)
                if value is not None:
                    fields["grammar"] = make(value, param=key)
        if unknown := set(fields) - {f.name for f in dataclasses.fields(cls)}:
            raise TypeError(f"unexpected arguments: {sorted(unknown)}")
        if params is None:
            return cls(**fields)
        return dataclasses.replace(params, **fields) if fields else params

    def replace(self, **fields: Any) -> GenerationParams:
        return dataclasses.replace(self, **fields)

    @property
    def sampling(self) -> SamplerSettings:
        """What the last stage's sampler chain draws with (``edgespec.node.sampler``)."""
        return SamplerSettings(tuple((k.name, getattr(self, k.name)) for k in fields.FIELDS),
                               self.logit_bias, -1 if self.logprobs is None else self.logprobs,
                               None if self.grammar is None else self.grammar.text)
