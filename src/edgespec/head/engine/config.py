"""The engine's settings (``EngineConfig``): typed and checked once, where a ring is built
(``Ring.local``/``up``/``attach`` take them as keywords, ``edgespec.head.build`` passes the
object on unchanged)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    """``budget``: a fixed tree budget (drafted nodes per step, every step a tree; None:
    ``TreePolicy`` decides); ``segments``: flow spreads a fixed budget over this many
    segments (None: one per stage); ``max_depth``: the deepest a drafted path may go;
    ``prefill_chunk``: prompt tokens per prefill batch."""

    budget: int | None = None
    segments: int | None = None
    max_depth: int = 12
    prefill_chunk: int = 256

    def __post_init__(self) -> None:
        for name in ("budget", "segments"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or None), got {v!r}")
        for name in ("max_depth", "prefill_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")

    @classmethod
    def take(cls, kwargs: dict[str, Any], base: EngineConfig | None = None) -> EngineConfig:
        """An ``EngineConfig`` from the engine settings among ``kwargs`` (removed from it),
        over ``base``."""
        names = {f.name for f in dataclasses.fields(cls)}
        found = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        return dataclasses.replace(base or cls(), **found)
