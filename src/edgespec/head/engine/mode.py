"""The speculative modes as strategies (docs/design.md 6): a ``Mode`` decodes the steps of
one generation over a ``StepContext``, the engine's operations every mode shares (a plain
lap, a drafted tree, sending its rows, committing a decision). One file per mode (``none``,
``sync``, ``flow``); ``registry`` lists them, and the CLI, the request model and the page
read their names from it. A new mode is one file and one line in ``registry``.

A mode decides what each step sends and when a step ends; the engine owns the committed
history, lap ids and KV operations, the request its generation's statistics and drafter; ``TreePolicy`` (``policy``) says whether a
tree pays now and how big it is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from edgespec.drafters.base import DraftTree
    from edgespec.head.chain import Chain
    from edgespec.head.engine.inflight import TreeInFlight
    from edgespec.head.engine.policy import TreePolicy
    from edgespec.head.request import Request
    from edgespec.sampling import SamplerSettings
    from edgespec.tree import core
    from edgespec.tree.kvop import KvOp


class Need:
    """What a generation's coroutine waits for (it yields one; docs/design.md 5.8): the
    ring's loop, or ``drive_alone``, sends the answer back in."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: The next result of this generation's slot (a ``Result``; an error arrives as the
#: exception object, raised where it is received: ``StepContext.next_result``).
WAIT = Need("WAIT")
#: Whether a result of this generation's slot is waiting now (a bool; never blocks).
POLL = Need("POLL")

#: A coroutine of the engine: yields ``WAIT``/``POLL`` (answered by what is sent back) and
#: token chunks (lists, sent back None).
Steps = Generator[Any, Any, Any]


class StepContext(Protocol):
    """What a mode may use of the engine (``SpecEngine`` is the one implementation)."""

    chain: Chain
    #: The request it runs: its generation's state (``stats``, ``scores`` of its tokens,
    #: its ``drafter``, ``room``: tokens it still wants, a mode never drafts ahead past them).
    req: Request
    policy: TreePolicy
    max_depth: int
    #: lap -> results of decided trees still in flight (read and dropped by ``drain_stale``).
    stale: Counter
    #: KV operations due before the next batch (they travel as its ``pre_ops``).
    pending_ops: list[KvOp]
    listeners: list

    def sharers(self) -> int:
        """Requests decoding on the ring now, this one included."""

    def next_result(self) -> Steps:
        """``yield from`` it: the slot's next result (``WAIT``), its error raised here."""

    def plain_step(self, root: int, sampling: SamplerSettings, tell_drafter: bool = True
                   ) -> Steps:
        """``yield from`` it: one token, no tree: a lap with the root's row alone."""

    def new_tree(self, root: int, sampling: SamplerSettings, budget: int) -> TreeInFlight:
        """A tree of at most ``budget`` drafted nodes below ``root``, not sent yet."""

    def send_rows(self, rnd: TreeInFlight, sampling: SamplerSettings, n_segments: int) -> None:
        """Send the tree's rows not sent yet, as ``n_segments`` batches."""

    def finish_tree(self, rnd: TreeInFlight, decision: core.Decision) -> list[int]:
        """Commit a decision (masked rollback) and return the tokens gained."""

    def draft_into(self, tree: core.TokenTree, under_node: int, dt: DraftTree) -> None:
        """Add a drafter's nodes below ``under_node``."""

    def drain_stale(self) -> Steps:
        """``yield from`` it: read every result still owed to the slot (decided trees')."""

    def emit(self, event: dict) -> None:
        """Hand a tree event to the listeners (the live view)."""

    def log_choice(self, mode: str, **choice: int) -> None:
        """Log the policy's sizing whenever it changes."""


class Mode:
    """One speculative mode: ``steps`` yields the tokens each step gains, forever (the
    engine stops pulling at the end of the generation and closes the iterator; a mode cut
    short in the middle of a step cleans up what it has in flight on ``GeneratorExit``).
    It never blocks: where it needs a result it yields ``WAIT`` (``yield from
    ctx.next_result()``), where it asks whether one is there ``POLL``."""

    #: The name requests, the CLI and the page use.
    name: ClassVar[str]
    #: One line for ``--help`` and the page.
    summary: ClassVar[str]
    #: Whether it needs a drafter (a ring without one refuses it).
    needs_drafter: ClassVar[bool] = True

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx

    def steps(self, root: int, sampling: SamplerSettings) -> Steps:
        raise NotImplementedError
