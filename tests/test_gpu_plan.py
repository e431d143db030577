"""Device memory in the plan and in a node's report (CPU-runnable: the plan is arithmetic over
what nodes report; the report is read from the linked llama.cpp's device registry).

A node with a discrete GPU has two pools: the layers the device holds count against its free
memory, the rest against RAM; a unified-memory device is one pool. Each window offloads, by
default, the layers that fit (node/offload.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from stage_fixtures import tiny_dir, tiny_qwen2  # noqa: F401 - fixtures

from edgespec.head.memory import WINDOW_OVERHEAD, ModelMemory
from edgespec.head.planner import NodeProfile, PlanError, plan_ring
from edgespec.llm import devices
from edgespec.node import offload

MiB = 1 << 20
# 24 layers of 40 MiB weights and 2 KiB of KV per cell (80 MiB per layer at n_ctx 4096).
MEM = ModelMemory([40 * MiB] * 24, [20 * 1024] * 24, 130 * MiB, 0, False, 151936)
N_CTX = 2048  # 80 MiB per layer


def _nodes(b_device: int = 0, b_cap: int | None = None) -> list[NodeProfile]:
    fast = {1: 10.0}
    return [NodeProfile("a", "a", "10.0.0.1", 7654, dict(fast), free_mem=4096 * MiB),
            NodeProfile("b", "b", "10.0.0.2", 7654, dict(fast), free_mem=1024 * MiB,
                        device_mem=b_device, device_layers=b_cap)]


def _layers(plan, node: int) -> int:
    return sum(w.n_layers for w in plan.windows if w.node == node)


def test_a_node_with_a_gpu_is_given_more_layers_than_the_same_node_without() -> None:
    """Equal speeds: without a device node b's RAM caps it below half; its GPU's free memory
    holds layers too, so it takes its speed's share."""
    without = plan_ring(24, 0, _nodes(), memory=MEM, n_ctx=N_CTX, n_seq_max=64)
    with_gpu = plan_ring(24, 0, _nodes(b_device=2048 * MiB), memory=MEM, n_ctx=N_CTX,
                         n_seq_max=64)
    roomy = _nodes()
    roomy[1].free_mem = roomy[0].free_mem  # its speed's share (less the output head it runs)
    share = _layers(plan_ring(24, 0, roomy, memory=MEM, n_ctx=N_CTX, n_seq_max=64), 1)
    assert _layers(without, 1) < _layers(with_gpu, 1) == share
    # A RAM that cannot hold its share alone: the plan refuses without the device.
    small = _nodes(b_device=2048 * MiB)
    small[1].free_mem = small[0].free_mem = 900 * MiB
    plan_ring(24, 0, small, memory=MEM, n_ctx=N_CTX, n_seq_max=64)
    small[1].device_mem = 0
    with pytest.raises(PlanError):
        plan_ring(24, 0, small, memory=MEM, n_ctx=N_CTX, n_seq_max=64)


def test_device_layers_cap_and_compute_buffers_count_against_the_device() -> None:
    per_layer = MEM.layer_bytes(0, N_CTX)
    dev = 5 * per_layer + WINDOW_OVERHEAD
    assert _nodes(b_device=dev)[1].device_cap(per_layer, 1.0) == 5
    assert _nodes(b_device=dev, b_cap=2)[1].device_cap(per_layer, 1.0) == 2
    assert _nodes(b_device=dev, b_cap=0)[1].device_cap(per_layer, 1.0) == 0  # --n-gpu-layers 0
    assert _nodes(b_device=dev, b_cap=-1)[1].device_cap(per_layer, 1.0) == 5  # -1: all that fit
    assert _nodes()[1].device_cap(per_layer, 1.0) == 0  # none, or unified (one pool: RAM)
    capped = plan_ring(24, 0, _nodes(b_device=2048 * MiB, b_cap=0), memory=MEM, n_ctx=N_CTX,
                       n_seq_max=64)
    without = plan_ring(24, 0, _nodes(), memory=MEM, n_ctx=N_CTX, n_seq_max=64)
    assert _layers(capped, 1) == _layers(without, 1)


def test_layers_that_fit_takes_the_last_layers_and_the_head_only_when_all_fit() -> None:
    assert offload.layers_that_fit([10, 10, 10], 5, free=100, reserve=1.0) == 4  # all + head
    assert offload.layers_that_fit([10, 10, 10], 50, free=40, reserve=1.0) == 3  # not the head
    assert offload.layers_that_fit([10, 10, 10], 5, free=25, reserve=1.0) == 2
    assert offload.layers_that_fit([30, 10, 10], 5, free=25, reserve=1.0) == 2
    assert offload.layers_that_fit([10, 10, 10], 5, free=9, reserve=1.0) == 0
    assert offload.layers_that_fit([10] * 4, 0, free=100, reserve=0.3) == 3


def test_each_window_offloads_what_fits_unless_told(tiny_qwen2: Path) -> None:  # noqa: F811
    from edgespec.head.memory import model_memory

    mem = model_memory(tiny_qwen2)
    per_layer = mem.layer_bytes(0, 512)
    cpu = offload.DeviceReport("cpu", None, None, None, False)
    assert offload.choose_gpu_layers(tiny_qwen2, 512, None, cpu)[0] == 0
    assert offload.choose_gpu_layers(tiny_qwen2, 512, 3, cpu)[0] == 3  # --n-gpu-layers wins
    big = offload.DeviceReport("vulkan", "Vulkan0: big", 1 << 34, 1 << 34, False)
    n, why = offload.choose_gpu_layers(tiny_qwen2, 512, None, big)
    assert n == mem.n_layer + 1 and "output layer" in why
    two = offload.DeviceReport("cuda", "CUDA0: small", int(2.5 * per_layer / offload.RESERVE),
                               1 << 30, False)
    n, why = offload.choose_gpu_layers(tiny_qwen2, 512, None, two)
    assert n == 2 and why.startswith(f"2 of {mem.n_layer} layers on CUDA0: small")
    one_pool = offload.DeviceReport("vulkan", "Vulkan0: igpu", None, None, True)
    assert offload.choose_gpu_layers(tiny_qwen2, 512, None, one_pool)[0] == offload.ALL_LAYERS
    assert offload.profile_gpu_layers(None, cpu) == 0
    assert offload.profile_gpu_layers(None, big) == offload.ALL_LAYERS
    assert offload.profile_gpu_layers(0, big) == 0
    assert "unified with RAM" in offload.offload_summary(None, one_pool)
    lavapipe = offload.DeviceReport("vulkan", "Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits)", None,
                                    None, True)
    assert offload.choose_gpu_layers(tiny_qwen2, 512, None, lavapipe)[0] == 0  # the CPU is faster
    assert offload.choose_gpu_layers(tiny_qwen2, 512, -1, lavapipe)[0] == -1
    assert offload.profile_gpu_layers(None, lavapipe) == 0
    assert "software device" in offload.offload_summary(None, lavapipe)
    assert "16.0 of 16.0 GiB free" in offload.offload_summary(None, big)


def test_the_node_reports_what_the_linked_llama_cpp_sees() -> None:
    """Read from ggml's device registry: the CPU device is always there; a GPU build adds
    its devices, each with free <= total memory."""
    found = devices.list_devices()
    assert any(d.kind == "cpu" for d in found)
    for d in found:
        assert d.name and d.kind in devices.KINDS and 0 <= d.free <= max(d.total, d.free)
    report = offload.device_report()
    gpus = devices.offload_devices()
    if not gpus:
        assert (report.backend, report.device, report.free_vram) == ("cpu", None, None)
    else:
        assert report.device and report.device.startswith(gpus[0].name)
        assert report.backend == devices.backend_of(gpus[0]) != "cpu"
        assert report.unified or 0 < report.free_vram <= report.total_vram


def test_ring_status_shows_the_device_and_its_memory() -> None:
    from edgespec.cli.ring import _fmt_device
    from edgespec.head.view import NodeView

    row = NodeView("n", "h:1", {}, "loaded", backend="cuda", device="CUDA0: RTX",
                   free_vram=6 << 30, total_vram=8 << 30)
    assert _fmt_device(row) == "cuda 6.0GB/8.0GB"
    row.unified, row.free_vram, row.total_vram = True, None, None
    assert _fmt_device(row) == "cuda (unified)"
    assert _fmt_device(NodeView("n", "h:1", {}, "loaded", backend="cpu")) == "cpu"
    assert "free_vram" in row.to_dict() and row.to_dict()["device"] == "CUDA0: RTX"
