"""One head's generations over a chain, and what happens when the ring fails under them
(docs/design.md 5.4): the part of the head that owns retries, resynchronisation and replay,
like Petals' client-side inference session. ``edgespec.api.Ring`` is its public face.

- ``StageFailure`` (a stage failed this head's work): the request ends; the session abandons
  what is in flight and clears every stage's KV cache, so the next request starts clean on
  the same ring.
- ``NodeLost`` (a connection broke or heartbeats stopped): the session asks for the ring
  rebuilt (the ``recover`` callback: ``Scheduler.recover``, which rebuilds it once for every
  request, with retries and backoff, or raises ``RingError``) and the generation resumes
  exactly where it was (prompt + tokens so far, recomputed as its first batch).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from edgespec.errors import NodeLost, StageFailure
from edgespec.head.chain import Chain
from edgespec.params import Prepared

if TYPE_CHECKING:
    from edgespec.head.engine.runner import SpecEngine

log = logging.getLogger("edgespec")


class Session:
    """The chain a head drives, its engine, and the recovery of its generations."""

    def __init__(self, chain: Chain, engine: SpecEngine,
                 recover: Callable[[Exception], Chain] | None = None) -> None:
        self.chain = chain
        self.engine = engine
        self.recover = recover

    def tokens(self, request: Prepared, *, cancel: threading.Event | None = None,
               t_start: float | None = None) -> Iterator[list[int]]:
        """The accepted tokens of ``request``'s generation, chunk by chunk, across ring
        rebuilds.

        Close the iterator when done with it (also when stopping early): the engine's
        statistics then cover every ring the generation ran on. ``t_start``: when the request
        began (``time.perf_counter``), for the time to first token."""
        tokens: list[int] = []
        max_tokens = request.params.max_tokens
        previous = None
        try:
            while True:
                # After a rebuild: the prompt and the tokens so far, the rest of the budget.
                left = (request.params.replace(max_tokens=max_tokens - len(tokens)) if tokens
                        else request.params)
                run = self.engine.run(request.prompt + tokens, left, request.mode,
                                      cancel=cancel, replay=len(tokens), t_start=t_start)
                try:
                    for chunk in run:
                        tokens.extend(chunk)
                        yield chunk
                    return
                except NodeLost as exc:
                    if self.recover is None:
                        self.resync()
                        raise
                    previous = self.engine.stats.merged(previous)
                    self.recover_from(exc)
                    previous.recoveries += 1
                except StageFailure:
                    # This request ends; the ring stays, resynchronised for the next one.
                    self.resync()
                    raise
                finally:
                    run.close()
                if len(tokens) >= max_tokens:
                    return
        finally:
            if previous is not None:
                self.engine.stats = self.engine.stats.merged(previous)

    def recover_from(self, exc: Exception) -> None:
        """Go on on the rebuilt ring (``recover``; ``RingError`` when it cannot be). The old
        chain is the scheduler's to close, once, with the ring it replaces."""
        assert self.recover is not None
        self.chain = self.recover(exc)
        self.engine.replace_chain(self.chain)

    def resync(self) -> None:
        """After a stage failed this head's work: forget what is in flight and start the next
        generation from an empty KV cache on every stage (the ring itself is fine)."""
        abandon = getattr(self.chain, "abandon", None)
        if abandon is not None:
            abandon()
        self.engine.replace_chain(self.chain)
