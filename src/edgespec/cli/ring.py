"""`edgespec node` and `edgespec ring up / status / down / rebalance`: forming and keeping a ring."""

from __future__ import annotations

import argparse
import sys

from edgespec.cli.common import _add, _set_help

# ------------------------------------------------------------------------------------ node

def _node(args: argparse.Namespace) -> int:
    from edgespec.node.daemon import run_node_command

    return run_node_command(args)


def _add_node(sub) -> None:
    from edgespec.node.daemon import add_node_arguments

    p = _add(sub, "node", "run a ring member on this device (hosts stage windows)",
             "Starts the node daemon: it advertises itself over mDNS as _edgespec._tcp, "
             "accepts only peers that prove the ring key, loads the layer windows the head "
             "assigns, and passes hidden states straight to the next node. Stop it with "
             "Ctrl-C or SIGTERM.", func=_node)
    add_node_arguments(p)
    _set_help(p, "--cache", "directory for the node's id, models and received shards "
              "(default: $EDGESPEC_HOME, else ~/.cache/edgespec)")


# ------------------------------------------------------------------------------------ ring

def _ring_up(args: argparse.Namespace) -> int:
    from edgespec.head.build import find_nodes, ring_up
    from edgespec.head.remote import head_identity
    from edgespec.llm.models import resolve
    from edgespec.llm.shards import parse_ranges
    from edgespec.wire.auth import ensure_key

    key = ensure_key(args.key_file)
    model = resolve(args.model)
    if args.nodes == "auto":
        print(f"looking for nodes over mDNS ({args.timeout:.0f} s)...", file=sys.stderr)
    addrs = find_nodes(args.nodes, key, expect=args.expect, timeout=args.timeout, log_fn=print)
    if args.nodes == "auto":
        print(f"found {len(addrs)} node(s): " + ", ".join(f"{h}:{p}" for h, p in addrs))
    ranges = parse_ranges(args.ranges) if args.ranges else None
    if args.plan:
        import json
        from pathlib import Path

        ranges = [tuple(r) for r in json.loads(Path(args.plan).read_text())["ranges"]]
    chain, path = ring_up(model, addrs, key, key_file=args.key_file, ranges=ranges,
                          rounds=args.rounds, n_ctx=args.ctx, encoding=args.activations,
                          profile=not args.no_profile, head=head_identity("edgespec ring up"),
                          take_over=args.take_over, log_fn=print,
                          warn=lambda s: print(s, file=sys.stderr))
    chain.close()
    print(f"ring is up: {len(chain.plan.windows)} stages on {len(addrs)} node(s); "
          f"state saved to {path}")
    return 0


def _fmt_gb(v) -> str:
    return f"{int(v) / 2**30:.1f}GB" if v else "-"


def _fmt_device(r) -> str:
    """A node's compute device for ``ring status``: its backend, and a discrete device's
    free / total memory (a unified one shares the free RAM shown beside it)."""
    if not r.backend:
        return "-"
    if r.backend == "cpu" or not r.device:
        return "cpu"
    if r.unified:
        return f"{r.backend} (unified)"
    return f"{r.backend} {_fmt_gb(r.free_vram)}/{_fmt_gb(r.total_vram)}"


def _server_health(args: argparse.Namespace) -> tuple[str | None, dict | None, str | None]:
    """(URL, its /health, why not) of the `edgespec serve` holding the ring: --server, else
    the one running on this host (its record); (None, None, None) when there is none."""
    import os

    from edgespec.cli.served import fetch_json, running_server

    url = args.server or running_server()
    if url is None:
        return None, None, None
    try:
        return url, fetch_json(url, "/health", args.api_key
                               or os.environ.get("EDGESPEC_API_KEY")), None
    except Exception as e:  # the node rows are still worth printing
        why = f"{type(e).__name__}: {e}"
        if "401" in why:
            why += " (give its key: --api-key or $EDGESPEC_API_KEY)"
        return url, None, why


def _print_slots(url: str | None, health: dict | None, why: str | None) -> None:
    from edgespec.head.view import slot_lines

    if url is None:
        return
    if health is None:
        print(f"slots: the server at {url} did not answer: {why}")
        return
    slots = health.get("slots") or []
    busy = sum(1 for s in slots if s.get("state") == "busy")
    print(f"slots (edgespec serve at {url}): {health.get('parallel', len(slots))}, {busy} busy, "
          f"{health.get('queued', 0)} queued")
    for line in slot_lines(slots):
        print("  " + line)


def _ring_status(args: argparse.Namespace) -> int:
    import json

    from edgespec.errors import RingError
    from edgespec.head.state import load_state
    from edgespec.head.view import view_of_state
    from edgespec.holder import describe_holder
    from edgespec.wire.auth import load_key

    url, health, why = _server_health(args)
    try:
        state = load_state()
    except RingError:
        if health is None:
            raise
        return _served_ring_status(args, url, health, why)
    key = load_key(args.key_file or state.key_file)
    view = view_of_state(state, key)
    if health is not None:  # only the head holding the ring knows its slots
        view.parallel, view.slots = health.get("parallel"), health.get("slots")
    if args.json:
        print(json.dumps(view.to_dict(), indent=2))
        return 0
    rows = view.nodes
    nodes_in = sum(1 for r in rows if not r.left)
    holders = {r.holder["id"]: r.holder for r in rows if r.holder}
    print(f"model: {state.model}")
    print(f"plan in force: {len(state.windows)} stage(s) on {nodes_in} node(s), "
          f"{state.n_seq_max} sequences per context"
          + (f"; held by {', '.join(describe_holder(h) for h in holders.values())}"
             if holders else "; no head attached"))
    print(f"{'node':<16} {'address':<22} {'layers':<12} {'free RAM':>9} {'device':<20} "
          f"{'RTT ms':>7}  state")
    bad = 0
    for r in rows:
        layers = ",".join(f"{a}:{b}" for _s, (a, b) in sorted(r.plan.items())) or "-"
        rtt = f"{r.rtt_ms:.2f}" if r.rtt_ms is not None else "-"
        state_txt = r.state
        if r.state == "other windows":
            state_txt += " (" + ",".join(f"{a}:{b}" for a, b in r.held.values()) + ")"
        elif r.state == "unreachable":
            state_txt += f" ({r.error})"
        elif r.state == "returned":
            state_txt += " (answers again: `edgespec ring rebalance` takes it back)"
        elif r.state == "left":
            state_txt += f" ({r.reason or 'not in the ring'})"
        if not r.left and r.state != "loaded":
            bad += 1
        print(f"{r.name[:16]:<16} {r.address:<22} {layers:<12} {_fmt_gb(r.free_ram):>9}"
              f" {_fmt_device(r)[:20]:<20} {rtt:>7}  {state_txt}")
    for r in rows:
        if r.device:
            print(f"  {r.name}: {r.device}")
    if bad:
        print(f"{bad} node(s) of the plan are not serving it: run `edgespec ring rebalance`")
    _print_slots(url, health, why)
    return 0


def _served_ring_status(args: argparse.Namespace, url: str, health: dict,
                        why: str | None) -> int:
    """No ring is up, but a server runs a ring of its own (`serve --local N`): the ring as
    that server sees it (``GET /v1/ring``: the same view)."""
    import json
    import os

    from edgespec.cli.served import fetch_json

    view = fetch_json(url, "/v1/ring", args.api_key or os.environ.get("EDGESPEC_API_KEY"))
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    print(f"model: {view.get('model')} (the ring of the edgespec serve at {url}; no ring is up)")
    for st in view.get("stages", []):
        a, b = st.get("layers", [0, 0])
        print(f"  stage {st.get('stage')}: layers {a}:{b} on {st.get('node')}"
              + ("" if st.get("alive", True) else " (lost)"))
    _print_slots(url, health, why)
    return 0


def _holders(state, key: bytes) -> dict[str, dict]:
    """The heads holding nodes of the saved ring now (asked of every node), by head id."""
    from edgespec.head.view import view_of_state

    view = view_of_state(state, key)
    return {r.holder["id"]: r.holder for r in view.nodes if r.holder and not r.left}


def _serving_url(holder: dict, args: argparse.Namespace) -> str | None:
    """Where the head ``holder`` answers, if it is an `edgespec serve`: ``--server``, the URL
    it told its nodes, or its record on this host."""
    import json

    from edgespec.cli.served import record_path, running_server

    if args.server:
        return args.server
    if holder.get("url"):
        return str(holder["url"])
    url = running_server()
    if url is not None:
        try:
            rec = json.loads(record_path().read_text())
        except (OSError, ValueError):
            return None
        if rec.get("pid") == holder.get("pid") and rec.get("host") == holder.get("host"):
            return url
    return None


def _ring_down(args: argparse.Namespace) -> int:
    from edgespec.head.formation import unload_nodes
    from edgespec.head.remote import head_identity
    from edgespec.head.state import load_state, state_path
    from edgespec.holder import describe_holder
    from edgespec.wire.auth import load_key

    state = load_state()
    key = load_key(args.key_file or state.key_file)
    if not args.take_over:
        holders = _holders(state, key)
        if holders:
            # Taking the ring from under a running head is never what a plain `down` means:
            # the head would go on using (or take back) the nodes. Its state stays.
            h = next(iter(holders.values()))
            print(f"edgespec: the ring is held by {describe_holder(h)}"
                  + (f" at {h['url']}" if h.get("url") else "")
                  + ": stop it first (Ctrl-C or SIGTERM), or pass --take-over to unload "
                    "the ring from under it (its requests then fail); nothing was changed",
                  file=sys.stderr)
            return 1
    nodes = state.named_nodes()
    done = unload_nodes(nodes, key, head=head_identity("edgespec ring down"),
                        take_over=args.take_over, say=print,
                        warn=lambda s: print(s, file=sys.stderr))
    missed = len(nodes) - len(done)
    if missed and not args.take_over and _holders(state, key):
        print("edgespec: a head took nodes of the ring meanwhile; the ring state is kept",
              file=sys.stderr)
        return 1
    state_path().unlink(missing_ok=True)
    print("ring is down" + (f"; {missed} node(s) not reached (they hold nothing of it once "
                            f"restarted)" if missed else ""))
    return 0


def _rebalance_through(url: str, holder: dict, args: argparse.Namespace) -> int:
    """Ask the serving head at ``url`` to rebalance the ring it holds."""
    import json
    import os
    import urllib.error
    import urllib.request

    from edgespec.cli.served import tls_context
    from edgespec.holder import describe_holder

    body = {"profile": not args.no_profile,
            "nodes": [n.strip() for n in (args.nodes or "").split(",") if n.strip()]}
    req = urllib.request.Request(url.rstrip("/") + "/v1/ring/rebalance",
                                 json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    api_key = args.api_key or os.environ.get("EDGESPEC_API_KEY")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    print(f"the ring is held by {describe_holder(holder)}: rebalancing through it at {url} "
          "(requests in flight finish first)...")
    try:
        with urllib.request.urlopen(req, timeout=args.wait,  # noqa: S310 - http(s)
                                    context=tls_context(url)) as r:
            view = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read())["error"]["message"]
        except Exception:
            why = e.reason
        hint = " (give its key: --api-key or $EDGESPEC_API_KEY)" if e.code == 401 else ""
        print(f"edgespec: the server at {url} refused the rebalance ({e.code}): {why}{hint}",
              file=sys.stderr)
        return 1
    except OSError as e:
        print(f"edgespec: the server at {url} did not answer: {e}; give its URL with --server",
              file=sys.stderr)
        return 1
    stages = view.get("stages") or []
    print(f"ring rebalanced by the server: {len(stages)} stage(s): " + ", ".join(
        f"{s['layers'][0]}:{s['layers'][1]} on {s['node']}" for s in stages))
    return 0


def _ring_rebalance(args: argparse.Namespace) -> int:
    from edgespec.head.addresses import parse_nodes
    from edgespec.head.formation import reform_ring
    from edgespec.head.remote import head_identity
    from edgespec.head.state import load_state, save_state
    from edgespec.holder import describe_holder
    from edgespec.wire.auth import load_key

    state = load_state()
    key = load_key(args.key_file or state.key_file)
    if not args.take_over:
        holders = _holders(state, key)
        if holders:
            h = next(iter(holders.values()))
            url = _serving_url(h, args)
            if url is not None:
                return _rebalance_through(url, h, args)
            print(f"edgespec: the ring is held by {describe_holder(h)}, which takes no "
                  "rebalance from outside: stop it first, give the URL of the `edgespec "
                  "serve` holding it with --server, or pass --take-over", file=sys.stderr)
            return 1
    addrs = state.node_addresses()
    if args.nodes:
        addrs += [a for a in parse_nodes(args.nodes) if a not in addrs]
    chain = reform_ring(addrs, state.model, key, n_ctx=state.n_ctx, encoding=state.encoding,
                        profile=not args.no_profile, log_fn=print,
                        head=head_identity("edgespec ring rebalance"),
                        take_over=args.take_over)
    try:
        path = save_state(chain, state.model, state.options, known=addrs,
                          reason="did not answer at rebalance")
    finally:
        chain.close()
    print(f"ring rebalanced: {len(chain.plan.windows)} stage(s) over {len(chain.members)} "
          f"node(s); state saved to {path}")
    return 0


def _add_ring(sub) -> None:
    p = _add(sub, "ring", "form, inspect and stop a ring of nodes")
    rsub = p.add_subparsers(dest="ring_cmd", metavar="ACTION", required=True)
    up = _add(rsub, "up", "discover nodes, plan layer windows, load them and link the ring",
              "Finds nodes (mDNS or a list), profiles each one's speed on this model, plans "
              "contiguous layer windows by speed and memory, has every node cut and load its "
              "windows from its own copy of the model, links the stages node to node, runs a "
              "health lap and saves the ring state for `chat`, `serve` and Python.",
              func=_ring_up)
    up.add_argument("--model", default="qwen2.5-coder-0.5b",
                    help="registry name or .gguf path (the same file must be on every node)")
    up.add_argument("--nodes", default="auto", help="'auto' (mDNS) or host:port,host:port,...")
    up.add_argument("--expect", type=int, default=None, help="wait for this many nodes")
    up.add_argument("--timeout", type=float, default=5.0, help="mDNS discovery time (s)")
    up.add_argument("--rounds", type=int, default=1,
                    help="windows per node (prima.cpp piped ring: a lap visits each node k times)")
    up.add_argument("--ranges", default=None, help="override the plan: 0:12,12:24,...")
    up.add_argument("--plan", default=None, help="override the plan with a JSON file "
                    '{"ranges": [[0,12],[12,24]]}')
    up.add_argument("--ctx", type=int, default=4096, help="context size (KV cells) per stage")
    up.add_argument("--activations", choices=("f32", "f16", "q8"), default="f32",
                    help="hidden-state encoding between stages: f32 is exact (output identical to the "
                         "unsplit model); f16 and q8 halve and quarter the bytes per hop but may "
                         "change greedy output on near ties")
    up.add_argument("--no-profile", action="store_true", help="skip profiling (even split)")
    up.add_argument("--key-file", default=None, help="ring key (created if missing)")
    up.add_argument("--take-over", action="store_true",
                    help="take nodes held by another head (that head's requests then fail)")
    st = _add(rsub, "status", "show the ring as it is: each node's windows, links, memory, "
              "RTT and the head holding it", func=_ring_status)
    st.add_argument("--key-file", default=None, help="ring key")
    st.add_argument("--json", action="store_true",
                    help="print the ring view as JSON (the shape `GET /v1/ring` serves)")
    st.add_argument("--server", default=None, metavar="URL",
                    help="the `edgespec serve` holding the ring, asked for its slots (busy/"
                         "free, tokens, speed); default: the one running on this host")
    st.add_argument("--api-key", default=None,
                    help="that server's key (default: $EDGESPEC_API_KEY, if set)")
    dn = _add(rsub, "down", "unload every node's windows and forget the ring",
              "Refused (exit 1, nothing changed) while a head holds the ring: stop that "
              "head (an `edgespec serve`, a chat) first.", func=_ring_down)
    dn.add_argument("--key-file", default=None, help="ring key")
    dn.add_argument("--take-over", action="store_true",
                    help="unload nodes even while another head (chat, serve) holds them; that "
                         "head's requests then fail and it does not take the ring back")
    rb = _add(rsub, "rebalance", "re-plan the ring over every reachable node (takes back a "
              "node that returned after a loss)",
              "While an `edgespec serve` holds the ring, the rebalance goes through it (its "
              "requests in flight finish first, new ones wait for the new plan); while any "
              "other head holds it, it is refused (exit 1).", func=_ring_rebalance)
    rb.add_argument("--nodes", default=None, help="extra host:port,... to take in")
    rb.add_argument("--no-profile", action="store_true", help="skip profiling (even split)")
    rb.add_argument("--key-file", default=None, help="ring key")
    rb.add_argument("--take-over", action="store_true",
                    help="re-form here even while another head (chat, serve) holds the nodes; "
                         "that head's requests then fail and it does not take the ring back")
    rb.add_argument("--server", default=None, metavar="URL",
                    help="the `edgespec serve` holding the ring (default: the URL its nodes "
                         "name, or the server running on this host)")
    rb.add_argument("--api-key", default=None,
                    help="that server's key (default: $EDGESPEC_API_KEY, if set)")
    rb.add_argument("--wait", type=float, default=900.0, metavar="S",
                    help="seconds to wait for a server's rebalance (default: %(default)s)")
