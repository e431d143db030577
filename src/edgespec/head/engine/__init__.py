"""The speculative engine on the head (docs/design.md 2, 6): ``runner`` (``SpecEngine``: its
lifecycle, prefill and the tree operations the modes share), one file per mode (``none``,
``sync``, ``flow``), the ``cost`` model that sizes trees, ``gain`` (is speculation paying
now?), ``stats`` (``GenerationStats``) and ``inflight`` (``TreeInFlight``: one tree in
flight)."""

from edgespec.head.engine.runner import MODES, SpecEngine
from edgespec.head.engine.stats import GenerationStats

__all__ = ["MODES", "GenerationStats", "SpecEngine"]
