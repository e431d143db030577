"""The ring state file: the ring in force (nodes, plan, model) and the nodes that left it.

``edgespec ring up`` writes it; ``chat``/``serve``/Python attach through it, and ``ring
status``/``down``/``rebalance`` know every node from it (docs/design.md 5.3). It is a typed
``RingState`` here and plain JSON on disk, in the format the code has always written (a file
written before keeps working). Reading it is as strict as reading a data frame: a missing
field or one of the wrong type is one clear ``RingError`` naming the file, never a KeyError
somewhere later.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgespec.errors import RingError
from edgespec.head.planner import Plan, Window
from edgespec.seqs import N_SEQ

Address = tuple[str, int]


def state_path() -> Path:
    from edgespec.llm.models import home

    return home() / "ring.json"


def _get(d: dict, name: str, kind: type | tuple[type, ...], where: str, default: Any = ...,
         ) -> Any:
    """``d[name]`` checked against ``kind`` (a bool is never a number); ``default`` when the
    field may be absent."""
    if name not in d or (d[name] is None and default is not ...):
        if default is ...:
            raise ValueError(f"{where}: missing field {name!r}")
        return default
    v = d[name]
    if isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ValueError(f"{where}: field {name!r} must be {_kind_name(kind)}, got {v!r}")
    if not isinstance(v, kind):
        raise ValueError(f"{where}: field {name!r} must be {_kind_name(kind)}, got {v!r}")
    return v


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({str: "text", int: "an integer", float: "a number", list: "a list",
                        dict: "an object"}.get(k, k.__name__) for k in kinds)


@dataclass(frozen=True)
class NodeEntry:
    """A node of the saved ring, or (with ``since``/``reason``) one that left it."""

    name: str
    host: str
    port: int
    since: float | None = None
    reason: str | None = None

    @property
    def address(self) -> Address:
        return (self.host, self.port)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "host": self.host, "port": self.port}
        if self.since is not None or self.reason is not None:
            out.update(since=self.since, reason=self.reason)
        return out

    @classmethod
    def from_dict(cls, d: Any, where: str) -> NodeEntry:
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be an object, got {d!r}")
        host = _get(d, "host", str, where)
        port = _get(d, "port", int, where)
        if not 0 < port < 65536:
            raise ValueError(f"{where}: port {port} is out of range")
        return cls(_get(d, "name", str, where, f"{host}:{port}"), host, port,
                   float(_get(d, "since", (int, float), where, None) or 0) or None,
                   _get(d, "reason", str, where, None))


@dataclass
class RingState:
    """The ring in force: its model, nodes in plan order, layer windows, and the settings the
    stages were loaded with; ``left`` lists the nodes of earlier plans not in this one."""

    model: str
    nodes: list[NodeEntry]
    windows: list[Window]
    n_layer: int
    est_lap_ms: float = 0.0
    left: list[NodeEntry] = field(default_factory=list)
    created: float = 0.0
    encoding: str = "f32"
    n_ctx: int = 4096
    key_file: str | None = None
    n_seq_max: int = N_SEQ  # sequences every stage's context holds (the plan chose them)

    @property
    def options(self) -> dict[str, Any]:
        """What a re-formed ring keeps of this one (its activation encoding, context, key)."""
        return {"encoding": self.encoding, "n_ctx": self.n_ctx, "key_file": self.key_file}

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "created": self.created,
                "nodes": [n.to_dict() for n in self.nodes],
                "plan": {"n_layer": self.n_layer, "est_lap_ms": self.est_lap_ms,
                         "windows": [[w.stage, w.node, w.start, w.stop] for w in self.windows]},
                "left": [n.to_dict() for n in self.left], "n_seq_max": self.n_seq_max,
                **self.options}

    @classmethod
    def from_dict(cls, d: Any, source: str = "the ring state") -> RingState:
        """Parse (and check) a state; ``RingError`` naming ``source`` when it is malformed."""
        try:
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            nodes = [NodeEntry.from_dict(n, f"nodes[{i}]")
                     for i, n in enumerate(_get(d, "nodes", list, "state"))]
            left = [NodeEntry.from_dict(n, f"left[{i}]")
                    for i, n in enumerate(_get(d, "left", list, "state", []))]
            plan = _get(d, "plan", dict, "state")
            windows = []
            for i, w in enumerate(_get(plan, "windows", list, "plan")):
                if (not isinstance(w, list) or len(w) != 4
                        or not all(isinstance(v, int) and not isinstance(v, bool) for v in w)):
                    raise ValueError(f"plan.windows[{i}] must be [stage, node, start, stop] "
                                     f"integers, got {w!r}")
                if not 0 <= w[1] < len(nodes):
                    raise ValueError(f"plan.windows[{i}] names node {w[1]} of {len(nodes)}")
                windows.append(Window(*w))
            return cls(model=_get(d, "model", str, "state"), nodes=nodes, windows=windows,
                       n_layer=_get(plan, "n_layer", int, "plan"),
                       est_lap_ms=float(_get(plan, "est_lap_ms", (int, float), "plan", 0.0)),
                       left=left, created=float(_get(d, "created", (int, float), "state", 0.0)),
                       encoding=_get(d, "encoding", str, "state", "f32"),
                       n_ctx=_get(d, "n_ctx", int, "state", 4096),
                       key_file=_get(d, "key_file", str, "state", None),
                       n_seq_max=_get(d, "n_seq_max", int, "state", N_SEQ))
        except ValueError as e:
            raise RingError(f"the ring state at {source} is unreadable ({e}); run `edgespec "
                            f"ring up` again") from None

    def plan(self) -> Plan:
        """The plan in force (node profiles carry only names and addresses)."""
        from edgespec.head.planner import NodeProfile

        profiles = [NodeProfile(n.name, n.name, n.host, n.port) for n in self.nodes]
        return Plan(profiles, list(self.windows), self.n_layer, self.est_lap_ms)

    def node_addresses(self, *, include_left: bool = True) -> list[Address]:
        """The addresses of the nodes (and of nodes that left, for rebalance)."""
        out: list[Address] = []
        for n in self.nodes + (self.left if include_left else []):
            if n.address not in out:
                out.append(n.address)
        return out

    def named_nodes(self) -> list[tuple[str, Address]]:
        """(name, address) of every node the ring knows: its members, then those that left."""
        out: list[tuple[str, Address]] = []
        for n in self.nodes + self.left:
            if all(n.address != b for _, b in out):
                out.append((n.name, n.address))
        return out


def load_state(path: str | os.PathLike[str] | None = None) -> RingState:
    p = Path(path) if path else state_path()
    if not p.exists():
        raise RingError(f"no ring is up (no state at {p}): run `edgespec ring up` first")
    try:
        raw = json.loads(p.read_text())
    except ValueError as e:
        raise RingError(f"the ring state at {p} is unreadable ({e}); run `edgespec ring up` "
                        f"again") from None
    return RingState.from_dict(raw, str(p))


def save_state(chain: Any, model: Path | str, options: dict[str, Any] | None = None,
               known: Sequence[Address] = (), reason: str = "") -> Path:
    """Write the ring in force (``chain``'s members and plan) and, under ``left``, every
    ``known`` node that is not in it any more (so ``status``, ``down`` and ``rebalance`` still
    know it). ``options``: encoding, n_ctx, key_file."""
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    members = {m.address for m in chain.members}
    old_left: list[NodeEntry] = []
    names: dict[Address, str] = {}
    with contextlib.suppress(RingError, OSError):
        old = load_state()
        old_left = list(old.left)
        names = {a: n for n, a in old.named_nodes()}
    left = [n for n in old_left if n.address not in members]
    for host, port in known:
        if (host, port) not in members and all(n.address != (host, port) for n in left):
            left.append(NodeEntry(names.get((host, port), f"{host}:{port}"), host, port,
                                  time.time(), reason or "not in the ring"))
    opts = dict(options or {})
    plan = chain.plan
    state = RingState(model=str(model), created=time.time(),
                      nodes=[NodeEntry(m.name, m.address[0], m.address[1])
                             for m in chain.members],
                      windows=list(plan.windows), n_layer=plan.n_layer,
                      est_lap_ms=plan.est_lap_ms, left=left,
                      encoding=str(opts.get("encoding") or "f32"),
                      n_ctx=int(opts.get("n_ctx") or 4096),
                      key_file=None if opts.get("key_file") is None else str(opts["key_file"]),
                      n_seq_max=int(getattr(chain, "n_seq_max", N_SEQ)))
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(state.to_dict(), indent=2))
    os.replace(tmp, path)
    return path
