"""How a head serves its ring (``HeadConfig``): the speculative mode requests get by default,
the drafter, slots and queue, and the engine's settings. Typed and checked once, at the edge
(``Ring.local``/``up``/``attach`` take these as keywords and build one), then passed as one
object to ``edgespec.head.build``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from edgespec.head.engine.config import EngineConfig
from edgespec.head.engine.registry import AUTO, SPEC_MODES

DRAFTERS = ("auto", "retrieval", "model", "hybrid")
DRAFT_QUANTS = ("q4_0", "none")


@dataclass(frozen=True)
class HeadConfig:
    """``spec``: the mode of requests that name none; ``draft``: a draft model (same
    tokenizer; without one the head drafts by retrieval); ``drafter``: "auto" (the draft model
    when given, else retrieval), "retrieval", "model", "hybrid"; ``draft_quant``: "q4_0" (draft
    with a cached Q4_0 copy: faster on CPUs, never changes the output) or "none";
    ``parallel``: requests served at once (slots); ``max_queue``: requests that may wait for
    a slot (None: any number); ``engine``: the engine's settings."""

    spec: str = AUTO
    draft: str | os.PathLike[str] | None = None
    drafter: str = "auto"
    draft_quant: str = "q4_0"
    parallel: int = 1
    max_queue: int | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.spec not in SPEC_MODES:
            raise ValueError(f"spec must be one of {', '.join(SPEC_MODES)}, got {self.spec!r}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got "
                             f"{self.drafter!r}")
        if self.draft_quant not in DRAFT_QUANTS:
            raise ValueError(f"draft_quant must be one of {', '.join(DRAFT_QUANTS)}, got "
                             f"{self.draft_quant!r}")
        if isinstance(self.parallel, bool) or not isinstance(self.parallel, int) \
                or self.parallel < 1:
            raise ValueError(f"parallel must be an integer >= 1, got {self.parallel!r}")
        if self.max_queue is not None and (isinstance(self.max_queue, bool)
                                           or not isinstance(self.max_queue, int)
                                           or self.max_queue < 0):
            raise ValueError(f"max_queue must be an integer >= 0 (or None), got "
                             f"{self.max_queue!r}")

    @classmethod
    def take(cls, kwargs: dict[str, Any], **given: Any) -> HeadConfig:
        """A ``HeadConfig`` from ``given`` and the head's and engine's settings among
        ``kwargs`` (removed from it; what is left is the caller's to use or refuse)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"engine"}
        fields = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        return cls(**given, **fields, engine=EngineConfig.take(kwargs))
