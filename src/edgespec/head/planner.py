"""Layer planner: contiguous windows sized to each device's speed and memory.

Given each node's measured decode time per layer and its free memory, the planner gives every
node a share of layers proportional to its speed (water-filling under memory caps, so a fast
device with little memory is capped and the rest flows to the others), then cuts each share
into ``rounds`` windows visited in ring order (prima.cpp's piped ring: with k rounds a lap
visits every node k times). The estimated lap time is compute plus one link latency per hop.

Memory is what ``edgespec.head.memory`` counts a window to hold; where a ring does not fit,
:func:`fit_plan` lets it hold fewer sequences, then puts the roomiest nodes at the ends. A node
with a discrete GPU has two pools: the layers that fit in the device's free memory (weights and
KV cache, after one ``WINDOW_OVERHEAD`` of compute buffers there) count against it, the rest
and the ends' buffers against its RAM. A unified-memory device (integrated GPU, Jetson, Apple)
reports no device pool: its layers count against the one pool, its RAM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from edgespec.head.memory import WINDOW_OVERHEAD, ModelMemory, ends_need, window_need
from edgespec.seqs import N_SEQ


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
    device_mem: int = 0  # free bytes of a discrete GPU the node offloads to (0: none/unified)
    device_layers: int | None = None  # the node's --n-gpu-layers cap (None: what fits)

    def device_cap(self, layer_bytes: int, reserve: float) -> int:
        """Layers of ``layer_bytes`` this node's GPU holds (its free memory less one window's
        compute buffers, ``reserve`` of it)."""
        if self.device_mem <= 0 or self.device_layers == 0:
            return 0
        n = max(0, int((self.device_mem * reserve - WINDOW_OVERHEAD) // max(layer_bytes, 1)))
        return n if self.device_layers is None or self.device_layers < 0 else \
            min(n, self.device_layers)

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


#: The share of a node's free memory a plan may fill: the rest absorbs what the counts above
#: leave out (a longer prompt's attention scores, the allocator's slack). Every term is a
#: measured upper bound (the 1.5B's windows peaked 4-29 MiB below their counts).
RESERVE = 0.9


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


#: A reordering must save at least this much of a lap's link time (ms, and a fraction of
#: it) before it replaces the order the nodes were found in: within noise, plans stay stable.
REORDER_MIN_MS = 1.0
REORDER_MIN_FRACTION = 0.1


def ring_order(head_rtt: Sequence[float], pair_rtt: Sequence[Sequence[float | None]],
               rounds: int = 1) -> tuple[list[int], float, float]:
    """The order of the nodes that makes a lap's links cheapest: the lap goes head -> first
    node -> ... -> last node -> head, a link costs half its round trip, ``head_rtt[i]`` is
    the head's round trip to node i and ``pair_rtt[i][j]`` node i's to node j (None: not
    reached; such a link is never chosen while another order avoids it). With ``rounds`` k a
    lap runs the nodes' path k times, crossing from the last node back to the first k - 1
    times. Returns (order, link ms per lap of that order, of the order given). Every order for
    up to 8 nodes; beyond, nearest neighbour from the head. The given order stays unless the
    best saves ``REORDER_MIN_MS`` and ``REORDER_MIN_FRACTION`` of its link time."""
    n = len(head_rtt)
    k = max(1, int(rounds))
    unreachable = 1e6  # ms: a link no order should take

    def link(i: int, j: int) -> float:
        a, b = pair_rtt[i][j], pair_rtt[j][i]
        known = [x for x in (a, b) if x is not None]
        return (min(known) if known else unreachable) / 2

    def cost(order: Sequence[int]) -> float:
        path = sum(link(a, b) for a, b in zip(order, order[1:], strict=False))
        back = link(order[-1], order[0]) if k > 1 and n > 1 else 0.0
        return head_rtt[order[0]] / 2 + k * path + (k - 1) * back + head_rtt[order[-1]] / 2

    given = list(range(n))
    if n <= 2:  # head -> a -> b -> head costs the same either way round
        return given, cost(given) if n else 0.0, cost(given) if n else 0.0
    if n <= 8:
        import itertools

        best = min((list(p) for p in itertools.permutations(given) if p[0] < p[-1]), key=cost)
    else:
        best = [min(given, key=lambda i: head_rtt[i])]
        while len(best) < n:
            best.append(min((i for i in given if i not in best),
                            key=lambda i: link(best[-1], i)))
    now, new = cost(given), cost(best)
    if now - new < max(REORDER_MIN_MS, REORDER_MIN_FRACTION * now):
        return given, now, now
    return best, new, now


def plan_ring(n_layer: int, layer_bytes: int, nodes: Sequence[NodeProfile], *,
              rounds: int = 1, batch: int = 1, reserve: float = RESERVE,
              ranges: Sequence[tuple[int, int]] | None = None,
              memory: ModelMemory | None = None, n_ctx: int = 4096,
              n_seq_max: int = N_SEQ) -> Plan:
    """The plan for ``nodes`` (in ring order). ``ranges`` overrides the split (one range per
    node and round, in ring order).

    ``layer_bytes`` is one layer's memory; with ``memory`` (:func:`model_memory`) the heaviest
    layer's weights plus KV cache at ``n_ctx`` are used instead, and every node's windows,
    with the embeddings and head they hold, are checked against its free memory."""
    if memory is not None:
        if memory.n_layer != n_layer:
            raise PlanError(f"memory estimate covers {memory.n_layer} layers, the model has {n_layer}")
        layer_bytes = max(memory.layer_bytes(i, n_ctx) for i in range(n_layer))
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
        ends = [0] * len(nodes)  # the first node holds the embeddings, the last the head too
        if memory is not None:
            ends = [rounds * WINDOW_OVERHEAD] * len(nodes)
            if len(nodes) == 1 and rounds == 1:  # one window: both ends
                ends[0] += ends_need(memory, True, True, n_seq_max)
            else:
                ends[0] += ends_need(memory, True, False, n_seq_max)
                ends[-1] += ends_need(memory, False, True, n_seq_max)
        caps = [max(0, int((n.free_mem * reserve - end) // max(layer_bytes, 1)))
                + n.device_cap(layer_bytes, reserve) if n.free_mem else
                n_layer for n, end in zip(nodes, ends, strict=True)]
        # Every ring member holds at least one layer; a node without room for one would be
        # given it anyway by _shares' minimum and then fail to load: say so here, by name.
        for n, cap in zip(nodes, caps, strict=True):
            if cap == 0:
                raise PlanError(f"node {n.name} ({n.host}:{n.port}) has {n.free_mem} bytes "
                                f"free, not enough for one layer ({layer_bytes} bytes): free "
                                f"memory there or leave it out of the ring")
        # The last window also runs the output head, as much work per row as several layers:
        # its node is given that many layers fewer, so every stage takes as long per lap
        # (a pipelined ring runs at its slowest stage's pace).
        head = round(memory.head_layers()) if memory is not None and n_layer > 1 else 0
        units = _shares(n_layer + head, speeds, [*caps[:-1], caps[-1] + head])
        counts = [*units[:-1], units[-1] - head]
        while head and counts[-1] < rounds:  # it still holds a window per round
            counts[max(range(len(counts) - 1), key=counts.__getitem__)] -= 1
            counts[-1] += 1
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
    if memory is not None:
        for i, n in enumerate(nodes):
            need = sum(window_need(memory, w.start, w.stop, n_ctx, n_seq_max)
                       for w in windows if w.node == i)
            # What the GPU takes off RAM: its layers, the lightest counted (a lower bound).
            held_layers = sorted(memory.layer_bytes(j, n_ctx) for w in windows if w.node == i
                                 for j in range(w.start, w.stop))
            need -= sum(held_layers[:min(len(held_layers), n.device_cap(layer_bytes, reserve))])
            if n.free_mem and need > n.free_mem * reserve:
                held = ",".join(f"{w.start}:{w.stop}" for w in windows if w.node == i)
                raise PlanError(f"node {n.name} ({n.host}:{n.port}) would need {need} bytes for "
                                f"layers {held} at n_ctx={n_ctx}, it has {n.free_mem} free: free "
                                f"memory there, add a device, or give it fewer layers")
    compute = sum(w.n_layers * nodes[w.node].layer_ms(batch) for w in windows)
    if memory is not None:
        compute += memory.head_layers() * nodes[windows[-1].node].layer_ms(batch)
    hops = sum(nodes[w.node].rtt_ms / 2 for w in windows) + nodes[windows[-1].node].rtt_ms / 2
    return Plan(nodes, windows, n_layer, est_lap_ms=compute + hops)


#: Sequences a ring's contexts may hold, most first. Fewer shrink the logits buffer llama.cpp
#: clears at each end (``memory.logits_bytes``); 64 still fit the largest tree (``memory.TREE_ROWS``) in
#: one slot, so only a head serving several slots at once (``serve --parallel``) gives its
#: slots' trees fewer leaves (``edgespec.seqs.slot_width``).
SEQ_CHOICES = (N_SEQ, N_SEQ // 2, N_SEQ // 4)


def roomy_ends(nodes: Sequence[NodeProfile]) -> list[int]:
    """``nodes``' indices reordered so that the two with the most free memory hold the ends
    (the most at the last, which holds the head): the others keep their order between."""
    order = list(range(len(nodes)))
    if len(order) < 3:
        return sorted(order, key=lambda i: nodes[i].free_mem or 0)
    by_room = sorted(order, key=lambda i: nodes[i].free_mem or 0, reverse=True)
    last, first = by_room[0], by_room[1]
    return [first] + [i for i in order if i not in (first, last)] + [last]


@dataclass
class Fit:
    """What :func:`fit_plan` settled on: the plan, the ring order (indices into the nodes
    given), the sequences, and what gave way to fit."""

    plan: Plan
    order: list[int]
    n_seq_max: int
    notes: list[str]


def fit_plan(n_layer: int, layer_bytes: int, nodes: Sequence[NodeProfile], *,
             n_seq_max: int | None = None, ranges: Sequence[tuple[int, int]] | None = None,
             **kwargs: Any) -> Fit:
    """The plan for ``nodes`` in their order with the most sequences (``SEQ_CHOICES``, or
    ``n_seq_max`` alone when given); where memory is short, fewer sequences, then the nodes
    with the most free memory at the ends (``roomy_ends``; never with ``ranges``, which are
    the user's, node by node). Raises the first PlanError when nothing fits."""
    seqs = (n_seq_max,) if n_seq_max is not None else SEQ_CHOICES
    orders = [list(range(len(nodes)))]
    if ranges is None and kwargs.get("memory") is not None:
        roomy = roomy_ends(nodes)
        if roomy != orders[0]:
            orders.append(roomy)
    first_error: PlanError | None = None
    for order in orders:
        for k in seqs:
            try:
                plan = plan_ring(n_layer, layer_bytes, [nodes[i] for i in order],
                                 ranges=ranges, n_seq_max=k, **kwargs)
            except PlanError as e:
                if first_error is None:
                    first_error = e
                if kwargs.get("memory") is None:
                    raise
                continue
            notes = []
            if first_error is not None:
                notes.append(f"at {seqs[0]} sequences and in this order: {first_error}")
            if k != seqs[0]:
                notes.append(f"the ring holds {k} sequences (not {seqs[0]}) to fit in memory")
            if order != orders[0]:
                notes.append("the nodes with the most free memory hold the ends: "
                             + ", ".join(nodes[i].name for i in order))
            return Fit(plan, order, k, notes)
    assert first_error is not None
    raise first_error
