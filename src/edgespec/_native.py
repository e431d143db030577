"""The compiled C++ core, imported in one place so that a missing build says what to do.

Running from a source checkout (``PYTHONPATH=src`` or a copy of the tree) finds these Python
files but not ``_core``, which only the build produces; the ImportError then names the fix in
one line instead of a bare "cannot import name '_core'".
"""

from __future__ import annotations

from pathlib import Path

try:
    from edgespec import _core as core
except ImportError as exc:  # pragma: no cover - exercised by tests/test_packaging.py
    _here = Path(__file__).resolve().parent
    raise ImportError(
        f"edgespec's C++ core is not built in {_here} (this is a source tree); install the "
        f"package instead: `pip install .` from the checkout (or `pip install -e .` to develop)"
    ) from exc

__all__ = ["core"]
