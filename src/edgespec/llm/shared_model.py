"""One loaded copy of a GGUF for every context that reads it in this process.

Several rings in one process (a script's, the benchmarks' side-by-side rings), or drafters
made apart, each open their own context of the draft model (a ring's slots share one,
``edgespec.drafters.draft_context``). The weights are the same and llama.cpp only reads them
while decoding, so the contexts share one ``llama_model``: N contexts cost one model's
memory plus N KV caches, not N models.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from edgespec.llm.llamacpp import Model, load_model

_lock = threading.Lock()
_loaded: dict[str, tuple[Model, int]] = {}  # resolved path -> (model, holders)


def acquire_model(path: str | os.PathLike[str]) -> Model:
    """The model at ``path``, loaded once for all holders; give it back with
    ``release_model``. Raises as ``load_model`` does."""
    key = str(Path(path).resolve())
    with _lock:
        model, holders = _loaded.get(key, (None, 0))
        if model is None or model.closed:
            model, holders = load_model(path), 0
        _loaded[key] = (model, holders + 1)
        return model


def release_model(model: Model) -> None:
    """One holder is done with ``model``; the last one frees it (its contexts are the
    holders' to close first)."""
    key = str(Path(model.path).resolve())
    with _lock:
        shared, holders = _loaded.get(key, (None, 0))
        if shared is not model:  # not one of ours (or already freed): free it alone
            model.close()
            return
        if holders > 1:
            _loaded[key] = (model, holders - 1)
            return
        del _loaded[key]
    model.close()


def holders_of(path: str | os.PathLike[str]) -> int:
    """How many holders share the model at ``path`` now (0: not loaded)."""
    with _lock:
        return _loaded.get(str(Path(path).resolve()), (None, 0))[1]
