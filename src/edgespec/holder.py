"""What a head and a node both read about the head that holds or started a node: how users
are told which head that is (``describe_holder``), and the environment variable by which a
head marks the node processes it starts itself (``PARENT_ENV``). Neutral ground, so that
neither ``edgespec.head`` nor ``edgespec.node`` imports the other (docs/design.md 7).
"""

from __future__ import annotations

#: Set by a head that starts node processes itself (``Ring.local``) to its own pid.
PARENT_ENV = "EDGESPEC_PARENT_PID"


def describe_holder(h: dict) -> str:
    """A head identity as users read it: "edgespec serve (pid 123 on box, since 12:00:01)"."""
    import time

    since = time.strftime("%H:%M:%S", time.localtime(float(h.get("since") or 0)))
    return (f"{h.get('what') or 'a head'} (pid {h.get('pid', '?')} on {h.get('host', '?')}, "
            f"since {since})")
