"""What the benchmarks' ``--smoke`` modes share: a tiny model and a scratch folder.

A smoke run takes seconds: the benchmark's real code path (llama.cpp contexts, node processes,
links) on a tiny random-weight GGUF (``tests/tinygguf.py``), writing its output under the
system's temporary folder, never into ``bench/results/``. Its figures mean nothing; that it
runs and reports every field does.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def scratch_dir() -> Path:
    """The folder smoke runs write into (created on first use)."""
    d = Path(tempfile.gettempdir()) / "edgespec-bench-smoke"
    d.mkdir(parents=True, exist_ok=True)
    return d


def scratch_path(name: str) -> Path:
    """``name`` in the scratch folder: where a smoke run writes what a full run keeps."""
    return scratch_dir() / name


def tiny_model(kind: str = "target") -> str:
    """Path of a tiny qwen2 GGUF (made once in the scratch folder): ``target`` has 4 layers,
    ``draft`` 2 layers and other weights, both on the same vocabulary."""
    n_layer, seed = {"target": (4, 3), "draft": (2, 4)}[kind]
    path = scratch_dir() / f"tiny-{kind}.gguf"
    if not path.is_file():
        sys.path.insert(0, str(REPO / "tests"))
        from tinygguf import make_tiny_gguf

        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        make_tiny_gguf(partial, "qwen2", n_layer=n_layer, n_embd=64, seed=seed)
        os.replace(partial, path)  # atomic: a concurrent smoke run sees no file or the whole one
    return str(path)


def apply(ap: argparse.ArgumentParser, args: argparse.Namespace, **small: Any) -> None:
    """Set each of ``small`` on ``args`` where the command line left the parser's default, so a
    flag given beside ``--smoke`` still wins. A callable value is called only when it is used
    (``tiny_model``: no tiny model is made for a flag given)."""
    for name, value in small.items():
        if getattr(args, name) == ap.get_default(name):
            setattr(args, name, value() if callable(value) else value)
