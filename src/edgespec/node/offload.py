"""What a node offloads to its GPU: the device it reports, and per window the layers that fit.

A node reports its backend, its offload device (ggml's name and the hardware's description) and
that device's free and total memory (:mod:`edgespec.llm.devices`). Where the device's memory
is the host's RAM (``Device.unified``) the node reports one pool: its RAM, with no separate
device figure, so nothing is counted twice.

By default (``--n-gpu-layers`` not given) each window offloads the layers that fit in the
device's free memory: every layer takes its weights and its KV cache at the window's
``n_ctx`` (``llm.layer_memory``), the device keeps ``RESERVE`` of its free memory for compute
buffers and allocator slack, and a window whose layers all fit also offloads its output layer
(the head) when that fits too. llama.cpp offloads a window's *last* layers: a partly offloaded
window runs its first layers on the CPU, then the rest on the device. A software device (Mesa's
lavapipe: Vulkan on the CPU, 45x slower per layer than llama.cpp's CPU backend on the 0.5B
here) is used only when ``--n-gpu-layers`` asks for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("edgespec.node")

#: The share of a device's free memory that offloaded layers may fill: the rest holds
#: llama.cpp's compute buffers on the device (WINDOW_OVERHEAD-sized) and the allocator's slack.
RESERVE = 0.9

#: ``n_gpu_layers`` meaning every layer of a window and its output layer.
ALL_LAYERS = 999


@dataclass(frozen=True)
class DeviceReport:
    """What a node says of its compute device (health and profile answers, ``ring status``)."""

    backend: str  # "cpu", "vulkan", "cuda", "metal", ...
    device: str | None  # "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits)"; None on the CPU
    free_vram: int | None  # bytes free on a discrete device; None: none, or unified memory
    total_vram: int | None
    unified: bool  # the device's memory is the RAM the node reports (one pool)

    @property
    def software(self) -> bool:
        """A software device (lavapipe): the CPU behind a GPU API, slower than the CPU backend."""
        return self.device is not None and "llvmpipe" in self.device.lower()

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "device": self.device, "free_vram": self.free_vram,
                "total_vram": self.total_vram, "unified": self.unified}


def device_report() -> DeviceReport:
    """This node's first offload device, as llama.cpp's backend sees it now."""
    from edgespec.llm import devices
    from edgespec.node.info import unified_memory

    found = devices.offload_devices()
    if not found:
        return DeviceReport("cpu", None, None, None, False)
    d = found[0]
    label = f"{d.name}: {d.description}" if d.description else d.name
    if d.unified or unified_memory():
        return DeviceReport(devices.backend_of(d), label, None, None, True)
    return DeviceReport(devices.backend_of(d), label, d.free, d.total, False)


def layers_that_fit(layer_bytes: list[int], head_bytes: int, free: int,
                    reserve: float = RESERVE) -> int:
    """``n_gpu_layers`` for a window whose layers take ``layer_bytes`` (weights + KV, in layer
    order) on a device with ``free`` bytes: as many of its last layers as fit in
    ``reserve * free``, plus its output layer (``len + 1``) when every layer and the head fit."""
    room = int(free * reserve)
    n = 0
    for b in reversed(layer_bytes):  # llama.cpp offloads the last layers first
        if b > room:
            break
        room -= b
        n += 1
    if n == len(layer_bytes) and head_bytes <= room:
        return n + 1
    return n


def choose_gpu_layers(path: str | Path, n_ctx: int, requested: int | None,
                      report: DeviceReport | None = None) -> tuple[int, str]:
    """``(n_gpu_layers, why)`` for loading the window file ``path`` at ``n_ctx`` cells:
    ``requested`` when given (``--n-gpu-layers``), 0 without an offload device, else what
    fits (``layers_that_fit``; on unified memory every layer: the pool is the RAM the plan
    already counted the window against)."""
    report = report or device_report()
    if requested is not None:
        return requested, f"--n-gpu-layers {requested}"
    if report.device is None:
        return 0, "no GPU device: every layer on the CPU"
    if report.software:
        return 0, f"{report.device} is a software device: every layer on the CPU"
    from edgespec.llm.layer_memory import model_memory

    mem = model_memory(path)
    if report.unified:
        return ALL_LAYERS, f"all {mem.n_layer} layers on {report.device} (unified memory)"
    per_layer = [mem.layer_bytes(i, n_ctx) for i in range(mem.n_layer)]
    n = layers_that_fit(per_layer, mem.head_bytes or mem.embd_bytes, report.free_vram or 0)
    shown = min(n, mem.n_layer)
    return n, (f"{shown} of {mem.n_layer} layers on {report.device} "
               f"({(report.free_vram or 0) / 2**30:.1f} GiB free, KV at n_ctx={n_ctx} "
               f"included)" + (" and its output layer" if n > mem.n_layer else ""))


def profile_gpu_layers(requested: int | None, report: DeviceReport | None = None) -> int:
    """``n_gpu_layers`` for the node's speed profile: what the node would offload (all of
    the profiled window's few layers where there is a device), so the plan weighs the node at
    its offloaded speed."""
    if requested is not None:
        return requested
    report = report or device_report()
    return 0 if report.device is None or report.software else ALL_LAYERS


def offload_summary(requested: int | None, report: DeviceReport | None = None) -> str:
    """One line for ``edgespec node``'s start: the device found and what the node offloads."""
    report = report or device_report()
    if report.device is None:
        return "no GPU device (llama.cpp backend: cpu): every layer on the CPU"
    pool = ("unified with RAM" if report.unified else
            f"{(report.free_vram or 0) / 2**30:.1f} of {(report.total_vram or 0) / 2**30:.1f} "
            f"GiB free")
    if requested is None and report.software:
        return (f"{report.backend} device {report.device}, a software device: every layer on "
                f"the CPU (--n-gpu-layers L offloads to it anyway)")
    what = (f"--n-gpu-layers {requested} per window" if requested is not None
            else "the layers of each window that fit, with their KV cache (--n-gpu-layers "
                 "overrides)")
    return f"{report.backend} device {report.device}, {pool}; offloading {what}"
