"""edgespec: one GGUF model across several home-lab devices, as a piped ring of layer ranges
with speculative decoding built into the pipeline.

Importing the package is cheap: llama.cpp, zeroconf and the C++ core load only in the modules
that need them.
"""

from __future__ import annotations

__version__ = "0.1.0"
PROTOCOL_VERSION = 1

__all__ = ["__version__", "PROTOCOL_VERSION"]
