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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from edgespec.batch import Sampling
from edgespec.errors import RequestError
from edgespec.head.engine.registry import SPEC_MODES


def _number(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    if kind is int and value != int(value):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    return kind(value)


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

    @classmethod
    def of(cls, params: GenerationParams | None = None, **fields: Any) -> GenerationParams:
        """``params`` with ``fields`` replaced (or new params from ``fields``); TypeError
        names a field that does not exist."""
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
                        seed=self.seed)


@dataclass(frozen=True)
class Prepared:
    """A request ``Ring.prepare`` checked against the ring: its prompt ids, its settings with
    ``max_tokens`` fitted to the context (``capped``: the fitted value, when it was cut), and
    the speculative mode it runs in (resolved: never "auto")."""

    prompt: list[int]
    params: GenerationParams
    mode: str
    capped: int | None = None
