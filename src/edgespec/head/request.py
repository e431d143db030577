"""A request on the head (``Request``), from ``Ring.prepare`` to its ``Generation``
(docs/design.md 5.8).

``Ring.prepare`` checks it against the ring and makes it once: its prompt, its settings with
``max_tokens`` fitted to the context, the mode it runs in (resolved there, never "auto").
Streaming it hands it to the ring's loop (``edgespec.head.loop``), which alone writes the rest
while it runs: its place in the queue, its slot, the coroutine of its generation, the tokens
accepted so far (the source of a replay after a lost node), its output (text, end, log
probabilities: ``OutputProcessor``, run on the loop so an end frees its rows at once), and in
the end its ``Generation`` or its error. The engine of the slot it runs on keeps its
generation's state here too (statistics, log probabilities, sampler, drafter), so a slot holds
only what its KV cache holds and a replay finds everything on the request. Whoever reads it (``TextStream``: Python, the chat
CLI, the server) only takes pieces from ``outbox`` and sets ``cancel``.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgespec.head.engine.sampler import SamplerHandle
from edgespec.head.engine.scores import ScoreQueue
from edgespec.head.engine.stats import GenerationStats
from edgespec.head.output import OutputProcessor, TokenLogprob
from edgespec.params import GenerationParams
from edgespec.sampling import SamplerSettings

if TYPE_CHECKING:
    from edgespec.drafters.base import Drafter
    from edgespec.head.engine.mode import Steps
    from edgespec.head.scheduler import Ticket
    from edgespec.head.slots import Slot


@dataclass
class Generation:
    """The result of one generation."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    #: "stop" (end of generation or a stop sequence), "length" (max_tokens) or "cancelled"
    #: (its ``cancel`` event was set before either).
    finish_reason: str
    #: The max_tokens actually used when the one asked for did not fit in the context left
    #: after the prompt (llama.cpp's rule: cap, don't fail); None when it fitted.
    capped_max_tokens: int | None = None
    #: With ``logprobs``: each token's log probability and the most likely tokens' there
    #: (``TokenLogprob``, one per token of ``tokens``); None when not asked for.
    logprobs: list[TokenLogprob] | None = None


#: What ``Request.outbox`` holds after the last piece.
END = None


@dataclass(eq=False)
class Request:
    """One request, as ``Ring.prepare`` checked it and as the ring's loop runs it."""

    prompt: list[int]
    params: GenerationParams
    #: The mode it runs in on this ring (resolved by ``Ring.prepare``: never "auto").
    mode: str
    #: The max_tokens used when the one asked for did not fit (None: it fitted).
    capped: int | None = None

    # ---- set when it is streamed (``Ring.stream_prepared``)
    ticket: Ticket | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    output: OutputProcessor | None = None
    t_start: float = 0.0
    #: Text pieces for the reader, then ``END``; an exception instead of ``END`` if it failed.
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    #: Set once ``result`` (or ``error``) is final.
    done: threading.Event = field(default_factory=threading.Event)
    result: Generation | None = None
    error: BaseException | None = None

    # ---- the loop's, while it runs
    status: str = "new"  # -> queued -> running -> done / cancelled / failed / withdrawn
    slot: Slot | None = None
    coro: Steps | None = None
    #: What its coroutine gets when resumed; ``blocked``: it waits for its slot's next answer.
    answer: Any = None
    blocked: bool = False
    #: Tokens accepted so far: its output, and what a replay on a rebuilt ring recomputes.
    tokens: list[int] = field(default_factory=list)
    #: Its statistics on the rings it ran on before a rebuild (merged at the end).
    previous: GenerationStats | None = None
    queued_s: float = 0.0

    # ---- its generation's state, set by the engine of the slot that runs it
    # (``SpecEngine.start``, again at a replay); the slot keeps only what its KV holds.
    stats: GenerationStats = field(default_factory=GenerationStats)
    #: Its tokens' log probabilities, queued by the steps until the output takes them.
    scores: ScoreQueue = field(default_factory=ScoreQueue)
    #: Its sampler at the last stage (registered by its prefill, released at its end).
    sampler: SamplerHandle = field(
        default_factory=lambda: SamplerHandle(SamplerSettings()))
    #: What it drafts with: its slot's drafter, or that drafter held to its grammar.
    drafter: Drafter | None = None
    #: Its drafter has not read its text yet (a tree mode on a shared ring reads it at the
    #: first tree, docs/design.md 5.8).
    drafter_behind: bool = False
    #: Where its text starts in its slot's committed history (what penalties look back on).
    text_start: int = 0
    #: Tokens it still wants: a mode never drafts ahead past them.
    room: int = 0
    #: The tree sizing last logged for it.
    last_choice: tuple | None = None

    @property
    def scored(self) -> bool:
        return self.params.logprobs is not None

    def stop(self) -> None:
        """Ask the loop to end it (or withdraw it while it waits): its next lap frees its
        rows; ``done`` is set once it ended."""
        self.cancel.set()
