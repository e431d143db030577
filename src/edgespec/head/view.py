"""One typed view of a ring: what ``edgespec ring status`` prints, ``Ring.describe()`` returns
and ``GET /v1/ring`` serves (docs/design.md 5.3).

The view is built the same way from what the nodes say (their ``health`` answers) whether a
head holds the ring (``view_of_chain``: over the head's own connections) or not
(``view_of_state``: ``ring status`` dials every node of the saved state). Per node: the windows
of the plan, the windows it holds, its state (``loaded``, ``not loaded``, ``other windows``,
``loaded, link down``, ``unreachable``, or for a node that left the ring ``left`` /
``returned``), holder, memory and round trip; per stage (ring order): layers, node, address,
device and compute counters. Fields only a head knows (mode, drafter, recoveries, its slots)
are None / empty without one: the shape is the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgespec.errors import RingError
from edgespec.head.planner import Window
from edgespec.head.remote import connect_members
from edgespec.head.state import NodeEntry, RingState


@dataclass
class NodeView:
    """One node of the plan (or one that left it) as it is now."""

    name: str
    address: str
    plan: dict[int, tuple[int, int]]
    state: str
    left: bool = False
    reason: str | None = None
    held: dict[int, tuple[int, ...]] = field(default_factory=dict)
    holder: dict | None = None
    node_id: str | None = None
    # Bytes the node may still take: the smaller of MemAvailable and its memory cgroup's room
    # (node/info.free_ram_bytes), the figure the planner plans with.
    free_ram: int | None = None
    rss: int | None = None
    rtt_ms: float | None = None
    error: str | None = None
    # Its compute device as llama.cpp's backend reports it (node/offload.device_report):
    # backend, device, a discrete device's free / total memory, or unified (one pool: free_ram).
    backend: str | None = None
    device: str | None = None
    free_vram: int | None = None
    total_vram: int | None = None
    unified: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["plan"] = {str(s): list(r) for s, r in self.plan.items()}
        d["held"] = {str(s): list(r) for s, r in self.held.items()}
        return d


@dataclass
class StageView:
    """One stage of the plan, in ring order."""

    stage: int
    layers: list[int]
    node: str
    address: str | None
    alive: bool
    backend: str | None = None
    free_ram: int | None = None
    free_vram: int | None = None
    rtt_ms: float | None = None
    batches: int | None = None
    busy_s: float | None = None
    device: str | None = None
    gpu_layers: int | None = None  # of the window's layers, how many run on the device


@dataclass
class RingView:
    """The ring: model, the head's settings (None without a head), stages and nodes."""

    model: str
    n_ctx: int
    stages: list[StageView]
    nodes: list[NodeView]
    spec: str | None = None
    drafter: str | None = None
    # The speculative modes a request may ask the head for; None without a head.
    modes: list[str] | None = None
    status: str = "up"
    message: str | None = None
    hint: str | None = None
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    # The last answer's lap timing (``edgespec.laps``: per stage wait/compute, per link the
    # transfer time node to node); None without a head or before its first answer.
    lap_timing: dict[str, Any] | None = None
    # The head's slots (``Ring.parallel``, ``Ring.slots()``: busy/free, tokens, speed); None
    # where no head (or server) was asked.
    parallel: int | None = None
    slots: list[dict[str, Any]] | None = None
    # Sequences every stage's context holds (the plan's choice, ``planner.fit_plan``).
    sequences: int | None = None
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "n_ctx": self.n_ctx, "spec": self.spec,
                "drafter": self.drafter, "modes": self.modes, "status": self.status, "message": self.message,
                "hint": self.hint, "recoveries": list(self.recoveries), "time": self.time,
                "lap_timing": self.lap_timing, "parallel": self.parallel,
                "sequences": self.sequences,
                "slots": None if self.slots is None else [dict(s) for s in self.slots],
                "stages": [asdict(s) for s in self.stages],
                "nodes": [n.to_dict() for n in self.nodes]}


_HINT = "start `edgespec node` again on those devices, then `edgespec ring rebalance` (or " \
        "`edgespec ring up`)"


def slot_lines(slots: Sequence[dict[str, Any]]) -> list[str]:
    """The slots as ``ring status`` prints them: one line each (busy/free, tokens of the
    current or last request, its decode speed, prompt and committed history, and where that
    history's KV is: live in the stages' caches, or parked in their host memory)."""
    out = [f"{'slot':>4}  {'state':<5} {'tokens':>7} {'tok/s':>8} {'prompt':>7} "
           f"{'history':>8} kv"]
    for s in slots:
        speed = s.get("tokens_per_s")
        out.append(f"{s.get('slot', '?'):>4}  {s.get('state', '?'):<5} "
                   f"{s.get('tokens', 0) or 0:>7} "
                   f"{'-' if speed is None else f'{float(speed):.2f}':>8} "
                   f"{s.get('prompt_tokens', 0) or 0:>7} {s.get('history_tokens', 0) or 0:>8} "
                   f"{'parked' if s.get('kv_parked') else 'live' if s.get('history_tokens') else '-'}")
    return out


def _node_view(entry: NodeEntry, index: int | None, windows: Sequence[Window], left: bool,
               health: dict | None, rtt_ms: float | None, error: str | None) -> NodeView:
    """A node's row from its health answer (None: it did not answer, ``error`` says why)."""
    plan = {w.stage: (w.start, w.stop) for w in windows if index is not None and w.node == index}
    row = NodeView(entry.name, f"{entry.host}:{entry.port}", plan, "unreachable", left,
                   entry.reason)
    if health is None:
        row.state = "left" if left else "unreachable"
        row.error = error
        return row
    row.name = str(health.get("name") or row.name)
    row.rtt_ms, row.free_ram, row.rss = rtt_ms, health.get("free_ram"), health.get("rss")
    row.holder, row.node_id = health.get("holder"), health.get("node_id")
    row.backend, row.device = health.get("backend"), health.get("device")
    row.free_vram, row.total_vram = health.get("free_vram"), health.get("total_vram")
    row.unified = bool(health.get("unified"))
    stages = health.get("stages") or {}
    row.held = {int(s): tuple(v.get("range", ())) for s, v in stages.items()}
    links_ok = all(v.get("next") not in (None, "none") or v.get("is_last")
                   for v in stages.values())
    if left:
        row.state = "returned"
    elif not row.held:
        row.state = "not loaded"
    elif row.held != plan:
        row.state = "other windows"
    elif not links_ok and len(windows) > 1:
        row.state = "loaded, link down"
    else:
        row.state = "loaded"
    return row


def _assemble(model: str, n_ctx: int, windows: Sequence[Window], nodes: list[NodeView],
              healths: dict[int, dict], alive: list[bool], can_recover: bool) -> RingView:
    stages = []
    for w in windows:
        n, h = nodes[w.node], healths.get(w.node, {})
        st = (h.get("stages") or {}).get(str(w.stage), {})
        stages.append(StageView(
            w.stage, [w.start, w.stop], n.name, n.address, alive[w.node], h.get("backend"),
            h.get("free_ram"), h.get("free_vram"),
            None if n.rtt_ms is None else round(n.rtt_ms, 3), st.get("batches"),
            st.get("busy_s"), h.get("device"), st.get("gpu_layers")))
    view = RingView(model, n_ctx, stages, nodes)
    lost = sorted({s.node for s in stages if not s.alive})
    if lost:
        view.status, view.message = "down", f"lost node(s): {', '.join(lost)}"
        view.hint = ("the next request re-plans the ring over the nodes still up; or " + _HINT
                     if can_recover else _HINT)
    return view


def view_of_state(state: RingState, key: bytes, timeout: float = 5.0) -> RingView:
    """The ring of a state file as its nodes say it is now, without a head: every node (and
    every node that left) is dialled and asked for its health."""
    entries = [(i, n, False) for i, n in enumerate(state.nodes)]
    entries += [(None, n, True) for n in state.left]
    rows, healths = [], {}
    for index, n, left in entries:
        health, rtt, error = None, None, None
        try:
            m = connect_members([n.address], key, "status", None)[0]
        except RingError as e:
            error = str(e)
        else:
            try:
                health = dict(m.request("health", timeout=timeout).meta)
                rtt = m.last_rtt_ms
            except RingError as e:
                error = str(e)
            finally:
                m.close()
        row = _node_view(n, index, state.windows, left, health, rtt, error)
        if index is not None and health is not None:
            healths[index] = health
        rows.append(row)
    alive = [i in healths for i in range(len(state.nodes))]
    view = _assemble(Path(state.model).stem, state.n_ctx, state.windows, rows, healths, alive,
                     False)
    view.sequences = state.n_seq_max
    return view


def view_of_chain(chain: Any, model: str, n_ctx: int, *, probe: bool = True,
                  left: Sequence[NodeEntry] = (), can_recover: bool = False) -> RingView:
    """The ring a head holds, over its own connections (``probe``: ask every node for its
    health now, one round trip each; else only what the head already knows). A chain whose
    windows all run in this process has no nodes."""
    plan = getattr(chain, "plan", None)
    members = getattr(chain, "members", None)
    if plan is None or members is None:  # every window in this process
        runtimes = getattr(getattr(chain, "worker", None), "runtimes", [])
        stages = [StageView(i, list(getattr(rt, "layer_range", (0, 0))), "this process",
                            None, True) for i, rt in enumerate(runtimes)]
        return RingView(model, n_ctx, stages, [], sequences=getattr(chain, "n_seq_max", None))
    healths: dict[int, dict] = {}
    rows = []
    for i, m in enumerate(members):
        error = None
        if probe and m.alive:
            try:
                healths[i] = dict(m.request("health", timeout=2.0).meta)
            except Exception as e:  # a silent node shows as unknown
                error = str(e)
        entry = NodeEntry(m.name, m.address[0], m.address[1])
        row = _node_view(entry, i, plan.windows, False, healths.get(i), m.last_rtt_ms,
                         error if m.alive else f"lost node {m.name}")
        row.name, row.rtt_ms = m.name, m.last_rtt_ms
        if m.alive and i not in healths:
            row.state = "unknown" if not probe else "unreachable"
        rows.append(row)
    for n in left:
        rows.append(_node_view(n, None, plan.windows, True, None, None, n.reason))
    view = _assemble(model, n_ctx, plan.windows, rows, healths, [m.alive for m in members],
                     can_recover)
    for s, w in zip(view.stages, plan.windows, strict=True):  # the head's own round trip
        s.rtt_ms = round(members[w.node].last_rtt_ms, 3)
    view.sequences = getattr(chain, "n_seq_max", None)
    return view
