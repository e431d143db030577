"""The compute devices the linked llama.cpp sees, from ggml's own backend device registry.

``ggml_backend_dev_count/get/name/description/type/memory`` are C functions of the libggml
that llama-cpp-python ships (the copy llama.cpp itself uses), bound here with ctypes. A
CPU-only build lists the CPU alone; a Vulkan, CUDA or Metal build adds its GPUs with their
free and total memory as the backend reports them (CUDA: ``cudaMemGetInfo``; Vulkan: the
device-local heaps and, where the driver has the memory-budget extension, what is left of them).

Vulkan hides devices of type CPU (Mesa's lavapipe) unless ``GGML_VK_VISIBLE_DEVICES`` names
them: ``GGML_VK_VISIBLE_DEVICES=0`` before the first call makes lavapipe a device.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

#: ``enum ggml_backend_dev_type`` in ggml-backend.h, in order.
KINDS = ("cpu", "gpu", "igpu", "accel", "meta")


@dataclass(frozen=True)
class Device:
    """One ggml backend device."""

    name: str  # ggml's device name: "CPU", "Vulkan0", "CUDA0", "MTL0"
    description: str  # the hardware: "NVIDIA GeForce RTX 3060", "llvmpipe (LLVM 15.0.6, 256 bits)"
    kind: str  # one of KINDS
    free: int  # bytes free, as the backend reports them
    total: int  # bytes in all

    @property
    def offloads(self) -> bool:
        """Whether llama.cpp offloads layers to it (``n_gpu_layers``): GPUs, integrated or not."""
        return self.kind in ("gpu", "igpu")

    @property
    def unified(self) -> bool:
        """Whether its memory is the host's RAM, so that RAM and device are one pool: an
        integrated GPU, Apple silicon, or a software device running on the CPU (Mesa's
        llvmpipe / lavapipe, which reports host memory as its heap). A Jetson's GPU says it
        is a discrete one: ``edgespec.node.info.unified_memory`` tells those boards apart."""
        if self.kind == "igpu" or sys.platform == "darwin":
            return True
        return "llvmpipe" in self.description.lower()

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "kind": self.kind,
                "free": self.free, "total": self.total, "unified": self.unified}


@lru_cache(maxsize=1)
def _lib() -> Any:
    import llama_cpp

    from edgespec.llm.llamacpp import _ensure_backend

    _ensure_backend()  # llama.cpp's log goes through edgespec's (quiet unless verbose) first

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    found = sorted(lib_dir.glob("libggml.so*")) + sorted(lib_dir.glob("libggml.dylib")) \
        + sorted(lib_dir.glob("ggml.dll"))
    if not found:
        raise OSError(f"libggml not found in {lib_dir}")
    lib = ctypes.CDLL(str(found[0]))
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.ggml_backend_dev_count.restype = sz
    lib.ggml_backend_dev_count.argtypes = []
    lib.ggml_backend_dev_get.restype = vp
    lib.ggml_backend_dev_get.argtypes = [sz]
    for fn in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
        fn.restype = ctypes.c_char_p
        fn.argtypes = [vp]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [vp]
    lib.ggml_backend_dev_memory.restype = None
    lib.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]
    return lib


def list_devices() -> list[Device]:
    """Every device of the linked llama.cpp's backends, in registry order (GPUs first, as
    llama.cpp offloads to them, the CPU last). Free memory is read at each call."""
    lib = _lib()
    out = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = int(lib.ggml_backend_dev_type(dev))
        out.append(Device(
            name=(lib.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
            description=(lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace"),
            kind=KINDS[kind] if 0 <= kind < len(KINDS) else "other",
            free=int(free.value), total=int(total.value)))
    return out


def offload_devices() -> list[Device]:
    """The devices llama.cpp offloads layers to (``n_gpu_layers``); empty on a CPU build and
    where the build's backend finds no device."""
    try:
        return [d for d in list_devices() if d.offloads]
    except (OSError, AttributeError):  # a llama.cpp too old to have the device registry
        return []


def backend_of(device: Device | None) -> str:
    """'cpu', or the backend a device belongs to ('vulkan', 'cuda', 'metal', 'rocm', 'sycl',
    'gpu'), from ggml's device name."""
    if device is None:
        return "cpu"
    name = device.name.lower()
    for prefix, backend in (("vulkan", "vulkan"), ("cuda", "cuda"), ("rocm", "rocm"),
                            ("hip", "rocm"), ("mtl", "metal"), ("metal", "metal"),
                            ("sycl", "sycl")):
        if name.startswith(prefix):
            return backend
    return "gpu"


def software_device() -> bool:
    """Whether llama.cpp offloads to a software Vulkan device (Mesa's llvmpipe / lavapipe)."""
    found = offload_devices()
    return bool(found) and "llvmpipe" in found[0].description.lower()
