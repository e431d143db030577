"""One head's generations over a chain, and what happens when the ring fails under them
(docs/design.md 5.4): the part of the head that owns retries, resynchronisation and replay,
like Petals' client-side inference session. ``edgespec.api.Ring`` is its public face.

- ``StageFailure`` (a stage failed this head's work): the request ends; the session abandons
  what is in flight and clears every stage's KV cache, so the next request starts clean on
  the same ring.
- ``NodeLost`` (a connection broke or heartbeats stopped): the ring is re-formed over the
  nodes that answer (the ``recover`` callback) and the generation resumes exactly where it
  was (prompt + tokens so far, recomputed as its first batch), at most ``MAX_RECOVERIES``
  times in a row with doubling backoff, then ``RingError``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from edgespec.batch import Sampling
from edgespec.errors import NodeLost, RingError, StageFailure
from edgespec.head.chain import Chain

log = logging.getLogger("edgespec")

#: Ring rebuilds tried in a row for one generation before giving up, and the first backoff.
MAX_RECOVERIES = 3
RECOVERY_BACKOFF_S = 0.5


class Session:
    """The chain a head drives, its engine, and the recovery of its generations."""

    def __init__(self, chain: Chain, engine: Any,
                 recover: Callable[[Exception], Chain] | None = None) -> None:
        self.chain = chain
        self.engine = engine
        self.recover = recover
        self.recovery_log: list[dict[str, Any]] = []  # one entry per ring rebuild

    def tokens(self, prompt_tokens: list[int], *, max_tokens: int, sampling: Sampling,
               mode: str, cancel: threading.Event | None = None,
               t_start: float | None = None, ignore_eos: bool = False) -> Iterator[list[int]]:
        """The accepted tokens of one generation, chunk by chunk, across ring rebuilds.

        Close the iterator when done with it (also when stopping early): the engine's
        statistics then cover every ring the generation ran on. ``t_start``: when the request
        began (``time.perf_counter``), for the time to first token."""
        tokens: list[int] = []
        previous = None
        try:
            while True:
                run = self.engine.run(prompt_tokens + tokens, max_tokens=max_tokens - len(tokens),
                                      sampling=sampling, mode=mode, cancel=cancel,
                                      replay=len(tokens), t_start=t_start,
                                      ignore_eos=ignore_eos)
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
        """Rebuild the ring over the nodes still alive and carry on (``recover`` callback).

        Tries at most MAX_RECOVERIES times, with doubling backoff while nodes are still
        unreachable; raises RingError saying so when the ring cannot be rebuilt."""
        assert self.recover is not None
        t0 = time.perf_counter()
        log.warning("ring failure: %s; re-planning over the remaining nodes", exc)
        with contextlib.suppress(Exception):
            self.chain.close()
        last: Exception = exc
        for attempt in range(1, MAX_RECOVERIES + 1):
            try:
                self.chain = self.recover(last)
                break
            except NodeLost as e:  # another node went, or none answers yet: wait, retry
                last = e
                log.warning("recovery attempt %d/%d failed: %s", attempt, MAX_RECOVERIES, e)
                time.sleep(RECOVERY_BACKOFF_S * 2 ** (attempt - 1))
            except RingError as e:  # the survivors cannot hold the model, a busy node...
                raise RingError(f"the ring lost a node ({exc}) and cannot be re-formed: "
                                f"{e}") from e
        else:
            raise RingError(f"the ring lost a node and could not be re-formed after "
                            f"{MAX_RECOVERIES} attempts: {last}") from last
        self.engine.replace_chain(self.chain)
        took = time.perf_counter() - t0
        self.recovery_log.append({"error": str(exc), "seconds": round(took, 3),
                                  "stages": self.chain.n_stages})
        log.warning("ring recovered in %.2f s with %d stage(s)", took, self.chain.n_stages)

    def resync(self) -> None:
        """After a stage failed this head's work: forget what is in flight and start the next
        generation from an empty KV cache on every stage (the ring itself is fine)."""
        abandon = getattr(self.chain, "abandon", None)
        if abandon is not None:
            abandon()
        self.engine.replace_chain(self.chain)
