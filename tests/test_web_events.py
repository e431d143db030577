"""The data behind the web page's tree view: the engine's tree events (``Ring.add_listener``)
must tell exactly what verification decided, since the page colours rows by them, and a ring
without listeners builds none. On tiny float32 models, in every mode."""

from __future__ import annotations

import numpy as np
import pytest
from tinygguf import make_tiny_gguf

from edgespec.api import Ring
from edgespec.drafters import DraftModelDrafter


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("events")
    target = make_tiny_gguf(d / "target.gguf", "qwen2", n_layer=4, n_embd=64, seed=3)
    # The target drafting for itself: long accepted paths. Another model: many rejections.
    draft = make_tiny_gguf(d / "draft.gguf", "qwen2", n_layer=2, n_embd=64, seed=4)
    return target, draft


@pytest.fixture(scope="module")
def base(models):
    with Ring.local(models[0], stages=2, processes=False, n_ctx=1024) as r:
        yield r


def _prompt(ring: Ring) -> list[int]:
    rng = np.random.default_rng(1)
    return list(map(int, rng.integers(3, ring.tokenizer.n_vocab, 16)))


def _replay(events: list[dict]) -> tuple[list[int], int]:
    """The tokens the events say were gained, round by round, checking each round's
    consistency as the page relies on it; and how many rows were seen rejected."""
    gained: list[int] = []
    rejected_rows = 0
    rows: dict[int, dict[int, tuple[int, int]]] = {}  # lap -> node -> (parent, token)
    partial: dict[int, list[int]] = {}  # lap -> accepted path so far
    dead: dict[int, set[int]] = {}
    for ev in events:
        lap = ev["lap"]
        if ev["e"] == "rows":
            for node, parent, token in ev["rows"]:
                assert node not in rows.setdefault(lap, {}), "a row sent twice"
                assert parent == -1 if node == 0 else parent in rows[lap]
                rows[lap][node] = (parent, token)
        elif ev["e"] == "plain":
            gained.append(ev["token"])
        elif ev["e"] in ("verify", "decide"):
            path = ev["accepted"]
            assert path[0] == 0 and all(n in rows[lap] for n in path)
            assert all(rows[lap][b][0] == a for a, b in zip(path, path[1:], strict=False))
            before = partial.get(lap, [0])
            assert path[:len(before)] == before  # the accepted path only ever grows
            partial[lap] = path
            assert not set(path) & dead.get(lap, set())  # never accept a rejected row
            dead.setdefault(lap, set()).update(ev.get("rejected", []))
            rejected_rows += len(ev.get("rejected", []))
            if ev["e"] == "decide":
                gained += [rows[lap][n][1] for n in path[1:]] + [ev["bonus"]]
    return gained, rejected_rows


@pytest.mark.parametrize("mode, drafter", [("none", None), ("sync", "other"),
                                           ("flow", "other"), ("flow", "self")])
def test_tree_events_replay_to_the_generated_tokens(base, models, mode, drafter):
    target, draft = models
    d = None if drafter is None else DraftModelDrafter(target if drafter == "self" else draft,
                                                       target=target)
    ring = Ring(base.chain, base.tokenizer, model_name="tiny",
                drafter_factory=(lambda: d) if d else None)
    events: list[dict] = []
    ring.add_listener(events.append)
    out = ring.generate(_prompt(ring), max_tokens=40, spec=mode)
    gained, rejected = _replay(events)
    assert len(gained) >= len(out.tokens) > 0
    assert gained[:len(out.tokens)] == out.tokens
    kinds = {e["e"] for e in events}
    if mode == "none":
        assert kinds == {"plain"}
    else:
        assert {"rows", "decide"} <= kinds
    if drafter == "other":  # a poor draft: rows off the accepted path (red on the page)
        sent = sum(len(e["rows"]) for e in events if e["e"] == "rows")
        kept = sum(len(e["accepted"]) for e in events if e["e"] == "decide")
        assert sent > kept
    if drafter == "self":  # drafted rows accepted (green on the page), past the root
        assert min(len(e["accepted"]) for e in events if e["e"] == "decide") >= 2
    # No listener: nothing is built or delivered.
    ring.remove_listener(events.append)
    assert ring.engine.listeners == []
    n = len(events)
    ring.generate(_prompt(ring), max_tokens=8, spec=mode)
    assert len(events) == n
    if d is not None:
        d.close()


def test_a_failing_listener_never_stops_a_generation(base):
    ring = Ring(base.chain, base.tokenizer, model_name="tiny")
    ref = ring.generate(_prompt(ring), max_tokens=6, spec="none").tokens

    def broken(_event: dict) -> None:
        raise RuntimeError("observer bug")

    ring.add_listener(broken)
    assert ring.generate(_prompt(ring), max_tokens=6, spec="none").tokens == ref


def test_describe_an_in_process_ring(base):
    snap = base.describe()
    assert snap["status"] == "up" and snap["model"] == "target"
    assert [s["layers"] for s in snap["stages"]] == [[0, 2], [2, 4]]
    assert snap["drafter"] == "retrieval"
