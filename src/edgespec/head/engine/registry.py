"""The speculative modes a ring can run: one line per mode (its file is the rest). The CLI's
``--spec`` choices, the request model's ``spec`` field, ``GenerationParams`` and the web
page's mode menu (served in ``/v1/ring``) all read ``SPEC_MODES`` from here."""

from __future__ import annotations

from edgespec.head.engine.flow import FlowMode
from edgespec.head.engine.mode import Mode
from edgespec.head.engine.none import NoneMode
from edgespec.head.engine.sync import SyncMode

MODES: dict[str, type[Mode]] = {m.name: m for m in (NoneMode, SyncMode, FlowMode)}

#: Not a mode: the ring's own choice (``resolve``).
AUTO = "auto"
SPEC_MODES: tuple[str, ...] = (AUTO, *MODES)


def resolve(name: str, *, has_drafter: bool, n_stages: int) -> str:
    """The mode ``name`` runs as: ``auto`` is ``flow`` on a ring of several stages with a
    drafter, ``sync`` on one stage with a drafter, ``none`` without one. ValueError for a
    name that is not a mode, or a mode that needs the drafter this ring lacks."""
    if name == AUTO:
        if not has_drafter:
            return NoneMode.name
        return FlowMode.name if n_stages > 1 else SyncMode.name
    mode = MODES.get(name)
    if mode is None:
        raise ValueError(f"spec mode must be one of {', '.join(SPEC_MODES)}, got {name!r}")
    if mode.needs_drafter and not has_drafter:
        raise ValueError(f"spec={name!r} needs a drafter; this ring has none")
    return name


def help_text() -> str:
    """One line per mode, for ``--help``."""
    return "; ".join([f"{AUTO}: the ring's choice (flow with a drafter on several stages, "
                      f"sync on one, none without a drafter)"]
                     + [f"{n}: {m.summary}" for n, m in MODES.items()])
