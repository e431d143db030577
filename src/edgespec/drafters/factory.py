"""Picking the head's drafter from what the user asked for (``--drafter``, ``--draft``).

The one place that maps a drafter name to a drafter object, for local rings and remote ones.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from edgespec.drafters.base import Drafter
from edgespec.llm import models

__all__ = ["make_drafter", "shared_draft_context"]

#: Cells of a shared draft context beyond the ring's context, per slot: its tree's nodes.
TREE_CELLS_PER_SLOT = 512


def shared_draft_context(draft: str | os.PathLike[str] | None, kind: str, draft_quant: str,
                         parallel: int, n_ctx: int) -> Any:
    """The draft model's context that the ``parallel`` slots of a ring draft on together
    (``edgespec.drafters.draft_context``: concurrent decodes share a batch), or None where
    there is no draft model or only one slot. Its views go to ``make_drafter(seqs=...)``."""
    if draft is None or kind == "retrieval" or parallel <= 1:
        return None
    from edgespec.drafters.draft_context import DraftContext
    from edgespec.drafters.quant import fast_draft

    # The slots' conversations share the ring's n_ctx (n_ctx // parallel each), plus a tree
    # apiece; a drafter alone keeps its default 4096 cells.
    return DraftContext(fast_draft(models.resolve(draft), draft_quant), parallel=parallel,
                        n_ctx=max(n_ctx, 4096) + parallel * TREE_CELLS_PER_SLOT)


def make_drafter(model_path: Path, draft: str | os.PathLike[str] | None, kind: str = "auto",
                 draft_quant: str = "q4_0", seqs: Any = None) -> Drafter:
    """The head's drafter: retrieval alone, the draft model, or hybrid retrieval + model.

    ``kind="auto"``: the draft model when one is given (in flow mode it beat hybrid 2.08x to
    1.01x over ``none``: 1.5B target, 4 stages, 10 ms hops, 4 HumanEval prompts; retrieval's
    guesses take the hybrid's small per-segment budget first and are accepted less often),
    else retrieval. ``draft_quant``: draft with a cached Q4_0 copy of the draft model
    (``"none"``: as given); see :mod:`edgespec.drafters.quant` for why that never changes the
    output. ``seqs``: draft on this view of a ``shared_draft_context`` (the drafter owns it)."""
    from edgespec.drafters.ngram import RetrievalDrafter

    if draft is None or kind == "retrieval":
        return RetrievalDrafter()
    from edgespec.drafters.hybrid import HybridDrafter
    from edgespec.drafters.model import DraftModelDrafter
    from edgespec.drafters.quant import fast_draft

    draft_path = fast_draft(models.resolve(draft), draft_quant)
    model_drafter = DraftModelDrafter(draft_path, target=model_path, seqs=seqs)
    if kind in ("model", "auto"):
        return model_drafter
    return HybridDrafter(RetrievalDrafter(), model_drafter)
