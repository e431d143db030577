"""The head's scheduler without a model: one admission queue (FIFO, bounded, withdrawable),
slot choice, and one rebuild of the ring for every request after a lost node."""

from __future__ import annotations

import threading

import pytest

from edgespec.errors import NodeLost, RingBusy, RingError
from edgespec.head import scheduler as scheduler_mod
from edgespec.head.scheduler import Scheduler
from edgespec.head.session import Session


class _Chain:
    n_vocab, n_stages = 10, 1

    def __init__(self, name: str = "first") -> None:
        self.name = name
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Engine:
    drafter = None

    def __init__(self, chain) -> None:
        self.chain = chain
        self.history: list[int] = []

    def replace_chain(self, chain) -> None:
        self.chain, self.history = chain, []

    def use_laps(self, index: int, count: int) -> None:
        pass


def _scheduler(parallel: int = 1, max_queue: int | None = None, recover=None) -> Scheduler:
    return Scheduler(_Chain(), lambda ch, i: _Engine(ch), Session, parallel=parallel,
                     max_queue=max_queue, recover=recover)


def _hold(s: Scheduler, ticket, order: list[int], entered: threading.Event,
          release: threading.Event, cancel: threading.Event | None = None,
          got: list | None = None) -> threading.Thread:
    def run() -> None:
        with s.acquire([1, 2, 3], ticket, cancel=cancel) as slot:
            if got is not None:
                got.append(slot)
            if slot is None:
                return
            order.append(ticket.number)
            entered.set()
            release.wait(30)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_admits_parallel_requests_then_queues_in_order_then_refuses():
    s = _scheduler(parallel=2, max_queue=2)
    tickets = [s.admit() for _ in range(4)]  # 2 for the slots + 2 waiting
    with pytest.raises(RingBusy, match="max_queue 2"):
        s.admit()
    order: list[int] = []
    entered = [threading.Event() for _ in range(4)]
    release = [threading.Event() for _ in range(4)]
    threads = [_hold(s, tickets[i], order, entered[i], release[i]) for i in (3, 2, 1, 0)]
    # Two at once: the first two tickets are inside together, the others wait.
    assert entered[0].wait(10) and entered[1].wait(10)
    assert not entered[2].is_set() and not entered[3].is_set()
    assert s.state() == {"serving": 2, "queued": 2, "max_queue": 2}
    assert s.busy() == 2
    release[1].set()  # a slot frees: the oldest waiting ticket takes it, not the newest
    assert entered[2].wait(10)
    assert not entered[3].is_set()
    release[0].set()
    assert entered[3].wait(10)
    release[2].set()
    release[3].set()
    for th in threads:
        th.join(10)
    numbers = [t.number for t in tickets]
    assert sorted(order[:2]) == numbers[:2] and order[2:] == numbers[2:]
    assert s.wait_idle(5)
    assert s.state() == {"serving": 0, "queued": 0, "max_queue": 2}
    s.admit().withdraw()  # room again


def test_no_queue_serves_only_when_idle_and_python_callers_wait_without_limit():
    s = _scheduler(max_queue=0)
    first = s.admit()
    with pytest.raises(RingBusy):
        s.admit()
    first.withdraw()
    s.set_max_queue(None)  # Python's default: any number may wait
    tickets = [s.admit() for _ in range(20)]
    for t in tickets:
        t.withdraw()
    assert s.state()["queued"] == 0
    with pytest.raises(ValueError):
        s.set_max_queue(-1)


def test_cancelled_waiting_request_leaves_the_queue_at_once():
    s = _scheduler(max_queue=1)
    order: list[int] = []
    entered0, release0 = threading.Event(), threading.Event()
    t0 = s.admit()
    th0 = _hold(s, t0, order, entered0, release0)
    assert entered0.wait(10)
    t1 = s.admit()
    with pytest.raises(RingBusy):  # queue full
        s.admit()
    cancel, got = threading.Event(), []
    th1 = _hold(s, t1, order, threading.Event(), threading.Event(), cancel, got)
    cancel.set()  # the client hung up while waiting
    th1.join(10)
    assert got == [None] and order == [t0.number]
    # Its place in the queue is free again while the first request still holds the slot...
    assert s.state() == {"serving": 1, "queued": 0, "max_queue": 1}
    t2 = s.admit()
    entered2, release2 = threading.Event(), threading.Event()
    th2 = _hold(s, t2, order, entered2, release2)
    release0.set()  # ...and the next ticket gets the slot once it frees
    assert entered2.wait(10)
    release2.set()
    for th in (th0, th2):
        th.join(10)
    assert order == [t0.number, t2.number] and s.wait_idle(5)


def test_one_rebuild_serves_every_slot_after_a_lost_node(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "RECOVERY_BACKOFF_S", 0.0)
    calls: list[str] = []

    def recover(exc: Exception):
        calls.append(str(exc))
        if len(calls) == 1:  # none answers yet: the scheduler retries
            raise NodeLost("no node answers yet")
        return _Chain("rebuilt")

    s = _scheduler(parallel=3, recover=recover)
    old = s.chain
    views = [s.recover(slot, NodeLost("node B lost")) for slot in s.slots]
    assert calls == ["node B lost", "no node answers yet"]  # one rebuild, one retry in it
    assert old.closed and s.chain.name == "rebuilt"
    assert all(v.demux.chain is s.chain for v in views)
    assert len(s.recovery_log) == 1 and s.recovery_log[0]["error"] == "node B lost"
    assert not s.recovering


def test_a_ring_that_cannot_be_rebuilt_says_so(monkeypatch):
    monkeypatch.setattr(scheduler_mod, "RECOVERY_BACKOFF_S", 0.0)

    def never(exc: Exception):
        raise NodeLost("still nobody")

    s = _scheduler(recover=never)
    with pytest.raises(RingError, match=f"after {scheduler_mod.MAX_RECOVERIES} attempts"):
        s.recover(s.slots[0], NodeLost("node A lost"))

    def refuses(exc: Exception):
        raise RingError("the survivors cannot hold the model")

    s = _scheduler(recover=refuses)
    with pytest.raises(RingError, match="cannot be re-formed: the survivors"):
        s.recover(s.slots[0], NodeLost("node A lost"))


def test_a_stream_closed_before_it_starts_gives_its_place_back():
    from edgespec.api import TextStream

    s = _scheduler(max_queue=0)
    ticket = s.admit()
    with pytest.raises(RingBusy):
        s.admit()
    TextStream((p for p in ()), ticket).close()  # e.g. the server failed to start its thread
    assert s.state()["queued"] == 0
    s.admit().withdraw()
