"""The speculative engine on the head (docs/design.md 2, 6): ``runner`` (``SpecEngine``: a
generation's lifecycle, its prefill and the step operations the modes share), ``mode`` (the
``Mode`` strategy and its ``StepContext``), one file per mode (``none``, ``sync``, ``flow``)
listed in ``registry``, ``policy`` (``TreePolicy``: does a tree pay, how big), with ``cost``
(the cost model that sizes trees) and ``gain`` (the measured gain that decides tree or plain),
``config`` (``EngineConfig``), ``stats`` (``GenerationStats``) and ``inflight``
(``TreeInFlight``: one tree in flight)."""

from edgespec.head.engine.config import EngineConfig
from edgespec.head.engine.registry import MODES, SPEC_MODES
from edgespec.head.engine.runner import SpecEngine
from edgespec.head.engine.stats import GenerationStats

__all__ = ["MODES", "SPEC_MODES", "EngineConfig", "GenerationStats", "SpecEngine"]
