"""Layer planner: contiguous windows sized to each device's speed and memory.

Given each node's measured decode time per layer and its free memory, the planner gives every
node a share of layers proportional to its speed (water-filling under memory caps, so a fast
device with little memory is capped and the rest flows to the others), then cuts each share
into ``rounds`` windows visited in ring order (prima.cpp's piped ring: with k rounds a lap
visits every node k times). The estimated lap time is compute plus one link latency per hop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


class PlanError(ValueError):
    """No plan fits (not enough memory, bad override)."""


@dataclass
class NodeProfile:
    """What the planner knows of a node."""

    node_id: str
    name: str
    host: str
    port: int
    ms_per_layer: dict[int, float] = field(default_factory=dict)  # batch size -> ms per layer
    free_mem: int = 0  # bytes available for weights + KV
    rtt_ms: float = 0.0  # head <-> node round trip

    def layer_ms(self, batch: int) -> float:
        if not self.ms_per_layer:
            return 1.0
        sizes = sorted(self.ms_per_layer)
        best = min(sizes, key=lambda b: abs(b - batch))
        return float(self.ms_per_layer[best])


@dataclass
class Window:
    stage: int
    node: int  # index into the plan's nodes
    start: int
    stop: int

    @property
    def n_layers(self) -> int:
        return self.stop - self.start


@dataclass
class Plan:
    nodes: list[NodeProfile]
    windows: list[Window]
    n_layer: int
    est_lap_ms: float = 0.0

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(w.start, w.stop) for w in self.windows]

    def table(self) -> str:
        lines = [f"{'stage':>5} {'layers':>9} {'node':<20} {'address':<22} {'ms/layer':>8}"]
        for w in self.windows:
            n = self.nodes[w.node]
            speed = f"{n.layer_ms(1):>8.2f}" if n.ms_per_layer else f"{'-':>8}"
            lines.append(f"{w.stage:>5} {w.start:>4}:{w.stop:<4} {n.name[:20]:<20} "
                         f"{n.host + ':' + str(n.port):<22} {speed}")
        if all(n.ms_per_layer for n in self.nodes):
            lines.append(f"estimated lap time at batch 1: {self.est_lap_ms:.1f} ms")
        else:
            lines.append("(not profiled: layers split as given)")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"n_layer": self.n_layer, "est_lap_ms": self.est_lap_ms,
                "windows": [[w.stage, w.node, w.start, w.stop] for w in self.windows]}


def _shares(n_layer: int, speeds: Sequence[float], caps: Sequence[int]) -> list[int]:
    """Integer layer counts proportional to ``speeds`` under ``caps`` (water-filling)."""
    n = len(speeds)
    if sum(caps) < n_layer:
        raise PlanError(f"the nodes can hold {sum(caps)} of {n_layer} layers: add a device or "
                        f"free memory")
    share = [0.0] * n
    free = set(range(n))
    left = float(n_layer)
    while free and left > 1e-9:
        total = sum(speeds[i] for i in free)
        capped = False
        for i in list(free):
            want = left * speeds[i] / total
            if share[i] + want > caps[i]:
                left -= caps[i] - share[i]
                share[i] = float(caps[i])
                free.discard(i)
                capped = True
        if not capped:
            for i in free:
                share[i] += left * speeds[i] / total
            left = 0.0
    counts = [min(caps[i], math.floor(share[i])) for i in range(n)]
    rest = n_layer - sum(counts)
    order = sorted(range(n), key=lambda i: share[i] - math.floor(share[i]), reverse=True)
    for i in order * 2:
        if rest <= 0:
            break
        if counts[i] < caps[i]:
            counts[i] += 1
            rest -= 1
    # Every node in the ring holds at least one layer, or it should not be in the ring.
    for i in range(n):
        if counts[i] == 0:
            donor = max(range(n), key=lambda j: counts[j])
            if counts[donor] <= 1:
                raise PlanError("more nodes than layers")
            counts[donor] -= 1
            counts[i] = 1
    return counts


def plan_ring(n_layer: int, layer_bytes: int, nodes: Sequence[NodeProfile], *,
              rounds: int = 1, batch: int = 1, reserve: float = 0.8,
              ranges: Sequence[tuple[int, int]] | None = None) -> Plan:
    """The plan for ``nodes`` (in ring order). ``ranges`` overrides the split (one range per
    node and round, in ring order)."""
    nodes = list(nodes)
    if not nodes:
        raise PlanError("no nodes to plan over")
    if rounds < 1:
        raise PlanError("rounds must be >= 1")
    windows: list[Window] = []
    if ranges is not None:
        if len(ranges) != len(nodes) * rounds:
            raise PlanError(f"{len(ranges)} ranges given for {len(nodes)} nodes x {rounds} "
                            f"rounds")
        pos = 0
        for k, (a, b) in enumerate(ranges):
            if a != pos or b <= a:
                raise PlanError(f"ranges must be contiguous and cover 0:{n_layer}: {ranges}")
            windows.append(Window(k, k % len(nodes), a, b))
            pos = b
        if pos != n_layer:
            raise PlanError(f"ranges end at layer {pos}, the model has {n_layer}")
    else:
        speeds = [1.0 / max(n.layer_ms(batch), 1e-6) for n in nodes]
        caps = [max(0, int(n.free_mem * reserve // max(layer_bytes, 1))) if n.free_mem else
                n_layer for n in nodes]
        # Every ring member holds at least one layer; a node without room for one would be
        # given it anyway by _shares' minimum and then fail to load: say so here, by name.
        for n, cap in zip(nodes, caps, strict=True):
            if cap == 0:
                raise PlanError(f"node {n.name} ({n.host}:{n.port}) has {n.free_mem} bytes "
                                f"free, not enough for one layer ({layer_bytes} bytes): free "
                                f"memory there or leave it out of the ring")
        counts = _shares(n_layer, speeds, caps)
        if any(c < rounds for c in counts):
            raise PlanError(f"{rounds} rounds need at least {rounds} layers per node; shares "
                            f"are {counts}")
        per_round = [[c // rounds + (1 if r < c % rounds else 0) for r in range(rounds)]
                     for c in counts]
        pos = 0
        for r in range(rounds):
            for i in range(len(nodes)):
                k = per_round[i][r]
                windows.append(Window(len(windows), i, pos, pos + k))
                pos += k
    compute = sum(w.n_layers * nodes[w.node].layer_ms(batch) for w in windows)
    hops = sum(nodes[w.node].rtt_ms / 2 for w in windows) + nodes[windows[-1].node].rtt_ms / 2
    return Plan(nodes, windows, n_layer, est_lap_ms=compute + hops)
