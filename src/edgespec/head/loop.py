"""The ring's loop (docs/design.md 5.8): one thread, ``edgespec-ring``, owns the chain and
runs every request's generation on it, as llama-server's slot loop owns its context and
vLLM's engine core its executor.

A generation is a coroutine (``SpecEngine.start``) that never blocks: it sends its batches,
yields ``WAIT`` for its slot's next answer (or ``POLL``: is one there) and yields the token
chunks it gains. Round after round the loop takes new requests and commands, ends cancelled
requests, admits queued ones to free slots (FIFO; the scheduler picks the slot), resumes
every request that can go on (each sends its next batch the moment its answer is read, so
S requests keep S stages busy), and when none can, reads the chain and routes each answer
to the slot whose lap it is (``Demux``). Output is processed here (``OutputProcessor``): an end,
a stop string or ``max_tokens`` ends the request in the round its token came, and its slot
is free once every answer owed to it is back. A lost node is handled here, once for every
request: the ring is rebuilt and each running request replays its prompt and tokens so far.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from edgespec.errors import NodeLost, RingError, StageFailure
from edgespec.head.engine.mode import POLL, WAIT
from edgespec.head.request import END, Request

if TYPE_CHECKING:
    from edgespec.head.scheduler import Scheduler
    from edgespec.head.slots import Slot

log = logging.getLogger("edgespec.ring")


@dataclass(eq=False)
class _Command:
    """Work for the loop thread when no request runs (``RingLoop.exclusive``)."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None


_CLOSE = object()


class RingLoop:
    """The one thread that runs every request on the ring (see the module docstring)."""

    #: How often a loop with nothing to read looks at cancel events and new work.
    IDLE_POLL_S = 0.1

    def __init__(self, scheduler: Scheduler, finish: Callable[[Request], None]) -> None:
        self.scheduler = scheduler
        self._finish = finish  # builds the request's Generation (the Ring's)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, Request] = {}  # ticket number -> request, not yet admitted
        self._commands: list[_Command] = []
        self.active: list[Request] = []
        self._draining: list[Slot] = []
        self._closed = self._closing = False
        self._reading = False  # waiting for the ring's next answer (``_post`` wakes it)
        self._thread = threading.Thread(target=self._run, name="edgespec-ring", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ other threads

    def submit(self, request: Request) -> None:
        """Run ``request`` (admitted: its ticket is in the scheduler's queue)."""
        self._post(request)

    def poke(self) -> None:
        """Look at the requests' cancel events now."""
        self._post(None)

    def _post(self, item: Any) -> None:
        """Hand ``item`` to the loop, waking it where it waits for the ring's next answer
        (a lap can take seconds: a long prompt's chunk), so a request starts at once."""
        self._inbox.put(item)
        if self._reading:
            wake = getattr(self.scheduler.chain, "wake", None)
            if wake is not None:
                wake()

    def exclusive(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread once no request runs (requests admitted after wait
        for it); its value, or its exception raised here."""
        if threading.current_thread() is self._thread:
            return fn()
        cmd = _Command(fn)
        self._post(cmd)
        while not cmd.done.wait(1.0):
            if not self._thread.is_alive():
                raise RingError("the ring's loop has stopped")
        if cmd.error is not None:
            raise cmd.error
        return cmd.value

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._closing = True  # a read the close breaks is not a lost node
        self._post(_CLOSE)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        while not self._closed:
            try:
                self._round()
            except Exception as e:  # a bug of the loop's: fail what runs, keep serving
                log.exception("the ring's loop failed")
                for req in list(self.active):
                    self._fail(req, RingError(f"internal error on the head: {e}"))

    def _round(self) -> None:
        busy = bool(self.active or self._draining or self._pending or self._commands)
        self._take(block=not busy)
        self._cancels()
        self._settle()
        self._run_commands()
        self._admit()
        progressed = False
        for req in list(self.active):
            progressed |= self._resume(req)
        self._settle()
        if progressed:
            return
        if self._outstanding() > 0:
            self._read(block=True)
        elif self.active or self._pending or self._commands or self._draining:
            self._take(block=True, timeout=self.IDLE_POLL_S)

    def _take(self, block: bool, timeout: float | None = None) -> None:
        """Take what other threads sent: new requests, commands, pokes."""
        try:
            item = self._inbox.get(timeout=timeout) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is _CLOSE:
                self._shutdown()
                return
            if isinstance(item, Request):
                item.status = "queued"
                assert item.ticket is not None
                self._pending[item.ticket.number] = item
            elif isinstance(item, _Command):
                self._commands.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _shutdown(self) -> None:
        self._closed = True
        for req in list(self.active):
            self._end(req, cancelled=True)
        for req in list(self._pending.values()):
            self._withdraw(req)
        for cmd in self._commands:
            cmd.error = RingError("the ring was closed")
            cmd.done.set()

    # ------------------------------------------------------------ admission and the end

    def _admit(self) -> None:
        if self._commands:
            return  # a command waits for the ring to empty: nothing new starts before it
        sched = self.scheduler
        while True:
            head = sched.head_ticket()
            if head is None:
                return
            req = self._pending.get(head.number)
            if req is None:
                return  # its request is on its way: the ones behind it wait (FIFO)
            slot = sched.choose(req.prompt)
            if slot is None:
                return
            del self._pending[head.number]
            sched.take(head, slot)
            self._start(req, slot)

    def _start(self, req: Request, slot: Slot) -> None:
        req.queued_s = time.perf_counter() - req.t_start
        req.status = "running"
        req.slot = slot
        slot.prompt_tokens = len(req.prompt)
        slot.requests += 1
        self.active.append(req)
        self._launch(req)

    def _launch(self, req: Request) -> None:
        """Its generation's coroutine on its slot: the prompt, or after a rebuild the prompt
        and its tokens so far (replayed as they were decoded) for the rest of its budget."""
        assert req.slot is not None
        req.coro = req.slot.engine.start(req)
        req.answer, req.blocked = None, False

    def _cancels(self) -> None:
        for req in list(self._pending.values()):
            if req.cancel.is_set():
                self._withdraw(req)
        for req in list(self.active):
            if req.cancel.is_set():
                self._end(req, cancelled=True)

    def _withdraw(self, req: Request) -> None:
        """A request cancelled while it waited: it never reaches the ring."""
        assert req.ticket is not None
        self._pending.pop(req.ticket.number, None)
        req.ticket.withdraw()
        req.status = "withdrawn"
        assert req.output is not None
        req.output.cancelled()
        self._finish(req)
        req.outbox.put(END)
        req.done.set()

    def _end(self, req: Request, cancelled: bool = False) -> None:
        """The request is over (its end, its budget, or cancelled): close its coroutine (it
        sends its KV operations and its sampler's release now), hand out the rest of its
        text and its ``Generation``; its slot is free once its answers are all back."""
        out = req.output
        assert out is not None and req.slot is not None
        if req.coro is not None:
            try:
                req.coro.close()
            except Exception as e:  # its cleanup reached a chain that broke meanwhile
                log.debug("generation cleanup failed: %s", e)
            req.coro = None
        if cancelled and not out.done:
            out.cancelled()  # stopped by its caller short of its natural end
        if piece := out.flush():
            req.outbox.put(piece)
        req.status = "cancelled" if out.finish == "cancelled" else "done"
        self._release(req)
        self._finish(req)
        self._settle()  # free now unless answers are still owed to it
        req.outbox.put(END)
        req.done.set()

    def _fail(self, req: Request, exc: BaseException) -> None:
        """The request ends with ``exc`` (its reader raises it); its slot starts clean."""
        if req.coro is not None:
            with contextlib.suppress(BaseException):
                req.coro.close()
            req.coro = None
        req.status, req.error = "failed", exc
        if req.slot is not None:
            self._resync(req.slot)
            self._release(req)
            self._settle()
        req.outbox.put(exc)
        req.done.set()

    def _release(self, req: Request) -> None:
        """Its statistics final (across rebuilds); its slot to free once the answers owed
        to it are back (``_settle``)."""
        slot = req.slot
        assert slot is not None
        if req.previous is not None:
            req.stats, req.previous = req.stats.merged(req.previous), None
        req.stats.queue_ms = req.queued_s * 1e3
        if req in self.active:
            self.active.remove(req)
        slot.tokens = len(req.tokens if req.output is None else req.output.tokens)
        slot.tokens_per_s = req.stats.tokens_per_s
        if slot not in self._draining:
            self._draining.append(slot)

    def _settle(self) -> None:
        """Free the slots whose ended request's answers are all back (dropped unread)."""
        for slot in list(self._draining):
            if any(r.slot is slot for r in self.active):
                self._draining.remove(slot)
                continue
            engine = slot.engine
            if engine.owed > len(slot.inbox):
                continue
            slot.inbox.clear()
            engine.owed = 0
            engine.stale.clear()
            slot.view.forget_done()
            self._draining.remove(slot)
            self.scheduler.park(slot)
            self.scheduler.free(slot)

    # ------------------------------------------------------------ running the coroutines

    def _resume(self, req: Request) -> bool:
        """Run ``req``'s coroutine until it waits for an answer not there yet; False when it
        could not go on at all."""
        slot = req.slot
        assert slot is not None and req.coro is not None
        ran = False
        while req.coro is not None:
            if req.blocked:
                if not slot.inbox:
                    return ran
                req.answer, req.blocked = slot.inbox.popleft(), False
            ran = True
            try:
                item = req.coro.send(req.answer)
            except StopIteration:  # its budget is spent (or cancel seen between steps)
                req.coro = None
                self._end(req)
                return True
            except NodeLost as e:
                self._recover(e)
                return True
            except Exception as e:  # this request's failure: a stage's, its own, or a bug
                req.coro = None
                if not isinstance(e, (StageFailure, ValueError, RingError)):
                    log.exception("generation failed")
                self._fail(req, e)
                return True
            req.answer = None
            if item is WAIT:
                req.blocked = True
            elif item is POLL:
                coro = req.coro
                self._read(block=False)
                if req.coro is coro:  # (not replaced by a rebuild of the ring meanwhile)
                    req.answer = bool(slot.inbox)
            else:
                self._deliver(req, item)
        return ran

    def _deliver(self, req: Request, chunk: list[int]) -> None:
        """A step's tokens: to the output (text, stop strings, the end), then the reader."""
        out = req.output
        assert out is not None and req.slot is not None
        req.tokens.extend(chunk)
        piece = out.feed(chunk, req.scores.last if req.scored else None)
        if piece:
            req.outbox.put(piece)
        if out.done:
            self._end(req)

    # ------------------------------------------------------------ the chain

    def _outstanding(self) -> int:
        """Answers the chain still owes (sent, not yet read off it)."""
        return sum(max(0, s.engine.owed - len(s.inbox)) for s in self.scheduler.slots)

    def _read(self, block: bool) -> None:
        """Route the chain's answers to their slots: one (waiting for it) when ``block``,
        then every one already there."""
        chain = self.scheduler.chain
        wakes = getattr(chain, "wake", None) is not None
        first = block
        while True:
            if not first and not chain.has_result():
                return
            self._reading = first  # only a first read waits
            try:
                if first and not self._inbox.empty():
                    return  # work came meanwhile: the next round takes it
                item: Any = chain.next_result(wakes=True) if wakes else chain.next_result()
            except Exception as e:
                item = e
            finally:
                self._reading = first = False
            if item is None:
                return  # woken: see ``_post``
            if isinstance(item, NodeLost):
                self._recover(item)
                return
            to = self.scheduler.demux.route(item)
            if to is None:  # an error about no batch: the chain itself is broken
                assert isinstance(item, Exception)
                self._recover(NodeLost(f"the ring failed: {item}"))
                return
            for i in to:
                self.scheduler.slots[i].inbox.append(item)

    def _resync(self, slot: Slot) -> None:
        """After a stage failed this slot's work: forget what it has in flight; its next
        generation starts from an empty cache (the ring itself is fine)."""
        slot.view.abandon()
        slot.inbox.clear()
        slot.engine.replace_chain(slot.view)

    def _recover(self, exc: NodeLost) -> None:
        """A lost node: rebuild the ring once for every request (the scheduler's
        ``recover``: retries with backoff, or ``RingError``) and replay each running one on
        it. Without a way to rebuild, every running request fails with ``exc``."""
        running = list(self.active)
        for req in running:
            if req.coro is not None:
                with contextlib.suppress(BaseException):
                    req.coro.throw(exc)  # its generation ends without waiting on the chain
                req.coro = None
            req.previous = req.stats.merged(req.previous)
        try:
            if self._closing:
                raise RingError("the ring was closed")
            if not self.scheduler.can_recover:
                raise exc
            self.scheduler.recover(exc)
        except (NodeLost, RingError) as e:
            for req in running:
                req.previous = None
                self._fail(req, e)
            self._reset_slots()
            return
        self._reset_slots()
        for req in running:
            assert req.previous is not None
            req.previous.recoveries += 1
            self._launch(req)

    def _reset_slots(self) -> None:
        """Every slot onto the scheduler's chain now, with nothing in flight."""
        for slot in self.scheduler.slots:
            slot.view = self.scheduler.view(slot)
            slot.inbox.clear()
            slot.engine.replace_chain(slot.view)
        for slot in list(self._draining):
            if not any(r.slot is slot for r in self.active):
                self._draining.remove(slot)
                self.scheduler.free(slot)

    # ------------------------------------------------------------ commands

    def _run_commands(self) -> None:
        if not self._commands or self.active or self._draining:
            return
        cmd = self._commands.pop(0)
        try:
            cmd.value = cmd.fn()
        except BaseException as e:
            cmd.error = e
        finally:
            cmd.done.set()
