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
from collections.abc import Sequence

from edgespec import __version__
from edgespec.cli.common import VERBOSE_HELP, _Formatter, _Parser
from edgespec.cli.files import _add_keygen, _add_models, _add_shard
from edgespec.cli.ring import _add_node, _add_ring
from edgespec.cli.run import _add_chat, _add_demo, _add_serve

EPILOG = """\
typical use:
  edgespec demo                                one machine: 2-node ring, speculative answer
  edgespec keygen                              create the ring key (copy it to every node)
  edgespec node                                on every device
  edgespec ring up --expect 3                  discover the nodes, plan, load, link
  edgespec chat                                chat with the ring that is up
  edgespec serve --port 8080                   OpenAI/Ollama/Anthropic APIs over the ring

Run `edgespec COMMAND --help` for the options of each command.
"""


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
    from edgespec.wire.auth import default_key_path

    key = getattr(args, "key_file", None) or default_key_path()
    return (f"every member must hold the same ring key: copy {key} to that node and start it "
            f"with `edgespec node --key-file PATH`")


def explain(exc: BaseException, args: argparse.Namespace) -> str | None:
    """One line for a failure the user can cause, naming what failed and the fix; None for
    anything else (a bug: then the traceback matters)."""
    import errno as _errno

    from edgespec.errors import RequestError
    from edgespec.errors import RingError as _RingError
    from edgespec.llm.gguf_read import ShardError
    from edgespec.llm.models import ModelError
    from edgespec.wire.auth import AuthError, KeyFileError
    from edgespec.wire.transport import TransportError

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
        from edgespec.llm.llamacpp import LlamaLoadError
        from edgespec.wire.discovery import DiscoveryError
        from edgespec.wire.transfer import TransferError
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
