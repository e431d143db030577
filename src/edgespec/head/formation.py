"""Forming a ring of nodes (docs/design.md 5.3): the one place that connects, profiles,
plans, loads, links the stages and runs the health lap; re-forming it over the nodes that
answer; re-attaching to a saved ring; unloading nodes.

``form_ring`` connects to every node, profiles them (optional), plans the windows, has each
node load its windows (cutting them from the model file it has, checked by fingerprint),
wires every stage to its successor (node to node), runs a health lap, and returns the chain.
Every step has a deadline and is announced through ``log_fn``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.batch import Batch
from edgespec.errors import NodeLost, NodeUnfit, RingBusy, RingError
from edgespec.head.memory import model_memory
from edgespec.head.planner import NodeProfile, Plan, PlanError, fit_plan, ring_order
from edgespec.head.remote import (
    CONNECT_TIMEOUT_S,
    DEAD_AFTER_S,
    HEALTH_LAP_TIMEOUT_S,
    LINK_TIMEOUT_S,
    LOAD_TIMEOUT_S,
    Address,
    Member,
    RemoteChain,
    connect_members,
    head_identity,
)
from edgespec.head.state import RingState
from edgespec.tree.kvop import KvOp
from edgespec.wire import Message
from edgespec.wire import control as ctl
from edgespec.wire.transport import connect

log = logging.getLogger("edgespec.ring")


def _holder_of(health: ctl.HealthReply, head: dict | None) -> dict | None:
    """The other head holding a node, from its health answer (None if free or ours)."""
    holder = health.holder
    if holder is None or (head is not None and holder.id == head.get("id")):
        return None
    return holder.body()


def form_ring(addresses: Sequence[Address], model: str | os.PathLike[str], key: bytes, *,
              ranges: Sequence[tuple[int, int]] | None = None, stages: int | None = None,
              rounds: int = 1, n_ctx: int = 4096, n_seq_max: int | None = None, encoding: str = "f32",
              profile: bool = True, proxy: Callable[[Address], Address] | None = None,
              head_id: str = "head", log_fn: Callable[[str], None] = log.info,
              send_shards: bool = False, head: dict | None = None,
              take_over: bool = False) -> RemoteChain:
    """Connect, (profile,) plan, load, wire and check a ring over ``addresses``.

    ``head`` is this head's identity (``head_identity()``); a node held by another head is
    refused with RingBusy naming it, unless ``take_over``. ``n_seq_max``: the sequences every
    stage's context holds; None lets the plan choose (``planner.fit_plan``: the most that fit).
    """
    from edgespec.holder import describe_holder
    from edgespec.llm.gguf_read import fingerprint, read_info

    head = head or head_identity()
    hold = {"head": head, "take_over": bool(take_over)}
    model_path = Path(model).resolve()
    info = read_info(model_path)
    fp = fingerprint(model_path)
    log_fn(f"connecting to {len(addresses)} node(s): "
           + ", ".join(f"{h}:{p}" for h, p in addresses))
    members = connect_members(addresses, key, head_id, proxy)
    try:
        if ranges is None:  # given ranges are the user's, node by node: that order stays
            members = _order_by_latency(members, proxy, log_fn, rounds=rounds)
        profiles = []
        for m in members:
            h = m.ask("health", timeout=CONNECT_TIMEOUT_S)
            # The node's own name (what mDNS and `ring status` show), not its id.
            m.name = h.name or m.name
            other = _holder_of(h, head)
            if other is not None and not take_over:
                raise RingBusy(f"{m.name} ({m.address[0]}:{m.address[1]}) is held by "
                               f"{describe_holder(other)}; stop it, go through it (`edgespec "
                               f"chat --server URL` for a running serve), or pass --take-over")
            prof = NodeProfile(h.node_id, h.name or m.name, m.address[0], m.address[1],
                               free_mem=h.free_ram, rtt_ms=m.last_rtt_ms,
                               device_mem=0 if h.unified else h.free_vram or 0,
                               device_layers=h.gpu_layers)
            if profile and ranges is None and not send_shards:
                log_fn(f"profiling {m.name} on {model_path.name}...")
                try:
                    p = m.ask("profile", timeout=LOAD_TIMEOUT_S, model_path=str(model_path),
                              fingerprint=fp)
                    prof.ms_per_layer = dict(p.ms_per_layer)
                    # Counted after profiling, with the windows the node holds now as free:
                    # loading this plan's windows unloads them first.
                    prof.free_mem = p.free_ram
                except (RingBusy, NodeLost):
                    raise
                except RingError as e:  # e.g. the node lacks the model: it gets the median
                    log_fn(f"{m.name}: not profiled ({e})")
            profiles.append(prof)
        measured = [p.ms_per_layer for p in profiles if p.ms_per_layer]
        for p in profiles:
            if measured and not p.ms_per_layer:
                p.ms_per_layer = {b: float(np.median([mp.get(b, 0.0) for mp in measured]))
                                  for b in measured[0]}
        if ranges is None and stages is not None and stages != len(members) * rounds:
            raise RingError(f"{stages} stages requested but {len(members)} nodes x {rounds} "
                            f"rounds")
        layer_bytes = max(1, model_path.stat().st_size // max(1, info.n_layer))
        try:
            fit = fit_plan(info.n_layer, layer_bytes, profiles, rounds=rounds, ranges=ranges,
                           memory=model_memory(model_path), n_ctx=n_ctx, n_seq_max=n_seq_max)
        except PlanError as e:
            raise RingError(f"cannot plan the ring: {e}") from e
        plan, n_seq_max = fit.plan, fit.n_seq_max
        members = [members[i] for i in fit.order]
        for note in fit.notes:
            log_fn(note)
        log_fn("ring plan:\n" + plan.table())
        # Load: every node its windows (cut from its own copy of the model).
        for i, m in enumerate(members):
            wins = [[w.stage, w.start, w.stop, w.stage == len(plan.windows) - 1]
                    for w in plan.windows if w.node == i]
            log_fn(f"loading on {m.name}: " + ", ".join(
                f"stage {s} (layers {a}-{b - 1})" for s, a, b, _ in wins) + "...")
            # A node without the model file (or with send_shards) gets its windows sent.
            load = {"model_path": "" if send_shards else str(model_path), "fingerprint": fp,
                    "windows": wins, "n_ctx": n_ctx, "n_seq_max": n_seq_max,
                    "encoding": encoding, **hold}
            try:
                if m.ask("load", timeout=LOAD_TIMEOUT_S, **load).need_shards:
                    log_fn(f"{m.name} lacks the model file: sending its windows")
                    load["shard_paths"] = _send_windows(m, model_path, fp, wins)
                    m.request("load", timeout=LOAD_TIMEOUT_S, **load)
            except (RingBusy, NodeLost):
                raise
            except RingError as e:
                raise NodeUnfit(f"{m.name} ({m.address[0]}:{m.address[1]}) could not take "
                                f"its windows: {e}", tuple(m.address)) from e
        log_fn("linking the stages...")
        link_stages(members, plan.windows, proxy, hold)
        chain = RemoteChain(members, plan, info.n_vocab, encoding, n_seq_max=n_seq_max)
        log_fn(f"health lap: {health_lap(chain):.0f} ms")
        return chain
    except BaseException:
        for m in members:
            m.close()
        raise


def _order_by_latency(members: list[Member], proxy: Callable[[Address], Address] | None,
                      log_fn: Callable[[str], None], rounds: int = 1) -> list[Member]:
    """The members in the ring order that keeps a lap's link latency lowest (``ring_order``),
    from the head's round trips and the ones each node measures to the others (as the nodes
    will dial each other: through ``proxy`` when there is one). With two nodes, or when a
    node cannot measure, the order given stays."""
    if len(members) < 3:
        return members
    targets = [list(proxy(m.address) if proxy else m.address) for m in members]
    pairs: list[list[float | None]] = []
    head: list[float] = []
    for i, m in enumerate(members):
        best = float("inf")
        for _ in range(3):  # the head's round trip, best of three pings
            m.ask("ping", timeout=CONNECT_TIMEOUT_S)
            best = min(best, m.last_rtt_ms)
        head.append(best)
        try:
            rtts = m.ask("probe_rtt", timeout=CONNECT_TIMEOUT_S * len(members),
                         addresses=[t for j, t in enumerate(targets) if j != i]).rtt_ms
        except RingError as e:  # e.g. an older node: keep the order given
            log_fn(f"{m.name}: no round trips to the other nodes ({e}); ring order as given")
            return members
        row = list(rtts)
        row.insert(i, 0.0)
        pairs.append(row)
    order, ms, before = ring_order(head, pairs, rounds)
    if order != list(range(len(members))):
        log_fn(f"ring order by link latency: {' -> '.join(members[i].name for i in order)} "
               f"({ms:.1f} ms of links per lap instead of {before:.1f})")
    return [members[i] for i in order]


def link_stages(members: Sequence[Member], windows: Sequence[Any],
                proxy: Callable[[Address], Address] | None, hold: dict) -> None:
    """Wire each stage to its successor (node to node, or in-process on the same node); the
    last stage answers the head. Nodes dial their links afresh (a node that came back on the
    same address holds nothing of the old ring)."""
    for i, m in enumerate(members):
        links: dict[str, Any] = {}
        for w in windows:
            if w.node != i:
                continue
            if w.stage == len(windows) - 1:
                links[str(w.stage)] = "head"
                continue
            nxt = windows[w.stage + 1]
            if nxt.node == i:
                links[str(w.stage)] = {"local": nxt.stage, "stage": nxt.stage}
            else:
                host, port = members[nxt.node].address
                if proxy:
                    host, port = proxy((host, port))
                links[str(w.stage)] = {"host": host, "port": port, "stage": nxt.stage}
        m.request("connect", timeout=LINK_TIMEOUT_S, links=links, **hold)


def _send_windows(m: Member, model_path: Path, fp: str, wins: list) -> dict[str, str]:
    """Cut this node's windows here and send them (resumable, sha256-checked, cached by
    fingerprint on the node: a shard it already holds is not sent again)."""
    from edgespec.llm.models import home
    from edgespec.llm.shards import cut_window, shard_file_name
    from edgespec.wire.transfer import send_shard

    def request(op: str, blob: bytes | None = None, **body: Any) -> Message:
        return m.request(op, blob=blob, timeout=120, **body)

    paths = {}
    for stage, a, b, _last in wins:
        local = cut_window(model_path, (a, b),
                           home() / "shards" / shard_file_name(a, b, fp, model_path.stem))
        remote, sent = send_shard(request, local, fp, a, b, name=m.name)
        log.info("shard %d:%d -> %s: %d bytes sent", a, b, m.name, sent)
        paths[str(stage)] = remote
    return paths


def alive_nodes(addresses: Sequence[Address], key: bytes, timeout: float = DEAD_AFTER_S
                ) -> list[Address]:
    """The addresses whose node accepts our key and answers a ping in time."""
    alive = []
    for host, port in addresses:
        try:
            conn = connect(host, port, key, node_id="head-probe", timeout=max(timeout, 2.0))
        except Exception:
            continue
        try:
            conn.request(ctl.request_message(ctl.Ping()), timeout=max(timeout, 2.0))
            alive.append((host, port))
        except Exception:
            pass
        finally:
            conn.close()
    return alive


def reform_ring(addresses: Sequence[Address], model: str | os.PathLike[str], key: bytes,
                **form_kwargs: Any) -> RemoteChain:
    """A new ring over the nodes of ``addresses`` that answer now (after a node loss, or to
    take back nodes that returned).

    Windows are re-planned over them (memory permitting; otherwise the planner's error says
    how many layers do not fit) and loaded afresh.
    A node that answers but cannot take its windows (``NodeUnfit``: its disk full, its
    memory short) is left out and the ring re-planned over the rest, so one such node does
    not keep the ring down; it comes back at a later rebalance.
    """
    alive = alive_nodes(addresses, key)
    if not alive:
        raise NodeLost("no node of the ring is reachable any more")
    form_kwargs.pop("ranges", None)
    while True:
        log.warning("forming the ring over %d reachable node(s): %s", len(alive),
                    ", ".join(f"{h}:{p}" for h, p in alive))
        try:
            return form_ring(alive, model, key, **form_kwargs)
        except NodeUnfit as e:
            rest = [a for a in alive if tuple(a) != tuple(e.address)]
            if not rest or len(rest) == len(alive):
                raise
            log.warning("%s; forming the ring without it", e)
            alive = rest


def health_lap(chain: RemoteChain) -> float:
    """One token through every stage and back (then cleared); returns the lap time in ms."""
    t = time.perf_counter()
    chain.submit(Batch(np.array([0], np.int32), np.array([0], np.int32), [[0]],
                       np.zeros(1, np.int32), np.ones(1, bool), lap=0x7FFFFFFF))
    res = chain.next_result(timeout=HEALTH_LAP_TIMEOUT_S)
    if len(res.targets) != 1:
        raise RingError("health lap returned no token")
    chain.kv(KvOp.clear())
    return (time.perf_counter() - t) * 1e3


# ----------------------------------------------------------------------- leaving

def unload_nodes(nodes: Sequence[tuple[str, Address]], key: bytes, *, head: dict | None = None,
                 take_over: bool = False, say: Callable[[str], None] = log.info,
                 warn: Callable[[str], None] = log.warning) -> list[Address]:
    """Tell each node to unload its windows (freeing their memory); returns those that did.
    A node that is gone is reported and skipped; one held by another head refuses (RingBusy
    text) unless ``take_over``."""
    done = []
    for name, (host, port) in nodes:
        try:
            m = connect_members([(host, port)], key, "head", None)[0]
        except RingError as e:
            warn(f"{name}: unreachable ({e})")
            continue
        try:
            m.request("unload", timeout=60, head=head or head_identity(), take_over=take_over)
            say(f"{name}: windows unloaded")
            done.append((host, port))
        except RingError as e:
            warn(f"{name}: not unloaded ({e})")
        finally:
            m.close()
    return done




def attach_chain(state: RingState, key: bytes, *, head: dict | None = None,
                 take_over: bool = False) -> RemoteChain:
    """Reconnect to the nodes of a saved ring and take over as its head.

    Raises NodeLost when a node of the plan is unreachable or no longer holds its windows
    (it restarted), so the caller can re-form the ring instead of decoding garbage.
    """
    from edgespec.holder import describe_holder

    head = head or head_identity()
    try:
        members = connect_members([n.address for n in state.nodes], key, "head", None)
    except RingError as e:
        if "another ring key" in str(e):
            raise
        raise NodeLost(str(e)) from e
    try:
        windows = list(state.windows)
        for i, (m, n) in enumerate(zip(members, state.nodes, strict=True)):
            h = m.ask("health", timeout=CONNECT_TIMEOUT_S)
            m.name = h.name or n.name or m.name
            other = _holder_of(h, head)
            if other is not None and not take_over:
                raise RingBusy(f"the ring is held by {describe_holder(other)} (node {m.name}); "
                               f"go through it (`edgespec chat --server URL` for a running "
                               f"serve), stop it, or pass --take-over")
            held = {s: v.range for s, v in h.stages.items()}
            want = {w.stage: (w.start, w.stop) for w in windows if w.node == i}
            if held != want:
                raise NodeLost(f"{m.name} holds {sorted(held.items()) or 'nothing'} instead of "
                               f"its windows {sorted(want.items())} (it restarted?)")
        profiles = [NodeProfile(m.name, m.name, m.address[0], m.address[1]) for m in members]
        plan = Plan(profiles, windows, state.n_layer)
        link_stages(members, windows, None, {"head": head, "take_over": bool(take_over)})
    except BaseException:
        for m in members:
            m.close()
        raise
    from edgespec.llm.gguf_read import read_info

    chain = RemoteChain(members, plan, read_info(state.model).n_vocab, state.encoding,
                        n_seq_max=state.n_seq_max)
    chain.kv(KvOp.clear())
    return chain
