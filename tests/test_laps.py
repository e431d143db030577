"""The lap-timing view (docs/design.md 8): on a real ring of three node processes, every
decode lap is timed, with one entry per stage and one per link, and the parts add up to the
lap. No timing thresholds: only that the view is complete and consistent."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.api import Ring
from edgespec.batch import Result
from edgespec.laps import LapTimes, lap_lines, stamps_from_meta


@pytest.mark.real_model
def test_ring_lap_view_has_every_stage_and_link_and_adds_up(real_model_path):
    with Ring.local(real_model_path, stages=3, spec="none") as ring:
        gen = ring.generate("def quicksort(arr):\n", max_tokens=12, spec="none")
    view = gen.stats.as_dict()["lap_timing"]
    assert view is not None
    # every decode lap timed (one node host: one clock, so no lap is left out for skew)
    assert view["laps"] == gen.stats.plain_laps > 0
    assert view["skewed_laps"] == 0
    assert [s["stage"] for s in view["stages"]] == [0, 1, 2]
    assert [(lk["from"], lk["to"]) for lk in view["links"]] == [
        ("head", 0), (0, 1), (1, 2), (2, "head")]
    for s in view["stages"]:
        assert s["compute_ms"] > 0 and s["wait_ms"] >= 0 and s["compute_cpu_ms"] > 0
    assert all(lk["transfer_ms"] >= 0 for lk in view["links"])
    inside = sum(s["wait_ms"] + s["compute_ms"] for s in view["stages"])
    assert inside + view["links_ms"] == pytest.approx(view["lap_ms"], abs=0.01)
    assert sum(lk["transfer_ms"] for lk in view["links"]) == pytest.approx(
        view["links_ms"], abs=0.01)
    # the laps happen inside the generation's decode time
    assert view["lap_ms"] * view["laps"] <= gen.stats.decode_s * 1e3
    assert len(lap_lines(view)) == 1 + 3 + 1


def _result(lap: int, stamps: list, received: int) -> Result:
    return Result(lap, 0, np.zeros(1, np.int32), np.zeros(1, np.int32), stamps, received)


class _Sent:
    def __init__(self, lap: int) -> None:
        self.lap, self.segment, self.want = lap, 0, np.ones(1, bool)


def test_lap_times_split_a_lap_and_keep_clock_skewed_laps_out_of_the_links(monkeypatch):
    import edgespec.laps as laps

    lt = LapTimes()
    us = 1_000_000  # stamps are integer microseconds
    monkeypatch.setattr(laps, "now", lambda: 100 * us)
    lt.sent(_Sent(1))
    lt.sent(_Sent(2))
    monkeypatch.setattr(laps, "now", lambda: 100_500_000)
    # stage 0 on the head's clock, stage 1 on a clock 1 s behind (lap 2 only)
    lt.got(_result(1, [[0, 100_100_000, 100_100_000, 100_200_000, 100_000],
                       [1, 100_250_000, 100_300_000, 100_400_000, 50_000]], 100_450_000))
    lt.got(_result(2, [[0, 100_100_000, 100_100_000, 100_200_000, 100_000],
                       [1, 99_250_000, 99_300_000, 99_400_000, 50_000]], 100_450_000))
    view = lt.as_dict()
    assert view["laps"] == 2 and view["skewed_laps"] == 1
    assert view["lap_ms"] == pytest.approx(450)
    assert view["head_wake_ms"] == pytest.approx(50)
    assert [s["compute_ms"] for s in view["stages"]] == pytest.approx([100, 100])
    assert [s["wait_ms"] for s in view["stages"]] == pytest.approx([0, 50])
    assert [s["compute_cpu_ms"] for s in view["stages"]] == pytest.approx([100, 50])
    # per-link figures from the unskewed lap only; links_ms from both
    assert [lk["transfer_ms"] for lk in view["links"]] == pytest.approx([100, 50, 50])
    assert view["links_ms"] == pytest.approx(450 - 250)
    merged = lt.merged(lt)
    assert merged.as_dict()["laps"] == 4 and merged.as_dict()["lap_ms"] == pytest.approx(450)


def test_malformed_stamps_from_a_peer_are_dropped_not_fatal():
    assert stamps_from_meta(None) == []
    assert stamps_from_meta("x") == []
    assert stamps_from_meta([[0, 1, 2, 3], [1, 10, 20, 30, 5],
                             [True, 1, 2, 3, 0]]) == [[1, 10, 20, 30, 5]]
