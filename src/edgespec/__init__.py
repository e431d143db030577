"""edgespec: one GGUF model across several home-lab devices, as a piped ring of layer ranges
with speculative decoding built into the pipeline.

Importing the package is cheap: llama.cpp, zeroconf and the C++ core load only in the modules
that need them (``Ring`` is resolved on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from edgespec.api import Generation, Ring

__all__ = ["__version__", "Ring", "Generation"]


def __getattr__(name: str) -> Any:
    if name in ("Ring", "Generation"):
        from edgespec import api

        return getattr(api, name)
    raise AttributeError(f"module 'edgespec' has no attribute {name!r}")
