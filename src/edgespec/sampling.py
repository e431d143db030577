"""A request's sampling settings, each field defined once (docs/design.md 6.11).

``FIELDS`` is the one table of the sampler chain's numeric fields: name, type, default
(which is also the value that asks for nothing), bounds and help. Everything a user meets is
generated from it: ``GenerationParams``'s fields and their checks, the HTTP request models'
bounds and error messages (``edgespec.server.requests``), the Ollama door's options, the chat
CLI's flags, and the checks a last stage applies to a registration it receives
(``SamplerSettings.from_meta``). The chain that applies them is ``edgespec.node.sampler``.

Adding a field: its row here, its stage in ``edgespec.node.sampler``, and its test against
llama.cpp's own sampler (``tests/test_sampler_chain.py``).

Neutral ground like ``edgespec.batch``: the head, the server, the CLI and the nodes read it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edgespec.errors import RequestError


@dataclass(frozen=True)
class Knob:
    """One numeric field of the sampler chain. ``default`` asks for nothing (the stage is
    skipped); ``low``/``high`` bound it, ``low_open`` excluding ``low``."""

    name: str
    kind: type  # int or float
    default: float | int
    low: float
    high: float
    help: str
    low_open: bool = False
    #: What special values mean, for the help and the error message ("0 = off").
    means: str = ""

    def rule(self) -> str:
        """The bounds in words: "a number in [0, 2]", "an integer >= 0"."""
        what = "an integer" if self.kind is int else "a number"
        lo = "(" if self.low_open else "["
        if self.high >= (1 << 31) - 1:  # no upper bound worth saying
            rel = ">" if self.low_open else ">="
            text = what if self.low <= -(1 << 63) else f"{what} {rel} {_num(self.low)}"
        else:
            text = f"{what} in {lo}{_num(self.low)}, {_num(self.high)}]"
        return f"{text} ({self.means})" if self.means else text

    def check(self, value: Any, param: str | None = None) -> int | float:
        """``value`` as this field's type; ``RequestError`` naming the field otherwise (a
        bool is not a number, a float with a fraction is not an integer)."""
        param = param or self.name
        bad = RequestError(f"{param} must be {self.rule()}, got {value!r}", param)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if not math.isfinite(value) or (self.kind is int and value != int(value)):
            raise bad
        value = self.kind(value)
        if not (self.low < value if self.low_open else self.low <= value) or value > self.high:
            raise bad
        return value

    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


#: Generated tokens llama.cpp's repetition penalties look back over by default.
REPEAT_LAST_N = 64

#: The sampler chain's numeric fields, in the order the chain applies them (llama.cpp's
#: ``common_sampler`` order: penalties, top-k, typical, top-p, min-p, temperature; the draw
#: is seeded). ``edgespec.node.sampler`` has one stage per row.
FIELDS: tuple[Knob, ...] = (
    Knob("repeat_penalty", float, 1.0, 0.0, 10.0, low_open=True, means="1 = off",
         help="divide a positive logit (multiply a negative one) of every token in the last "
              "repeat_last_n generated tokens by it"),
    Knob("frequency_penalty", float, 0.0, -2.0, 2.0,
         help="subtract it from a token's logit once per time it came in the last "
              "repeat_last_n generated tokens"),
    Knob("presence_penalty", float, 0.0, -2.0, 2.0,
         help="subtract it from a token's logit if it came in the last repeat_last_n "
              "generated tokens"),
    Knob("repeat_last_n", int, REPEAT_LAST_N, -1, 1 << 20,
         means="-1 = the whole answer, 0 = no penalties",
         help="how many of the last generated tokens the three penalties look at"),
    Knob("top_k", int, 0, 0, (1 << 31) - 1, means="0 = off",
         help="keep only the k most likely tokens"),
    Knob("typical_p", float, 1.0, 0.0, 1.0, low_open=True, means="1 = off",
         help="locally typical sampling: keep the tokens whose surprise is closest to the "
              "distribution's entropy, up to this probability mass"),
    Knob("top_p", float, 1.0, 0.0, 1.0, low_open=True, means="1 = off",
         help="nucleus sampling: keep the most likely tokens up to this probability mass"),
    Knob("min_p", float, 0.0, 0.0, 1.0, means="0 = off",
         help="keep the tokens at least this fraction as likely as the most likely one"),
    Knob("temperature", float, 0.0, 0.0, 2.0, means="0 = greedy",
         help="divide the logits by it before the draw; 0 takes the most likely token"),
    Knob("seed", int, 0, -(1 << 63), (1 << 64) - 1, means="any 64-bit integer",
         help="the draw at each position comes from this seed, so the same request gives "
              "the same answer in every mode"),
)

BY_NAME: dict[str, Knob] = {k.name: k for k in FIELDS}

#: Other sampling limits: tokens one request may bias (OpenAI allows 300), the largest bias
#: magnitude (-100 bans a token, +100 forces it), alternatives ``logprobs`` may ask for.
MAX_BIASED_TOKENS = 300
MAX_BIAS = 100.0
MAX_TOP_LOGPROBS = 20
#: The largest grammar text a last stage takes in a registration (llguidance's grammar).
MAX_GRAMMAR = 1 << 20
#: The most generated tokens a registration may carry (a replayed answer's text so far).
MAX_TEXT = 1 << 17


def with_fields(cls: type) -> type:
    """Class decorator (under ``@dataclass``): add every ``FIELDS`` row as a field with its
    default, so a dataclass takes them by name (``GenerationParams(min_p=0.05)``)."""
    notes = dict(cls.__dict__.get("__annotations__", {}))
    for k in FIELDS:
        notes[k.name] = k.kind.__name__
        setattr(cls, k.name, k.default)
    cls.__annotations__ = notes
    return cls


def add_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One CLI flag per field (``--min-p``), checked by the field's own bounds; None when
    not given (the defaults belong to ``GenerationParams``)."""
    for k in FIELDS:
        if k.name in skip:
            continue

        def parse(text: str, k: Knob = k) -> int | float:
            try:
                value = k.kind(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"must be {k.rule()}") from None
            try:
                return k.check(value, k.flag())
            except RequestError as e:
                raise argparse.ArgumentTypeError(f"must be {k.rule()}") from e

        parser.add_argument(k.flag(), type=parse, default=None, metavar="N" if k.kind is int
                            else "X", help=f"{k.help}; {k.rule()} (default {_num(k.default)})")


def given_flags(args: argparse.Namespace) -> dict[str, int | float]:
    """The fields given on the command line (``add_flags``)."""
    return {k.name: v for k in FIELDS if (v := getattr(args, k.name, None)) is not None}


@dataclass(frozen=True)
class SamplerSettings:
    """All of one request's sampling, as a last stage registers it (``edgespec.node.sampler``):
    the ``FIELDS`` values (read as attributes: ``settings.top_p``), the logit bias as sorted
    (token, value) pairs, ``logprobs`` (-1: none; n: the target's and the n most likely) and
    the grammar text (llguidance's) or None."""

    values: tuple[tuple[str, int | float], ...] = ()
    bias: tuple[tuple[int, float], ...] = ()
    logprobs: int = -1
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = dict(self.values)
        if unknown := set(given) - set(BY_NAME):
            raise ValueError(f"unknown sampling fields {sorted(unknown)}")
        full = {k.name: k.check(given.get(k.name, k.default)) for k in FIELDS}
        full["seed"] = int(full["seed"]) % (1 << 64)
        object.__setattr__(self, "values", tuple(full.items()))
        object.__setattr__(self, "_by_name", full)  # the chain reads fields on every draw

    def __getattr__(self, name: str) -> Any:
        if name in BY_NAME:
            return self._by_name[name]
        raise AttributeError(name)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        s = self
        return s.repeat_last_n != 0 and (s.repeat_penalty != 1.0 or s.frequency_penalty != 0.0
                                         or s.presence_penalty != 0.0)

    @property
    def follows_text(self) -> bool:
        """Whether a row's distribution depends on the text before it (a grammar, a
        penalty): then the last stage keeps the request's generated text."""
        return self.grammar is not None or self.penalized

    def as_meta(self) -> dict:
        meta: dict[str, Any] = {k: v for k, v in self.values if v != BY_NAME[k].default}
        if self.bias:
            meta["logit_bias"] = [[t, v] for t, v in self.bias]
        if self.logprobs >= 0:
            meta["logprobs"] = self.logprobs
        if self.grammar is not None:
            meta["grammar"] = self.grammar
        return meta

    @classmethod
    def from_meta(cls, meta: Any) -> SamplerSettings:
        """The settings of a received registration, checked as a request's are; ValueError
        names what is wrong."""
        if not isinstance(meta, Mapping):
            raise ValueError("sampling settings must be an object")
        meta = dict(meta)
        try:
            bias = check_bias(meta.pop("logit_bias", None))
            logprobs = meta.pop("logprobs", -1)
            if logprobs != -1:
                logprobs = check_logprobs(logprobs)
            grammar = meta.pop("grammar", None)
            if grammar is not None and (type(grammar) is not str or len(grammar) > MAX_GRAMMAR):
                raise ValueError(f"grammar must be text of at most {MAX_GRAMMAR} characters")
            if unknown := set(meta) - set(BY_NAME):
                raise ValueError(f"unknown sampling fields {sorted(unknown)}")
            values = tuple((k, BY_NAME[k].check(v)) for k, v in meta.items())
        except RequestError as e:
            raise ValueError(str(e)) from None
        return cls(values, bias, logprobs, grammar)


#: The settings that ask for nothing: the plain greedy draw (a batch's key 0, nothing
#: registered at the last stage).
PLAIN_GREEDY = SamplerSettings()


def check_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A logit bias (a mapping of token ids, ints or their decimal strings, to values in
    [-100, 100], or a list of pairs) as sorted (id, value) pairs; ``RequestError`` naming
    ``logit_bias``."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    bad = RequestError(f"logit_bias must map token ids to numbers, got {value!r}", "logit_bias")
    try:
        pairs = list(items)
    except TypeError:
        raise bad from None
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise bad
        token, bias = pair
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 1 << 31:
            raise RequestError(f"logit_bias: {token!r} is not a token id", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise RequestError(f"logit_bias[{token}] must be a number, got {bias!r}",
                               "logit_bias")
        if not abs(bias) <= MAX_BIAS:
            raise RequestError(f"logit_bias[{token}] must be in [-100, 100], got {bias}",
                               "logit_bias")
        out[token] = float(bias)
    if len(out) > MAX_BIASED_TOKENS:
        raise RequestError(f"logit_bias may name at most {MAX_BIASED_TOKENS} tokens, got "
                           f"{len(out)}", "logit_bias")
    return tuple(sorted(out.items()))


def check_logprobs(value: Any) -> int:
    if (isinstance(value, bool) or not isinstance(value, int)
            or not 0 <= value <= MAX_TOP_LOGPROBS):
        raise RequestError(f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS} "
                           f"(alternatives per token), got {value!r}", "logprobs")
    return value

