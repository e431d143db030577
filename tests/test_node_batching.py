"""Merged decodes on a node (node/datapath.py ``_gather``, node/worker.py ``run_many``): batches of
other requests waiting in a stage's inbox run as ONE llama.cpp batch, then go on separately.

- a real ``StageWorker`` over real runtimes: several batches of different seq ids run as one
  decode give the hidden states / targets of the same batches run one by one (float rounding
  of the other batch shape aside), each with its own sampling;
- a real ``StageLoop`` over two real windows, every item queued before its stage's loop
  starts (so what merges does not depend on timing): the ``batches`` / ``merged`` counts,
  batches of one sequence never merged (prefill chunks of one prompt), a KV op queued between
  batches applied between them, each batch's own lap id and timing stamp;
- real node processes over TCP: the node's ``health`` reports ``merged`` per stage.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from tinygguf import make_tiny_gguf

from edgespec.batch import Batch, SamplerRef, SeqIds
from edgespec.node.datapath import HostedStage, StageLoop
from edgespec.node.merge import MergeFence, concat_batches, gather
from edgespec.node.runtime import StageRuntime
from edgespec.node.worker import StageWorker
from edgespec.sampling import SamplerSettings
from edgespec.tree.kvop import KvOp, KvOpCode
from edgespec.wire import Kind
from edgespec.wire.frames import message_result

KW = dict(n_ctx=512, n_batch=64, n_seq_max=8, n_threads=1)
#: Hidden states of a row computed in a batch of another shape: float32 kernels round
#: differently (tiled matmuls), never by more than this on the tiny model.
HIDDEN_ATOL = 1e-3
#: Logit gap under which a greedy target may flip for such rounding (the near-tie rule).
NEAR_TIE = 1e-2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("merge") / "tiny.gguf", "qwen2", n_layer=4,
                          n_embd=64, seed=3)


@pytest.fixture(scope="module")
def windows(tiny, tmp_path_factory):
    """Two windows of the tiny model (layers 0-2, 2-4) and the whole model, one context each."""
    cache = tmp_path_factory.mktemp("windows")
    rts = [StageRuntime((tiny, r), cache_dir=cache, **KW) for r in [(0, 2), (2, 4)]]
    whole = StageRuntime(tiny, **KW)
    yield rts, whole
    for rt in [*rts, whole]:
        rt.close()


def reset(*rts) -> None:
    for rt in rts:
        rt.reset()


def prefill(seq: int, tokens, lap: int, start: int = 0, want_last: bool = True,
            sampling: SamplerRef | None = None) -> Batch:
    n = len(tokens)
    want = np.zeros(n, bool)
    want[-1] = want_last
    return Batch(np.asarray(tokens, np.int32), np.arange(start, start + n), SeqIds.single(n, seq),
                 np.arange(n) + 1000 * lap, want, lap=lap, sampling=sampling or SamplerRef(),
                 timing=[[0, 0.0, 0.0, 0.0, 0.0]])


def prompts(n: int, vocab: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(3, 12))).tolist() for _ in range(n)]


# ------------------------------------------------------------------- the worker alone

def test_fence_admits_only_other_sequences() -> None:
    a = prefill(1, [5, 6, 7], lap=1)
    fence = MergeFence(a)
    assert not fence.admit(prefill(1, [8], lap=2, start=3))  # continues seq 1: never
    assert fence.admit(prefill(2, [8, 9], lap=3))
    assert not fence.admit(prefill(2, [10], lap=4, start=2))  # seq 2 is now taken too
    b = prefill(3, [4], lap=5)
    b.pre_ops = [KvOp(KvOpCode.CP, 3, -1, -1, 1)]  # reads seq 1, whose rows are in the decode
    assert not fence.admit(b)
    b.pre_ops = [KvOp(KvOpCode.RM, -1)]  # every sequence
    assert not fence.admit(b)
    b.pre_ops = [KvOp(KvOpCode.KEEP, 3)]  # drops every other sequence
    assert not fence.admit(b)
    b.pre_ops = [KvOp(KvOpCode.CP, 4, -1, -1, 3), KvOp(KvOpCode.RM, 5)]
    assert fence.admit(b)
    # A tree batch (rows in several sequences) keeps all of them.
    tree = Batch(np.array([1, 2, 3]), np.array([0, 1, 1]), [[6, 7], [6], [7]], np.arange(3),
                 np.ones(3, bool), lap=6)
    assert fence.admit(tree)
    assert not fence.admit(prefill(7, [1], lap=7))
    merged = concat_batches([a, tree])
    assert merged.seq_ids.tolist() == [[1], [1], [1], [6, 7], [6], [7]]
    assert merged.pos.tolist() == [0, 1, 2, 0, 1, 1]


def test_worker_merged_equals_one_by_one(windows) -> None:
    (rt0, rt1), whole = windows
    ps = prompts(4, rt0.n_vocab)
    first = StageWorker([rt0], is_last=False)
    last = StageWorker([rt1], is_last=True)
    def sampled(key, **fields):
        return SamplerRef(key, SamplerSettings(tuple(fields.items())))

    samplings = [SamplerRef(), sampled(2, temperature=0.8, top_k=20, top_p=0.9, seed=11),
                 SamplerRef(), sampled(4, temperature=1.0, seed=5)]

    def batches():
        return [prefill(s + 1, p, lap=s + 1, sampling=samplings[s]) for s, p in enumerate(ps)]

    reset(rt0, rt1)
    alone = []
    for b in batches():
        b, h = first.run(b, None)
        h = h.copy()
        b, t = last.run(b, h)
        alone.append((h, t.copy()))
    reset(rt0, rt1)
    items = [(b, None) for b in batches()]
    outs0 = first.run_many(items)
    assert all(isinstance(o, tuple) for o in outs0)
    hidden = [np.array(h, copy=True) for _, h in outs0]
    outs1 = last.run_many([(b, h) for b, h in outs0])
    for s, ((h_ref, t_ref), h, (b, t)) in enumerate(zip(alone, hidden, outs1, strict=True)):
        assert b.lap == s + 1
        assert h.shape == h_ref.shape == (len(ps[s]), rt0.n_embd)
        np.testing.assert_allclose(h, h_ref, atol=HIDDEN_ATOL, rtol=0)
        assert len(t) == 1
        if int(t[0]) != int(t_ref[0]):
            # A flip is allowed only where the model itself is torn (greedy rows), or where a
            # seeded draw lands on a boundary that rounding moved; both need a near-tie.
            reset(whole)
            logits = whole.forward(np.asarray(ps[s], np.int32), 0, seq_ids=s + 1)[-1]
            assert abs(float(logits[t[0]] - logits[t_ref[0]])) < NEAR_TIE, (s, t, t_ref)
    merged_next = next_rows(first, ps)
    # The KV cache each sequence was left with is the same: one more token decodes alike.
    reset(rt0)
    for s, p in enumerate(ps):
        first.run(prefill(s + 1, p, lap=s + 1), None)
    np.testing.assert_allclose(merged_next, next_rows(first, ps), atol=HIDDEN_ATOL, rtol=0)


def next_rows(worker: StageWorker, ps) -> np.ndarray:
    """Hidden state of one more token (each prompt's first) after each sequence's prompt."""
    rows = []
    for s, p in enumerate(ps):
        _, h = worker.run(prefill(s + 1, [p[0]], lap=20 + s, start=len(p)), None)
        rows.append(h[0].copy())
    return np.array(rows)


def test_worker_merged_failure_fails_only_its_batch(windows) -> None:
    (rt0, _), _ = windows
    reset(rt0)
    first = StageWorker([rt0], is_last=False)
    good = prefill(1, [5, 6, 7], lap=1)
    bad = prefill(2, [8, 9], lap=2, start=4)  # seq 2 is empty: position 4 is a gap
    also = prefill(3, [10, 11], lap=3)
    outs = first.run_many([(good, None), (bad, None), (also, None)])
    assert isinstance(outs[1], Exception) and "position" in str(outs[1])
    assert outs[0][1].shape == (3, rt0.n_embd) and outs[2][1].shape == (2, rt0.n_embd)
    # The failed decode was rolled back and redone batch by batch: seqs 1 and 3 hold their
    # rows (the runtime's position check passes only where a row continues its sequence),
    # seq 2 holds none.
    first.run(prefill(1, [4], lap=4, start=3), None)
    first.run(prefill(3, [4], lap=5, start=2), None)
    first.run(prefill(2, [4], lap=6, start=0), None)


def test_worker_merged_refused_sampling_fails_only_its_batch(windows) -> None:
    """On the last stage a batch whose targets cannot be drawn (its sampler unknown) fails
    after the merged decode wrote every batch's KV: it fails alone, and the others are
    neither failed nor decoded a second time."""
    _, whole = windows
    reset(whole)
    last = StageWorker([whole], is_last=True)
    good = prefill(1, [5, 6, 7], lap=1)
    bad = prefill(2, [8, 9], lap=2, sampling=SamplerRef(99))  # never registered
    also = prefill(3, [10, 11], lap=3)
    outs = last.run_many([(good, None), (bad, None), (also, None)])
    assert isinstance(outs[1], Exception) and "no sampler registered" in str(outs[1])
    assert len(outs[0][1]) == 1 and len(outs[2][1]) == 1
    # Each sequence holds its rows once: the next position continues it.
    last.run(prefill(1, [4], lap=4, start=3), None)
    last.run(prefill(3, [4], lap=5, start=2), None)
    last.run(prefill(2, [4], lap=6, start=2), None)


# ------------------------------------------------------------------- a stage loop

class Head:
    """The head's end of the stages' link: what the last stage (or a failure) reports."""

    closed = False

    def __init__(self) -> None:
        self.msgs: list = []

    def send(self, msg) -> None:
        self.msgs.append(msg)

    def results(self) -> dict:
        errors = [m for m in self.msgs if m.kind == Kind.ERROR]
        assert not errors, [m.meta for m in errors]
        return {m.lap_id: message_result(m) for m in self.msgs if m.kind == Kind.RESULT}


class Loop(StageLoop):
    """The data path of a node hosting both windows, its stages run one after the other on
    the test's thread: every item is queued before its stage's loop starts."""

    def __init__(self, runtimes) -> None:
        self.name, self.node_id, self.key = "test", "test", b""
        self._lock, self._out_conns, self._stop = threading.RLock(), {}, threading.Event()
        self.head = Head()
        self.hosted = {k: HostedStage(k, rt.layer_range, rt, is_last=k == len(runtimes) - 1)
                      for k, rt in enumerate(runtimes)}
        for k, hosted in self.hosted.items():
            hosted.head_conn = self.head
            if k + 1 in self.hosted:
                hosted.next_local, hosted.next_stage = self.hosted[k + 1], k + 1

    def run(self, items) -> dict:
        for item in items:
            self.hosted[0].post(item)
        for k in sorted(self.hosted):
            self.hosted[k].inbox.put(None)  # ends the loop after the items
            self._run_hosted(self.hosted[k])
            assert self.hosted[k].pending == 0
        return self.head.results()


def test_loop_merges_and_forwards_each(windows) -> None:
    (rt0, rt1), _ = windows
    ps = prompts(5, rt0.n_vocab, seed=9)
    def items():  # lap 3 wants no target (a prefill chunk): it runs after the decodes
        return [("batch", prefill(s + 1, p, lap=s + 1, want_last=s != 2), None)
                for s, p in enumerate(ps)]

    reset(rt0, rt1)
    one = {}
    for item in items():  # one at a time: each its own loop run
        one.update(Loop([rt0, rt1]).run([item]))

    reset(rt0, rt1)
    loop = Loop([rt0, rt1])
    got = loop.run(items())
    for k in (0, 1):
        assert (loop.hosted[k].batches, loop.hosted[k].merged) == (5, 1)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for lap, r in got.items():
        assert r.nodes.tolist() == ([] if lap == 3 else [1000 * lap + len(ps[lap - 1]) - 1])
        # Greedy targets: float32 rounding of another batch shape is far below the gaps of
        # the tiny model's logits (a near-tie would need the rule of test_worker_*).
        assert r.targets.tolist() == one[lap].targets.tolist()
        # Each batch's own stamps, every one with the shared compute window of its stage.
        assert [s[0] for s in r.timing] == [0, 1]
    for k in (0, 1):
        windows_ = {tuple(r.timing[k][2:4]) for lap, r in got.items() if lap != 3}
        assert len(windows_) == 1 and tuple(got[3].timing[k][2:4]) not in windows_


def test_loop_keeps_sequence_and_kv_order(windows) -> None:
    (rt0, rt1), _ = windows
    ps = prompts(3, rt0.n_vocab, seed=13)
    p = ps[0] + ps[1]
    cut = len(ps[0])
    reset(rt0, rt1)
    # Chunks of one prompt (seq 1) never share a decode; the next request's decode (seq 2)
    # runs before the first chunk (no sequence in common). Then a KV op (forget seq 1) sits
    # between decodes: seq 1's prompt comes again from position 0 (19 rows), valid only if
    # the op ran before it, and the decode of seq 3 queued after it joins it.
    forget = [KvOp(KvOpCode.RM, 1, -1, -1)]
    items = [("batch", prefill(1, p[:cut], lap=1, want_last=False), None),
             ("batch", prefill(1, p[cut:], lap=2, start=cut), None),
             ("batch", prefill(2, ps[2], lap=3), None),
             ("kv", forget, 99),
             ("batch", prefill(1, p, lap=4), None),
             ("batch", prefill(3, ps[2], lap=5), None)]
    loop = Loop([rt0, rt1])
    got = loop.run(items)
    assert len(p) == 19
    assert [(loop.hosted[k].batches, loop.hosted[k].merged) for k in (0, 1)] == [(5, 1), (5, 1)]
    for k in (0, 1):  # seq 2's decode ran before seq 1's first chunk at both stages
        assert got[3].timing[k][3] <= got[1].timing[k][2]
    assert got[1].targets.tolist() == []
    # Seq 1 chunked, seq 1 whole after the op, seq 2 and seq 3 the same prompt: alike.
    assert got[2].targets.tolist() == got[4].targets.tolist()
    assert got[3].targets.tolist() == got[5].targets.tolist()
    reset(rt0, rt1)
    alone = Loop([rt0, rt1]).run([("batch", prefill(1, p, lap=4), None)])
    assert got[4].targets.tolist() == alone[4].targets.tolist()
    # Chunks that want no target at all, merged: each answered with no targets, and their
    # rows are in the KV (the next batch of each sequence continues it).
    reset(rt0, rt1)
    loop = Loop([rt0, rt1])
    got = loop.run([("batch", prefill(s, ps[s], lap=s, want_last=False), None)
                    for s in range(3)])
    assert {lap: r.targets.tolist() for lap, r in got.items()} == {0: [], 1: [], 2: []}
    assert (loop.hosted[1].batches, loop.hosted[1].merged) == (3, 1)
    got = Loop([rt0, rt1]).run([("batch", prefill(s, [7], lap=10 + s, start=len(ps[s])), None)
                                for s in range(3)])
    assert sorted(got) == [10, 11, 12]


def test_gather_lets_other_requests_pass_a_prompts_chunks() -> None:
    """Decodes of other requests run before a prefill chunk, or join its decode once it has
    let them pass, instead of waiting behind all its chunks; a decode never takes a chunk
    along; what stays behind keeps its order, and nothing moves past a batch of the same
    sequence, one whose KV ops touch it, or ops on every sequence."""
    import collections
    import queue

    def run(first, queued, cap=512, decodes_first=False):
        inbox: queue.Queue = queue.Queue()
        for it in queued:
            inbox.put(it)
        behind: collections.deque = collections.deque()
        got = gather(inbox, first, cap, behind, decodes_first=decodes_first)
        rest = list(behind) + [inbox.get_nowait() for _ in range(inbox.qsize())]
        return [it[1].lap for it in got], [it if it is None or it[0] != "batch" else it[1].lap
                                           for it in rest]

    def b(seq, lap, n=1, ops=(), want=True):
        x = prefill(seq, list(range(3, 3 + n)), lap=lap, want_last=want)
        x.pre_ops = list(ops)
        return ("batch", x, None)

    chunks = [b(1, lap, n=64, want=False) for lap in (1, 2, 3)]
    # seq 2's decode passes chunks 2 and 3 of seq 1; seq 1's own next batch never does
    assert run(chunks[0], [*chunks[1:], b(2, 9), b(1, 10)]) == ([1, 9], [2, 3, 10])
    # a passed-over batch's ops touch seq 2: seq 2 may not move ahead of it
    assert run(chunks[0], [b(1, 4, ops=[KvOp(KvOpCode.RM, 2)]), b(2, 9)]) == ([1], [4, 9])
    # nor may a batch whose own ops touch a passed-over sequence
    assert run(chunks[0], [chunks[1], b(2, 9, ops=[KvOp(KvOpCode.CP, 2, -1, -1, 1)])]) == (
        [1], [2, 9])
    # ops that reach every sequence end the scan; so do KV items and the stop signal
    keep = b(3, 4, ops=[KvOp(KvOpCode.KEEP, 3)])
    assert run(chunks[0], [chunks[1], keep, b(2, 9)]) == ([1], [2, 4, 9])
    kv = ("kv", [KvOp(KvOpCode.RM, 1)], 5)
    assert run(chunks[0], [chunks[1], kv, b(2, 9)]) == ([1], [2, kv, 9])
    assert run(chunks[0], [chunks[1], None, b(2, 9)]) == ([1], [2, None, 9])
    # the row cap: a batch too big for this decode stays behind, a smaller one still joins
    assert run(chunks[0], [b(4, 7, n=64), b(2, 9)], cap=96) == ([1, 9], [7])
    # Decodes first: decodes of other sequences (at most 16 rows) run before the chunk,
    # which goes back to the front; nothing big, nothing of its sequence, nothing past a KV
    # item, no other chunk however small.
    assert run(chunks[0], [*chunks[1:], b(2, 9), b(3, 8, n=16), b(1, 10), b(4, 7, n=17),
                           b(5, 11, n=2, want=False)],
               decodes_first=True) == ([9, 8], [1, 2, 3, 10, 7, 11])
    assert run(chunks[0], [kv, b(2, 9)], decodes_first=True) == ([1], [kv, 9])
    # a chunk of a few rows (a prompt beside running answers) lets decodes pass too
    assert run(b(5, 11, n=2, want=False), [b(2, 9)], decodes_first=True) == ([9], [11])
    # One batch of more than 16 rows per decode: another prompt's chunk waits (the two run
    # one after the other, pipelined across stages); small ones still join the chunk.
    assert run(chunks[0], [b(5, 6, n=20), chunks[1]], decodes_first=True) == ([1], [6, 2])
    assert run(chunks[0], [b(5, 6, n=20), b(2, 9)]) == ([1, 9], [6])
    assert run(b(2, 9), [b(5, 6, n=20), b(4, 7, n=17), b(3, 8)]) == ([9, 6, 8], [7])
    assert run(b(2, 9), [b(3, 8)], decodes_first=True) == ([9, 8], [])  # a decode: merges
    # A decode takes along decodes only: a chunk's rows would delay its token.
    assert run(b(2, 9), [b(3, 8, n=2, want=False), b(4, 7), chunks[0]]) == ([9, 7], [8, 1])


def test_loop_decode_goes_before_anothers_prefill_chunks(windows) -> None:
    """Stage loops: a request's decode queued behind another prompt's three chunks runs
    before them, and every result equals the one of each request alone."""
    (rt0, rt1), _ = windows
    ps = prompts(4, rt0.n_vocab, seed=21)
    p = ps[0] + ps[1] + ps[2]
    a, c = len(ps[0]), len(ps[0]) + len(ps[1])
    items = [("batch", prefill(1, p[:a], lap=1, want_last=False), None),
             ("batch", prefill(1, p[a:c], lap=2, start=a, want_last=False), None),
             ("batch", prefill(1, p[c:], lap=3, start=c), None),
             ("batch", prefill(2, ps[3], lap=4), None)]
    reset(rt0, rt1)
    loop = Loop([rt0, rt1])
    got = loop.run(items)
    for k in (0, 1):
        assert (loop.hosted[k].batches, loop.hosted[k].merged) == (4, 0)
        assert got[4].timing[k][3] <= got[1].timing[k][2]  # computed before the first chunk
    reset(rt0, rt1)
    alone = Loop([rt0, rt1]).run([("batch", prefill(1, p, lap=3), None)])
    reset(rt0, rt1)
    alone.update(Loop([rt0, rt1]).run([("batch", prefill(2, ps[3], lap=4), None)]))
    assert got[3].targets.tolist() == alone[3].targets.tolist()
    assert got[4].targets.tolist() == alone[4].targets.tolist()


# ------------------------------------------------------------------- node processes

@pytest.fixture(scope="module")
def real_ring(real_model_path, tmp_path_factory):
    """Two `edgespec node` processes on loopback, 12 layers each of the 0.5B model."""
    from test_node import NodeProc

    from edgespec.head.formation import form_ring
    from edgespec.wire import auth

    work = tmp_path_factory.mktemp("merge-ring")
    key = auth.write_key(work / "ring.key")
    nodes = [NodeProc(f"m{i}", key, work) for i in range(2)]
    try:
        chain = form_ring([n.address for n in nodes], real_model_path, auth.load_key(key),
                          ranges=[(0, 12), (12, 24)], n_ctx=1024, n_seq_max=8, profile=False,
                          log_fn=lambda s: None)
        yield chain
        chain.close()
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(work, ignore_errors=True)  # the nodes' received shards (1 GB)


def test_node_processes_merge_and_report(real_ring, real_model_path) -> None:
    """A long prefill (seq 1) holds stage 0 for about a second on one thread; three small
    batches of other sequences, sent right behind it, wait in the inbox (the head's socket
    delivers them within milliseconds) and share one decode. Their targets equal the same
    batches sent one at a time (the near-tie rule of the quantized model), and the nodes'
    health counts the merged decodes."""
    chain = real_ring
    rng = np.random.default_rng(21)
    ps = [rng.integers(100, 20000, n).tolist() for n in (300, 7, 11, 5)]

    def clear() -> None:
        chain.kv([KvOp(KvOpCode.RM, s, -1, -1) for s in range(1, 5)])

    def send(s: int, lap: int) -> Batch:
        b = prefill(s + 1, ps[s], lap=lap)
        b.timing = []
        chain.submit(b)
        return b

    alone = {}
    clear()
    for s in range(4):
        send(s, lap=100 + s)
        r = chain.next_result()
        alone[s] = r.targets.tolist()
    before = [m.ask("health").stages for m in chain.members]
    clear()
    for s in range(4):
        send(s, lap=200 + s)
    got = {}
    for _ in range(4):
        r = chain.next_result()
        got[r.lap - 200] = r.targets.tolist()
        assert [st[0] for st in r.timing] == [0, 1]
    after = [m.ask("health").stages for m in chain.members]
    stage0 = next(st for h in after for k, st in h.items() if k == 0)
    stage0_before = next(st for h in before for k, st in h.items() if k == 0)
    assert stage0.batches - stage0_before.batches == 4
    assert stage0.merged - stage0_before.merged >= 1
    assert stage0_before.merged == 0  # one at a time: nothing to merge
    for s in range(4):
        if got[s] != alone[s]:
            with StageRuntime(real_model_path, n_ctx=1024, n_threads=1) as whole:
                logits = whole.forward(np.asarray(ps[s], np.int32), 0)[-1]
            gap = float(logits[alone[s][0]] - logits[got[s][0]])
            assert abs(gap) < 0.5, (s, got[s], alone[s], gap)


def test_loop_drops_pruned_rows_per_batch(windows) -> None:
    (rt0, rt1), _ = windows
    ps = prompts(3, rt0.n_vocab, seed=17)
    reset(rt0, rt1)
    loop = Loop([rt0, rt1])
    for hosted in loop.hosted.values():  # as _on_prune does: lap 2's every node was rejected
        hosted.worker.prune(2, range(2000, 2000 + len(ps[1])), ())
    got = loop.run([("batch", prefill(s + 1, p, lap=s + 1), None) for s, p in enumerate(ps)])
    assert got[2].targets.tolist() == [] and got[2].nodes.tolist() == []
    assert [len(got[lap].targets) for lap in (1, 3)] == [1, 1]
    assert (loop.hosted[0].batches, loop.hosted[0].merged) == (3, 1)
    assert (loop.hosted[1].batches, loop.hosted[1].merged) == (2, 1)  # lap 2 went no further
    # Seq 2 holds nothing (its rows never ran): its prompt starts again at position 0.
    again = Loop([rt0, rt1]).run([("batch", prefill(2, ps[1], lap=4), None)])
    assert len(again[4].targets) == 1
