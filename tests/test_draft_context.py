"""A ring's slots drafting on one draft-model context (edgespec.drafters.draft_context): each
drafts what it would alone, their sequences never meet, concurrent decodes share a batch, and
an idle slot's committed text waits in host memory until its next turn."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_drafters_model import PROMPT, Reference, assert_root_matches
from tinygguf import make_tiny_gguf

from edgespec.drafters.draft_context import DraftContext
from edgespec.drafters.model import DraftModelDrafter
from edgespec.llm.shared_model import holders_of

OTHER = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"draft": make_tiny_gguf(tmp_path_factory.mktemp("tiny") / "draft.gguf", n_layer=2,
                                    n_embd=64, seed=1)}


@pytest.fixture(scope="module")
def draft_ref(tiny: dict[str, Path]):
    ref = Reference(tiny["draft"])
    yield ref
    ref.close()


def drafters(path: Path, n: int, **kw) -> tuple[DraftContext, list[DraftModelDrafter]]:
    ctx = DraftContext(path, parallel=n, n_ctx=1024)
    return ctx, [DraftModelDrafter(path, None, seqs=ctx.view(i), **kw) for i in range(n)]


def test_slots_draft_on_one_context_as_each_would_alone(tiny: dict[str, Path],
                                                         draft_ref: Reference) -> None:
    ctx, (a, b) = drafters(tiny["draft"], 2, top_k=3, width=4)
    try:
        assert a._model is b._model and holders_of(tiny["draft"]) == 1
        assert a._max_tree_seqs == b._max_tree_seqs == 127  # 256 // 2 seqs each, one committed
        a.begin(PROMPT)
        b.begin(OTHER)
        # Interleaved steps: trees, expansions and accepts of one never disturb the other.
        for d in (a, b, a):
            root = d.history[-1]
            tree = d.propose(root, budget=12, max_depth=4)
            more = d.propose_under(tree.best_chain()[:1], budget=4, max_depth=3)
            assert len(tree) and len(more)
            d.accept(tree.best_chain()[:2] + [7])
            # Decodes of varying batch shapes round differently (~1e-3 here); a cell of the
            # other slot's text in the attention would move log-probs far more.
            assert_root_matches(d, draft_ref, atol=3e-3)
        assert_root_matches(b, draft_ref, atol=3e-3)
        # Tree sequences are gone after accept, committed ones are each slot's own.
        base_b = b._seqs.base
        assert b.seq_pos_max(0) == b.n_kv - 1 and a.seq_pos_max(0) == a.n_kv - 1
        assert base_b == 128 and all(b.seq_pos_max(s) == -1 for s in range(1, 20))
        a.close()  # one slot's drafter closing leaves the others drafting
        assert holders_of(tiny["draft"]) == 1 and not ctx.closed
        b.begin(PROMPT)
        assert_root_matches(b, draft_ref)
    finally:
        a.close()
        b.close()
    assert holders_of(tiny["draft"]) == 0 and ctx.closed


def test_decodes_waiting_meanwhile_go_in_one_batch(tiny: dict[str, Path],
                                                   draft_ref: Reference) -> None:
    """Two slots that decode while the context is taken are served by one llama_decode,
    and each gets its own logits."""
    ctx = DraftContext(tiny["draft"], parallel=2, n_ctx=256)
    views = [ctx.view(0), ctx.view(1)]
    try:
        prompts = (PROMPT, OTHER)
        got: dict[int, np.ndarray] = {}
        errors: list[BaseException] = []

        def prefill(i: int) -> None:
            rows = [(t, p, 0, p == len(prompts[i]) - 1) for p, t in enumerate(prompts[i])]
            try:
                got[i] = views[i].decode(rows)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=prefill, args=(i,)) for i in range(2)]
        with ctx.exclusive():  # the context is taken (as by another slot's KV operation)
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while len(ctx._queue) < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len(ctx._queue) == 2
        for t in threads:
            t.join(10)
        assert not errors and ctx.n_combined == 1
        for i, prompt in enumerate(prompts):  # each slot got its own row's logits
            row = got[i][0].astype(np.float64)
            logprobs = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            np.testing.assert_allclose(logprobs, draft_ref.logprobs(prompt), atol=3e-3)
        assert views[1].pos_max(0) == len(OTHER) - 1 and views[0].pos_max(0) == len(PROMPT) - 1
        # A tree row on a new sequence: the copy queued with it gives it the prompt's path.
        n = len(PROMPT)
        row = views[0].decode([(42, n, 1, True)], copies=[(0, 1, -1, n)])[0].astype(np.float64)
        logprobs = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        np.testing.assert_allclose(logprobs, draft_ref.logprobs(PROMPT + [42]), atol=3e-3)
        assert views[0].pos_max(1) == n and views[1].pos_max(1) == -1
    finally:
        for v in views:
            v.close()
    assert ctx.closed


def test_an_idle_slot_parks_its_text_and_its_next_turn_decodes_only_new_tokens(
        tiny: dict[str, Path], draft_ref: Reference) -> None:
    ctx, (a, b) = drafters(tiny["draft"], 2)
    try:
        a.begin(PROMPT)
        a.accept([4, 5])  # accepted, not drafted: decoded at the next call
        kept, kv = list(a.history), a.n_kv
        a.idle()
        # Parked: no cell of slot a is live, so b's decodes attend over b's cells only.
        assert a._seqs.pos_max(0) == -1 and ctx.parked_bytes() > 0
        b.begin(OTHER)
        assert a._seqs.pos_max(0) == -1
        before = a.n_decoded_tokens
        a.begin(kept + [99, 98])  # the conversation's next turn
        # Only what the parked cells lack: the 2 accepted tokens and the 2 new ones.
        assert kv == len(PROMPT) and a.n_decoded_tokens - before == len(kept) + 2 - kv == 4
        assert ctx.parked_bytes() == 0
        assert_root_matches(a, draft_ref)
        # A new conversation drops the parked copy instead of restoring it... and a slot
        # alone on its context never parks (nobody else attends over its cells).
        a.idle()
        a.begin([8, 8, 8])
        assert_root_matches(a, draft_ref)
    finally:
        a.close()
        b.close()
    with DraftModelDrafter(tiny["draft"], None, n_ctx=256) as alone:
        alone.begin(PROMPT)
        alone.idle()
        assert alone.seq_pos_max(0) == len(PROMPT) - 1


def test_a_restore_without_room_recomputes_instead_of_failing(tiny: dict[str, Path],
                                                              draft_ref: Reference) -> None:
    ctx = DraftContext(tiny["draft"], parallel=2, n_ctx=64)
    n = ctx.n_ctx
    a = DraftModelDrafter(tiny["draft"], None, n_ctx=n, seqs=ctx.view(0))
    b = DraftModelDrafter(tiny["draft"], None, n_ctx=n, seqs=ctx.view(1))
    try:
        a.begin((PROMPT * 10)[:28])
        a.idle()  # 28 cells parked
        b.begin([(3 * i) % 200 + 1 for i in range(n - 20)])  # 20 cells left free
        before = a.n_decoded_tokens
        a.begin(PROMPT)  # no room for the 28 parked cells: the 7 tokens are decoded again
        # (restored, the 6 tokens it shares with them would have been kept)
        assert a.n_decoded_tokens - before == len(PROMPT) and ctx.parked_bytes() == 0
        assert_root_matches(a, draft_ref)
    finally:
        a.close()
        b.close()


def test_a_view_checks_its_index(tiny: dict[str, Path]) -> None:
    ctx = DraftContext(tiny["draft"], parallel=2, n_ctx=128)
    try:
        with pytest.raises(ValueError, match="view 2 outside 0..1"):
            ctx.view(2)
    finally:
        ctx.close()
