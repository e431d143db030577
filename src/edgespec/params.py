"""One request's generation settings (``GenerationParams``), checked once where the request
enters (the HTTP server's request models, the chat CLI, Python's ``Ring`` methods) and carried
unchanged to the engine. A value that passed the constructor is valid for every ring; what
depends on the ring (the context left after the prompt, the speculative modes it can run, the
vocabulary) is checked once more by ``Ring.prepare``, which fits ``max_tokens`` to the context.

The server, the chat CLI and the head import it; it imports errors, the batch's ``Sampling``
and the names of the speculative modes (``edgespec.head.engine.registry``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgespec.batch import MAX_BIASED_TOKENS, Sampling
from edgespec.errors import RequestError
from edgespec.grammar import Grammar
from edgespec.head.engine.registry import SPEC_MODES


def _number(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    if kind is int and value != int(value):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    return kind(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = list(items)
    except TypeError:
        raise RequestError(f"logit_bias must map token ids to numbers, got {value!r}",
                           "logit_bias") from None
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise RequestError(f"logit_bias must map token ids to numbers, got {value!r}",
                               "logit_bias")
        token, bias = pair
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise RequestError(f"logit_bias: {token!r} is not a token id", "logit_bias")
        try:
            bias = _number(f"logit_bias[{token}]", bias, float)
        except RequestError as e:
            raise RequestError(str(e), "logit_bias") from None
        if not abs(bias) <= Sampling.MAX_BIAS:
            raise RequestError(f"logit_bias[{token}] must be in [-100, 100], got {bias}",
                               "logit_bias")
        out[token] = bias
    if len(out) > MAX_BIASED_TOKENS:
        raise RequestError(f"logit_bias may name at most {MAX_BIASED_TOKENS} tokens, got "
                           f"{len(out)}", "logit_bias")
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class GenerationParams:
    """How to generate: sampling, stop strings, limits and the speculative mode. Frozen and
    checked on construction (``RequestError`` naming the field), so one that exists is valid."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # any integer: the sampler takes it modulo 2**64
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
    #: OpenAI's penalties, in [-2, 2]: subtracted from a token's logit once per time it came
    #: in the generated text so far (frequency) and once if it came at all (presence).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    #: llama.cpp's repetition penalty over the last ``Sampling.REPEAT_WINDOW`` generated
    #: tokens: a positive logit divided by it, a negative one multiplied (1 = off).
    repeat_penalty: float = 1.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the fields once, here
        set_(self, "max_tokens", _number("max_tokens", self.max_tokens, int))
        set_(self, "temperature", _number("temperature", self.temperature, float))
        set_(self, "top_p", _number("top_p", self.top_p, float))
        set_(self, "top_k", _number("top_k", self.top_k, int))
        set_(self, "seed", _number("seed", self.seed, int) % (1 << 64))
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}",
                               "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 = off), got {self.top_k}", "top_k")
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
        set_(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.logprobs is not None:
            set_(self, "logprobs", _number("logprobs", self.logprobs, int))
            if not 0 <= self.logprobs <= Sampling.MAX_TOP:
                raise RequestError(f"logprobs must be in 0..{Sampling.MAX_TOP} (alternatives "
                                   f"per token), got {self.logprobs}", "logprobs")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise RequestError(f"grammar must be an edgespec.grammar.Grammar, got "
                               f"{type(self.grammar).__name__}", "grammar")
        for name in ("frequency_penalty", "presence_penalty"):
            value = _number(name, getattr(self, name), float)
            if not abs(value) <= Sampling.MAX_PENALTY:
                raise RequestError(f"{name} must be in [-2, 2], got {value}", name)
            set_(self, name, value)
        set_(self, "repeat_penalty", _number("repeat_penalty", self.repeat_penalty, float))
        if not 0.0 < self.repeat_penalty <= Sampling.MAX_REPEAT_PENALTY:
            raise RequestError(f"repeat_penalty must be in (0, 10] (1 = off), got "
                               f"{self.repeat_penalty}", "repeat_penalty")

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
    def sampling(self) -> Sampling:
        """What the last stage draws with."""
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                        seed=self.seed, bias=self.logit_bias,
                        logprobs=-1 if self.logprobs is None else self.logprobs,
                        grammar=None if self.grammar is None else self.grammar.text,
                        penalties=(self.frequency_penalty, self.presence_penalty,
                                   self.repeat_penalty))


@dataclass(frozen=True)
class Prepared:
    """A request ``Ring.prepare`` checked against the ring: its prompt ids, its settings with
    ``max_tokens`` fitted to the context (``capped``: the fitted value, when it was cut), and
    the speculative mode it runs in (resolved: never "auto")."""

    prompt: list[int]
    params: GenerationParams
    mode: str
    capped: int | None = None
