"""`edgespec chat`, `edgespec serve` and `edgespec demo`: using a ring (local or up)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from edgespec.cli.common import MIN_CTX, _add, _at_least
from edgespec.cli.hangup import exit_on_hangup
from edgespec.head.engine.registry import SPEC_MODES, help_text
from edgespec.sampling import add_flags, given_flags

# ------------------------------------------------------------------------------- run a ring

def _add_ring_choice(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2.5-coder-0.5b", action=_StoreGiven,
                   help="registry name or .gguf path for a local ring (default: "
                        "qwen2.5-coder-0.5b; a ring that is up keeps its own model, with a "
                        "warning if it is another one)")
    p.add_argument("--local", type=_at_least(1), default=None, metavar="N",
                   help="start a local ring of N node processes instead of attaching to the "
                        "ring that is up (default: attach if one is up, else N=2)")
    p.add_argument("--spec", choices=SPEC_MODES, default="auto",
                   help=f"speculative decoding mode ({help_text()})")
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

    # Slots (serve --parallel S): only asked for when more than one, so S=1 is exactly the
    # ring as chat opens it.
    slots = getattr(args, "parallel", 1)
    extra = {"parallel": slots} if slots != 1 else {}
    if args.local is None and state_path().exists():
        return Ring.attach(spec=args.spec, draft=args.draft, draft_quant=args.draft_quant,
                           take_over=args.take_over, **extra)
    n = args.local or 2
    print(f"starting a local ring of {n} node processes for {args.model}...", file=sys.stderr)
    return Ring.local(args.model, stages=n, draft=args.draft, spec=args.spec, n_ctx=args.ctx,
                      verbose=args.verbose, draft_quant=args.draft_quant, **extra)


def json_schema_file(path: str | None) -> dict | None:
    """The JSON schema in the file given to ``--json-schema`` (None without one); ValueError
    with one line for a file that is missing, unreadable, not JSON or not a schema llguidance
    takes."""
    import json

    from edgespec.grammar import Grammar

    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--json-schema {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--json-schema {path}: cannot read it ({e})") from None
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--json-schema {path}: not valid JSON ({e})") from None
    # A schema llguidance cannot follow fails here, before a ring is started or reached.
    Grammar.json_schema(schema, param=f"--json-schema {path}")
    return schema


def _chat(args: argparse.Namespace) -> int:
    from edgespec.chat import run_chat, run_server_chat

    exit_on_hangup()

    schema = json_schema_file(args.json_schema)
    if args.server:
        if args.local is not None:
            raise ValueError("--server talks to a running `edgespec serve`, --local N starts "
                             "a ring of its own: give one of them")
        return run_server_chat(args.server, api_key=args.api_key, system=args.system,
                               max_tokens=args.max_tokens, json_schema=schema,
                               ca_file=args.ca_file, **given_flags(args))
    with _open_ring(args) as ring:
        _warn_other_model(args, ring)
        return run_chat(ring, system=args.system, max_tokens=args.max_tokens, spec=args.spec,
                        json_schema=schema, **given_flags(args))


def _warn_other_model(args: argparse.Namespace, ring) -> None:
    """``--model`` names the model of a local ring; a ring that is up keeps its own. Say so
    when the user asked for another one instead of silently chatting with the wrong model."""

    from edgespec.llm.models import REGISTRY

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
    p.add_argument("--ca-file", default=None, metavar="FILE",
                   help="trust the HTTPS --server whose certificate (or its CA) is FILE, e.g. "
                        "the serve-cert.pem of `serve --tls-self-signed`")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=_at_least(1), default=512,
                   help="answer length limit (capped to the room left in the context)")
    sampler = p.add_argument_group("sampling (every answer; greedy unless --temperature)")
    add_flags(sampler)
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain every answer to one JSON value valid against the JSON "
                        "schema in FILE (over --server: sent as response_format)")


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

    import socket

    from edgespec.cli.served import local_url, serve_record
    from edgespec.head import remote
    from edgespec.server.app import serve

    _check_port_free(args.host, args.port)
    tls = _tls_files(args)
    scheme = "https" if tls else "http"
    if args.port:
        # The nodes show this URL as their holder's, so `ring rebalance` run on any machine
        # goes through this server (a wildcard address is named by this host's name).
        wild = args.host in ("0.0.0.0", "::", "")
        remote.SERVING_URL = (f"{scheme}://{socket.gethostname()}:{args.port}" if wild
                              else local_url(args.host, args.port, scheme))
    # The record lets `edgespec ring status` and `ring rebalance` find this server.
    with _open_ring(args) as ring, serve_record(args.host, args.port, scheme) as record:
        # --model is what the user calls the model (a registry name or a path): clients
        # may use it as the model id too.
        serve(ring, args.served_name or ring.model_name, host=args.host, port=args.port,
              max_queue=args.max_queue, aliases=[args.model],
              api_key=args.api_key or os.environ.get("EDGESPEC_API_KEY") or None,
              allow_hosts=args.allow_host, read_timeout=args.read_timeout, tls=tls,
              on_ready=lambda url: record.write(local_url(args.host, int(url.rsplit(":", 1)[1]),
                                                          scheme)))
    return 0


def _tls_files(args: argparse.Namespace) -> tuple[str, str] | None:
    """The (certificate, key) files `serve` answers HTTPS with, or None for plain HTTP:
    those given, or the self-signed pair kept beside the ring key (made on first use)."""
    if args.tls_self_signed:
        if args.tls_cert or args.tls_key:
            raise ValueError("give --tls-self-signed or --tls-cert/--tls-key, not both")
        from edgespec.server.tls import self_signed
        from edgespec.wire.auth import default_key_path

        cert, key = self_signed(default_key_path().parent, [args.host, *args.allow_host])
        return str(cert), str(key)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    for f in (args.tls_cert, args.tls_key):
        if f and not os.path.isfile(f):
            raise ValueError(f"no such file: {f}")
    return (args.tls_cert, args.tls_key) if args.tls_cert else None


def _add_serve(sub) -> None:
    p = _add(sub, "serve", "OpenAI-, Ollama- and Anthropic-compatible HTTP(S) server over the "
             "ring",
             "Serves /v1/models, /v1/completions and /v1/chat/completions (with streaming), "
             "OpenAI's /v1/responses, Anthropic's /v1/messages, the Ollama API under /api, "
             "and a web page at / (chat, the ring drawn live, the token tree, session "
             "charts; live data: /v1/ring). Up to --parallel requests run at once, one per "
             "slot of the ring; the rest wait in arrival order, and beyond --max-queue "
             "waiting requests the server answers 429. /health and `edgespec ring status` "
             "show the slots.", func=_serve)
    _add_ring_choice(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--parallel", type=_at_least(1, why=" (slots share the ring's 256 "
                                                      "sequences)"), default=1, metavar="S",
                   help="requests served at once (slots): each slot holds its own sequences "
                        "and history in the stages' KV caches and gets --ctx / S of the "
                        "context and 256 / S of the tree sequences, and the requests' "
                        "batches travel the ring together (stage k on one request while "
                        "stage k+1 works on another). 1 = one request at a time, in "
                        "arrival order (default: %(default)s)")
    p.add_argument("--max-queue", type=_at_least(0), default=16,
                   help="requests allowed to wait for a free slot; beyond: 429")
    p.add_argument("--served-name", default=None,
                   help="model id reported to clients (default: the model file's name)")
    p.add_argument("--api-key", default=None,
                   help="require this bearer token on every endpoint, the web page included; "
                        "without the flag, $EDGESPEC_API_KEY if set. Set one when --host shares "
                        "the server on the LAN")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host is NAME (repeatable), e.g. the name "
                        "a reverse proxy or your LAN's DNS gives this machine. Requests naming "
                        "any other host are refused (a web page elsewhere cannot reach this "
                        "server through DNS rebinding); localhost names, the --host address "
                        "and, with --host 0.0.0.0, this machine's addresses and name are "
                        "always allowed")
    p.add_argument("--tls-cert", default=None, metavar="FILE",
                   help="serve HTTPS with this PEM certificate (chain); needs --tls-key")
    p.add_argument("--tls-key", default=None, metavar="FILE",
                   help="the PEM private key of --tls-cert")
    p.add_argument("--tls-self-signed", action="store_true",
                   help="serve HTTPS with a self-signed certificate made on first use and kept "
                        "beside the ring key (serve-cert.pem); its SHA-256 fingerprint is "
                        "printed at start. Clients trust it with e.g. curl --cacert FILE")
    p.add_argument("--read-timeout", type=float, default=15.0, metavar="S",
                   help="seconds a client has to send a whole request, headers and body; "
                        "slower connections are dropped (default: %(default)s)")


def _demo(args: argparse.Namespace) -> int:
    from edgespec.demo import run_demo

    exit_on_hangup()
    return run_demo(args)


def _add_demo(sub) -> None:
    p = _add(sub, "demo", "one-command local demo: fetch the default model, start a 2-node "
             "ring, stream an answer with speculation, print statistics", func=_demo)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name or .gguf path")
    p.add_argument("--stages", type=_at_least(1), default=2,
                   help="node processes in the local ring")
    p.add_argument("--spec", choices=SPEC_MODES, default="auto",
                   help=f"speculative decoding mode ({help_text()})")
    p.add_argument("--max-tokens", type=_at_least(1), default=256, help="answer length")
    p.add_argument("--prompt", default=None,
                   help="your own prompt (default: a short Python task)")
