"""The head's scheduler without a model: one admission queue (FIFO, bounded, withdrawable),
slot choice, and one rebuild of the ring for every request after a lost node. (The loop that
starts requests in queue order is tested with a model: tests/test_server_parallel.py.)"""

from __future__ import annotations

import pytest

from edgespec.errors import NodeLost, RingBusy, RingError
from edgespec.head import scheduler as scheduler_mod
from edgespec.head.scheduler import Scheduler


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
    return Scheduler(_Chain(), lambda ch, i: _Engine(ch), parallel=parallel,
                     max_queue=max_queue, recover=recover)


def test_admits_parallel_requests_then_queues_in_order_then_refuses():
    s = _scheduler(parallel=2, max_queue=2)
    tickets = [s.admit() for _ in range(4)]  # 2 for the slots + 2 waiting
    with pytest.raises(RingBusy, match="max_queue 2"):
        s.admit()
    # The loop starts the ticket at the head of the queue in a free slot, one after another.
    held = []
    for ticket in tickets[:2]:
        assert s.head_ticket() is ticket
        slot = s.choose([1, 2, 3])
        assert slot is not None
        s.take(ticket, slot)
        held.append(slot)
    assert s.choose([1, 2, 3]) is None  # both busy: the others wait
    assert s.head_ticket() is tickets[2]
    assert s.state() == {"serving": 2, "queued": 2, "max_queue": 2}
    assert s.busy() == 2
    s.free(held[1])  # a slot frees: the oldest waiting ticket is next, not the newest
    assert s.choose([1, 2, 3]) is held[1]
    s.take(tickets[2], held[1])
    assert s.head_ticket() is tickets[3]
    tickets[3].withdraw()
    assert s.head_ticket() is None
    for slot in held:
        s.free(slot)
    assert s.wait_idle(5)
    assert s.state() == {"serving": 0, "queued": 0, "max_queue": 2}
    s.admit().withdraw()  # room again


def test_the_slot_sharing_the_longest_prefix_is_chosen_else_the_least_recently_used():
    s = _scheduler(parallel=3)
    s.slots[1].engine.history = [1, 2, 3, 4]
    s.slots[2].engine.history = [1, 2]
    assert s.choose([1, 2, 3, 9]) is s.slots[1]
    s.slots[1].busy = True
    assert s.choose([1, 2, 3, 9]) is s.slots[2]
    s.slots[0].last_used, s.slots[2].last_used = 5.0, 1.0
    assert s.choose([7, 8]) is s.slots[2]  # nothing shared: the one idle longest


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
    s.recover(NodeLost("node B lost"))
    views = [s.view(slot) for slot in s.slots]
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
        s.recover(NodeLost("node A lost"))

    def refuses(exc: Exception):
        raise RingError("the survivors cannot hold the model")

    s = _scheduler(recover=refuses)
    with pytest.raises(RingError, match="cannot be re-formed: the survivors"):
        s.recover(NodeLost("node A lost"))
