"""The errors a head tells apart, because each asks for a different response.

- ``RequestError``: the caller asked for something invalid (a sampling value out of range, a
  prompt longer than the context). Ends that request; an HTTP server answers 400. The ring is
  untouched.
- ``StageFailure``: a stage answered ERROR for work of this head (a refused batch, a failed
  decode). Ends that request with the stage's message (HTTP 500); the ring keeps serving, the
  head resynchronises its KV state, and nothing is rebuilt.
- ``NodeLost``: a connection to a node broke, or it missed its heartbeats. Only this starts a
  recovery (re-plan over the survivors, replay), and recoveries are bounded.
- ``TakenOver``: another head took the ring on purpose (``--take-over``): a ``NodeLost`` for
  the work in flight, but the head does not take the nodes back by itself.
- ``RingBusy``: the ring serves another head; the message names it and what to do.
- ``RingError``: the base of the last three, and what forming or attaching a ring raises.
"""

from __future__ import annotations


class RequestError(ValueError):
    """The caller's request is invalid; ``param`` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code  # OpenAI's error code where one fits (context_length_exceeded)


class RingError(RuntimeError):
    """The ring could not be formed, reached or used."""


class NodeLost(RingError):
    """A node's connection broke or it stopped answering heartbeats."""


class TakenOver(NodeLost):
    """Another head took this head's nodes on purpose (``--take-over``)."""


class StageFailure(RingError):
    """A stage answered ERROR for this head's work; ``code`` is the stage's error code."""

    def __init__(self, message: str, code: str = "stage_failed", lap: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.lap = lap


class NodeUnfit(RingError):
    """A node that answers could not take its windows (its disk full while shards arrived,
    its memory short when loading); ``address`` is the node's, so a ring re-formed after a
    loss can leave it out."""

    def __init__(self, message: str, address: tuple[str, int]) -> None:
        super().__init__(message)
        self.address = address


class RingBusy(RingError):
    """A node of the ring is held by another head."""
