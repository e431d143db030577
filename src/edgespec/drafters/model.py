"""Draft-model drafter: a small GGUF with the target's tokenizer grows a best-first token tree.

Search (SpecExec / EAGLE-2 style): every drafted node scores ``s = s(parent) + log q(token)``.
A heap holds the candidate children (top-``top_k`` of each decoded node's distribution); each
step pops the ``width`` best candidates, makes them tree nodes, and decodes those that may still
get children in **one** ``llama_decode`` call, so a tree of B nodes costs about B / width calls.

KV layout (one llama.cpp context, ``kv_unified=True``, docs/design.md 3.4-3.5; the drafter's
own, or its slot's share of one the ring's slots draft on together, ``DraftContext``; the
seq ids below are the drafter's own, which a shared context maps into the slot's range):

* seq 0 holds the committed text (prompt + accepted tokens) that the draft model has processed;
* every decoded tree node sits in a *tree sequence*: the first child of a node continues its
  parent's sequence, any further child gets a fresh sequence that first borrows the parent's
  path with ``seq_cp(parent_seq, new, -1, parent_pos + 1)`` (no KV data is copied: the cells
  just gain a sequence id), so each tree sequence is exactly one root-to-node path;
* ``accept`` walks the accepted tokens down the decoded nodes, moves the deepest one's path into
  seq 0 with ``seq_cp(..., 0, ...)`` and drops every tree sequence with ``seq_keep(0)``: accepted
  tokens the draft model already processed are never recomputed; the rest (at least the bonus
  token) is decoded at the next proposal.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path as FsPath

import numpy as np

from edgespec.drafters.base import Drafter, DraftTree, Path, check_request, select_new
from edgespec.drafters.draft_context import DraftContext, DraftSeqs
from edgespec.drafters.tokenizer import (
    TokenizerFingerprint,
    TokenizerMismatchError,
    check_draft_tokenizer,
    fingerprint_of,
)
from edgespec.llm.llamacpp import Closing
from edgespec.seqs import N_SEQ

__all__ = ["DraftModelDrafter"]



# -- the step's tree ------------------------------------------------------------------------


@dataclass(eq=False)
class _Node:
    """One drafted (or path) token of the current step."""

    path: Path  # tokens below the root, () for the root
    token: int
    logprob: float  # draft log q(token | parent path); 0 for path nodes the draft never scored
    parent: _Node | None
    seq: int = -1  # tree sequence holding this node's KV cell; -1 = not decoded
    pos: int = -1
    seq_continued: bool = False  # a child already extends `seq` (further children need new seqs)
    children: list[tuple[int, float]] | None = None  # top-k (token, logprob) once decoded
    kids: dict[int, _Node] = field(default_factory=dict)

    def child(self, token: int, logprob: float = 0.0) -> _Node:
        node = self.kids.get(token)
        if node is None:
            node = _Node(self.path + (token,), token, logprob, self)
            self.kids[token] = node
        return node


class DraftModelDrafter(Drafter, Closing):
    """Tree drafter driven by a small GGUF model sharing the target's tokenizer.

    Args:
        model_path: the draft GGUF.
        target: the target's GGUF path or its :class:`TokenizerFingerprint`; the draft model is
            refused with :class:`TokenizerMismatchError` unless vocab size and token texts match.
            ``None`` skips the check (only for tests that use the draft as its own target).
        n_ctx: KV cells: prompt + generated text + one tree must fit.
        top_k: children considered under each decoded node.
        width: candidates turned into nodes (and decoded together) per ``llama_decode`` call.
        max_tree_seqs: tree sequences (about the number of branches) one step may use.
        n_threads: llama.cpp threads (1 when several contexts share a small host, docs/design.md 3.7).
        n_batch: tokens per decode call when catching up with long prompts.
        seqs: draft on these sequences of a context shared with other drafters (a ring's
            slots, ``DraftContext.view``; the drafter closes the view). ``None``: a context
            of its own (``n_ctx``, ``n_batch``, ``n_threads`` then size it).
    """

    #: Log-prob gap (nats) within which candidates share one decode call.
    BATCH_MARGIN = 2.0

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        target: str | os.PathLike[str] | TokenizerFingerprint | None,
        *,
        n_ctx: int = 4096,
        top_k: int = 4,
        width: int = 8,
        max_tree_seqs: int = 128,
        n_threads: int = 1,
        n_batch: int = 512,
        seqs: DraftSeqs | None = None,
    ) -> None:
        super().__init__()
        if top_k < 1 or width < 1 or n_threads < 1 or n_batch < 1:
            raise ValueError("top_k, width, n_threads and n_batch must all be >= 1")
        if not 1 <= max_tree_seqs < N_SEQ:
            raise ValueError(f"max_tree_seqs must be in [1, {N_SEQ - 1}], got {max_tree_seqs}")
        self.model_path = FsPath(model_path)
        self.top_k, self.width = top_k, width
        self._seqs: DraftSeqs | None = None
        try:
            if seqs is None:
                # A context of its own. Unified KV: tree nodes share cells across sequences
                # (docs/design.md 3.4); one copy of the weights per process
                # (edgespec.llm.shared_model).
                seqs = DraftContext(self.model_path, width=max_tree_seqs + 1, n_ctx=n_ctx,
                                    n_batch=max(n_batch, width, 1),
                                    n_threads=n_threads).view(0)
            self._seqs = seqs
            self._model = seqs.ctx.model
            self.fingerprint = fingerprint_of(self._model)
            # Proposals stay inside both vocabularies (padding may differ in size).
            self._n_propose = self.fingerprint.n_vocab
            if target is not None:
                try:
                    wanted = check_draft_tokenizer(self.fingerprint, target)
                except TokenizerMismatchError:
                    if isinstance(target, TokenizerFingerprint):
                        raise
                    check_draft_tokenizer(self.model_path, target)  # the message names both
                    raise
                self._n_propose = min(self._n_propose, wanted.n_used)
            self.n_vocab = self.fingerprint.n_vocab
            self.n_ctx = n_ctx
            self._n_batch = seqs.ctx.n_batch
        except BaseException:
            if seqs is not None:
                seqs.close()
            self._seqs = None
            raise
        self._max_tree_seqs = min(max_tree_seqs, seqs.width - 1)
        self._parked = False  # the committed cells wait in host memory (idle())
        self._history: list[int] = []
        self._n_kv = 0  # history tokens present in seq 0
        self._root_children: list[tuple[int, float]] | None = None  # top-k after history[-1]
        self._root: _Node | None = None
        self._free_seqs: list[int] = []
        self.n_decode_calls = 0
        self.n_decoded_tokens = 0

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Let go of the context (its last user frees it and gives the model back);
        idempotent."""
        seqs, self._seqs = getattr(self, "_seqs", None), None
        if seqs is not None:
            seqs.close()

    def idle(self) -> None:
        """The generation ended: move the committed text's cells into host memory if the
        context is shared (``DraftSeqs.park``); the next ``begin`` puts them back."""
        if self._seqs is not None:
            self._end_tree()
            self._parked = self._seqs.park() or self._parked


    # -- Drafter ----------------------------------------------------------------------------

    @property
    def history(self) -> Sequence[int]:
        return self._history

    def begin(self, prompt_tokens: Sequence[int]) -> None:
        toks = self._validated(prompt_tokens)
        if not toks:
            raise ValueError("begin() needs at least one prompt token (the first root)")
        self._require_open()
        self._end_tree()
        # Keep the KV of the longest common prefix with the previous text (chat turns share
        # their history); at least the last prompt token is decoded again for its logits.
        keep, limit = 0, min(self._n_kv, len(toks) - 1)
        while keep < limit and self._history[keep] == toks[keep]:
            keep += 1
        self._seqs.rm(0, keep, -1)
        self._history = toks
        self._n_kv = keep
        self._root_children = None
        self._catch_up()  # prefill the prompt now, so the first proposal only drafts

    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree:
        check_request(budget, max_depth)
        self._check_root(root)
        self._require_open()
        self._end_tree()  # a proposal without accept() in between restarts the step
        return self._search(self._start_tree(), budget, max_depth)

    def propose_under(self, path: Sequence[int], budget: int, max_depth: int) -> DraftTree:
        check_request(budget, max_depth)
        self._require_open()
        if not self._history:
            raise RuntimeError("propose_under() called before begin()")
        root = self._root if self._root is not None else self._start_tree()
        node = root
        for tok in self._validated(path):
            node = node.child(tok)
        self._decode_chain(node)
        return self._search(node, budget, max_depth)

    def accept(self, accepted_tokens: Sequence[int]) -> None:
        toks = self._validated(accepted_tokens)
        if not self._history:
            raise RuntimeError("accept() called before begin()")
        self._require_open()
        deepest = self._root
        if deepest is not None and self._n_kv == len(self._history):
            # Follow the accepted tokens down the nodes that have KV; stop at the first gap.
            for tok in toks:
                nxt = deepest.kids.get(tok)
                if nxt is None or nxt.seq < 0:
                    break
                deepest = nxt
            if deepest is not self._root:
                root_pos = self._root.pos
                self._seqs.cp(deepest.seq, 0, root_pos + 1, deepest.pos + 1)
                self._n_kv += len(deepest.path)
        if toks:
            # Every accepted token already decoded: the deepest node's children are the new
            # root's; otherwise the next catch-up decode computes them.
            whole = deepest is not None and len(deepest.path) == len(toks)
            self._root_children = deepest.children if whole else None
        self._history.extend(toks)
        self._end_tree()

    # -- statistics used by tests and the bench ----------------------------------------------

    @property
    def n_kv(self) -> int:
        """History tokens whose KV the draft model holds in its committed sequence."""
        return self._n_kv

    def seq_pos_max(self, seq: int) -> int:
        """Highest position stored for ``seq`` (-1 if none): lets tests check the KV layout."""
        self._require_open()
        return self._seqs.pos_max(seq)

    # -- steps -------------------------------------------------------------------------------

    def _start_tree(self) -> _Node:
        self._catch_up()
        root = _Node((), self._history[-1], 0.0, None, seq=0, pos=len(self._history) - 1)
        root.seq_continued = True  # seq 0 is the committed text: tree nodes never extend it
        root.children = self._root_children
        self._root = root
        return root

    def _end_tree(self) -> None:
        every = list(range(self._max_tree_seqs, 0, -1))
        if self._free_seqs != every and self._seqs is not None:
            self._seqs.keep_committed(set(every) - set(self._free_seqs))
        self._free_seqs = every
        self._root = None
        self._ledger.clear()

    def _catch_up(self) -> None:
        """Decode the history tokens seq 0 lacks (prompt, bonus, accepted tokens not drafted)."""
        pending = self._history[self._n_kv :]
        if not pending:
            return
        for start in range(0, len(pending), self._n_batch):
            chunk = pending[start : start + self._n_batch]
            last = start + len(chunk) == len(pending)
            rows = [(tok, self._n_kv + i, 0, last and i == len(chunk) - 1) for i, tok in enumerate(chunk)]
            logits = self._decode(rows)
            self._n_kv += len(chunk)
        self._root_children = self._top_children(logits)[0]

    # -- search ---------------------------------------------------------------------------------

    def _search(self, under: _Node, budget: int, max_depth: int) -> DraftTree:
        """Best-first expansion below ``under``; returns up to ``budget`` nodes not yet proposed."""
        if budget == 0 or max_depth == 0 or under.children is None:
            return DraftTree.empty()
        tie = itertools.count()
        heap: list[tuple[float, int, _Node, int]] = []  # (-score, tie, node, depth below under)

        def push_children(node: _Node, score: float, depth: int) -> None:
            for tok, lp in node.children or ():
                kid = node.child(tok, lp)
                kid.logprob = lp
                heapq.heappush(heap, (-(score + lp), next(tie), kid, depth + 1))

        push_children(under, 0.0, 0)
        selected: list[tuple[float, int, _Node]] = []  # (-score, depth, node)
        n_new = 0
        while heap and n_new < budget:
            expand: list[tuple[_Node, float, int]] = []
            batch_best = -heap[0][0]
            while heap and len(expand) < self.width and n_new < budget:
                # One decode call expands several candidates at once, but only those nearly as
                # likely as the batch's best: a confident draft then grows deep chains (what
                # gets accepted) instead of being forced to take every unlikely sibling.
                if expand and -heap[0][0] < batch_best - self.BATCH_MARGIN:
                    break
                neg, _, node, depth = heapq.heappop(heap)
                selected.append((neg, depth, node))
                if node.path not in self._ledger:
                    n_new += 1
                if depth < max_depth:
                    expand.append((node, -neg, depth))
            if n_new >= budget or not expand:
                break
            self._decode_nodes([node for node, _, _ in expand if node.children is None])
            for node, score, depth in expand:
                push_children(node, score, depth)
        # Width-batched pops are best-first only per batch: sort by score (depth breaks ties, so
        # parents still come first) to hand out the tree in descending score, as FlowSpec cuts it.
        selected.sort(key=lambda row: (row[0], row[1]))
        base = len(under.path)
        rows = [(n.path[base:], n.token, n.logprob) for _, _, n in selected]
        tree = select_new(rows, under.path, self._ledger, budget)
        self._ledger.add_tree(tree, under.path)
        return tree

    def _decode_chain(self, node: _Node) -> None:
        """Make sure ``node`` and its ancestors are decoded (FlowSpec expansion under a path)."""
        chain: list[_Node] = []
        walk: _Node | None = node
        while walk is not None and walk.children is None:
            chain.append(walk)
            walk = walk.parent
        self._decode_nodes(chain[::-1])

    def _decode_nodes(self, nodes: list[_Node]) -> None:
        """Decode tree nodes (parents before children) in one call; store their top-k children."""
        rows: list[tuple[int, int, int, bool]] = []
        copies: list[tuple[int, int, int, int]] = []  # go with the decode (DraftContext)
        placed: list[_Node] = []
        for node in nodes:
            parent = node.parent
            assert parent is not None, "the root is decoded by _catch_up, never here"
            if parent.seq < 0:
                node.children = []  # parent had no free sequence: this node stays a leaf
                continue
            if not parent.seq_continued:
                seq = parent.seq
                parent.seq_continued = True
            elif self._free_seqs:
                seq = self._free_seqs.pop()
                # Borrow the parent's path (positions <= parent) without copying KV data.
                copies.append((parent.seq, seq, -1, parent.pos + 1))
            else:
                node.children = []  # out of tree sequences: leave this node unexpanded
                continue
            node.seq, node.pos = seq, parent.pos + 1
            if node.pos >= self.n_ctx:
                raise RuntimeError(
                    f"draft context full: position {node.pos} >= n_ctx {self.n_ctx}; "
                    "create the DraftModelDrafter with a larger n_ctx"
                )
            rows.append((node.token, node.pos, seq, True))
            placed.append(node)
        for start in range(0, len(rows), self._n_batch):
            part = placed[start : start + self._n_batch]
            logits = self._decode(rows[start : start + self._n_batch],
                                  copies if start == 0 else ())
            for node, kids in zip(part, self._top_children(logits), strict=True):
                node.children = kids

    # -- llama.cpp calls ---------------------------------------------------------------------

    def _decode(self, rows: list[tuple[int, int, int, bool]],
                copies: Sequence[tuple[int, int, int, int]] = ()) -> np.ndarray:
        """One ``llama_decode`` of ``(token, pos, seq, wants_logits)`` rows (perhaps beside
        other slots' rows, ``DraftContext``), after the ``seq_cp`` ``copies``; returns the
        logits of the rows that want them."""
        assert self._seqs is not None and len(rows) <= self._n_batch
        logits = self._seqs.decode(rows, copies)
        self.n_decode_calls += 1
        self.n_decoded_tokens += len(rows)
        return logits

    def _top_children(self, logits: np.ndarray) -> list[list[tuple[int, float]]]:
        """Top-k (token, log-softmax) of each logits row, best first."""
        logits = logits[:, :self._n_propose]
        k = min(self.top_k, logits.shape[1])
        out = []
        for row in logits:
            top = np.argpartition(row, -k)[-k:]
            top = top[np.argsort(-row[top], kind="stable")]
            m = float(row.max())
            lse = m + float(np.log(np.exp(row - m, dtype=np.float64).sum()))
            out.append([(int(t), float(row[t]) - lse) for t in top])
        return out

    # -- helpers ------------------------------------------------------------------------------

    def _validated(self, tokens: Sequence[int]) -> list[int]:
        toks = [int(t) for t in tokens]
        bad = [t for t in toks if not 0 <= t < self.fingerprint.n_vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the draft vocabulary [0, {self.fingerprint.n_vocab})")
        return toks

    def _require_open(self) -> None:
        """Raises once closed; brings parked committed cells back (``idle``)."""
        if self._seqs is None:
            raise RuntimeError("the DraftModelDrafter was closed")
        if self._parked:
            self._parked = False
            try:
                self._seqs.restore()
            except MemoryError:  # no room now: the committed text is decoded again
                self._n_kv = 0
                self._root_children = None
