"""Pure-Python reference of the speculative core (csrc/tree, verify, rollback).

Written for clarity, not speed: tests run it side by side with ``edgespec._core`` and demand
identical trees, layouts, seq ids, KV ops, decisions and plans. The rules it encodes are the
contract documented in ``edgespec/tree/core.py`` and ``csrc/verify.hpp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# KV op rows (code, seq, p0, p1, arg), numbered as edgespec.tree.kvop.KvOpCode.
KV_RM, KV_CP, KV_KEEP = 1, 2, 3
ACCEPTED, PENDING = 0, 1
MASK64 = (1 << 64) - 1
LOGPROB_SLACK = 1e-5


# ----------------------------------------------------------------------------------------------
# Sampling


def uniform(seed: int, pos: int) -> float:
    """splitmix64 output number ``pos + 1`` of the stream seeded with ``seed``, in [0, 1)."""
    z = (seed + (pos + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def argmax(row: np.ndarray) -> int:
    """First index of the maximum; NaN never wins; all -inf/NaN gives 0."""
    return int(np.argmax(np.where(np.isnan(row), -np.inf, row)))


@dataclass(frozen=True)
class Config:
    temperature: float = 0.0
    seed: int = 0


def _seq_sum(xs: list[float]) -> float:
    total = 0.0
    for x in xs:  # left to right, like the C++ loop (builtin sum() compensates on 3.12+)
        total += x
    return total


def sample(row: np.ndarray, cfg: Config, pos: int) -> int:
    """The target's token at sequence position ``pos`` from one logits row."""
    if cfg.temperature == 0.0:
        return argmax(row)
    vals = [float(v) for v in row]
    if any(math.isnan(v) for v in vals):
        raise ValueError("NaN in a logits row")
    lmax = max(vals)
    if lmax == -math.inf:
        raise ValueError("logits row has no finite value")
    u = uniform(cfg.seed, pos)
    ids = list(range(len(vals)))
    w = [math.exp((vals[i] - lmax) / cfg.temperature) for i in ids]
    target = u * _seq_sum(w)
    cum, last = 0.0, -1
    for j, i in enumerate(ids):
        cum += w[j]
        if w[j] > 0.0:
            last = j
        if cum > target:
            return i
    return ids[last if last >= 0 else 0]


# ----------------------------------------------------------------------------------------------
# Tree


class RefTree:
    """Reference TokenTree: same numbering, seq pool, ops and layouts as the C++ one."""

    def __init__(self, root_token: int, root_pos: int, max_seqs: int = 255) -> None:
        if not 1 <= max_seqs <= 255:
            raise ValueError("max_seqs must be in [1, 255]")
        self.max_seqs = max_seqs
        self.reset(root_token, root_pos)

    def reset(self, root_token: int, root_pos: int) -> None:
        self.root_pos = root_pos
        self.parent, self.token, self.depth = [-1], [root_token], [0]
        self.lp, self.score, self.seq, self.alive = [0.0], [0.0], [-1], [True]
        self.n_rows = 0
        self.last_start = 0
        self.used: set[int] = set()

    @property
    def size(self) -> int:
        return len(self.parent)

    def children(self, i: int) -> list[int]:
        return [c for c in range(i + 1, self.size) if self.parent[c] == i and self.alive[c]]

    def is_leaf(self, i: int) -> bool:
        return self.alive[i] and not self.children(i)

    def add(self, parent: int, token: int, logprob: float) -> int:
        if not (0 <= parent < self.size) or not self.alive[parent]:
            raise ValueError("bad parent")
        if token < 0 or math.isnan(logprob) or logprob > LOGPROB_SLACK:
            raise ValueError("bad token or log-prob")
        logprob = min(logprob, 0.0)
        if any(
            self.parent[c] == parent and self.token[c] == token and not self.alive[c]
            for c in range(parent + 1, self.size)
        ):
            raise ValueError("token was pruned under this parent")
        for c in self.children(parent):
            if self.token[c] == token:
                if logprob > self.lp[c]:
                    self.lp[c] = logprob
                    for i in range(c, self.size):
                        self.score[i] = self.score[self.parent[i]] + self.lp[i]
                return c
        self.parent.append(parent)
        self.token.append(token)
        self.depth.append(self.depth[parent] + 1)
        self.lp.append(logprob)
        self.score.append(self.score[parent] + logprob)
        self.seq.append(-1)
        self.alive.append(True)
        return self.size - 1

    def _key(self, i: int) -> tuple[float, int, int]:
        return (-self.score[i], self.depth[i], i)

    def _renumber(self, remap: list[int], new_size: int) -> None:
        for name in ("parent", "token", "depth", "lp", "score", "seq", "alive"):
            old = getattr(self, name)
            new = [None] * new_size
            for i, j in enumerate(remap):
                if j >= 0:
                    new[j] = old[i]
            setattr(self, name, new)
        self.parent = [p if p < 0 else remap[p] for p in self.parent]

    def select(self, budget: int) -> list[int]:
        n = self.size
        pending = sorted(range(self.n_rows, n), key=self._key)
        chosen = [i < self.n_rows and self.alive[i] for i in range(n)]
        has_child = [False] * n
        for i in range(self.n_rows):
            if self.alive[i] and self.parent[i] >= 0:
                has_child[self.parent[i]] = True
        leaves = sum(1 for i in range(self.n_rows) if self.alive[i] and not has_child[i])
        kept = 0
        for v in pending:
            p = self.parent[v]
            if p < 0:
                chosen[v] = True
                leaves += 1
                continue
            if not chosen[p] or kept >= budget:
                continue
            if has_child[p]:
                if leaves + 1 > self.max_seqs:
                    continue
                leaves += 1
            chosen[v] = True
            has_child[p] = True
            kept += 1
        remap, nxt = [-1] * n, 0
        for i in range(n):
            if chosen[i] or i < self.n_rows:
                remap[i] = nxt
                nxt += 1
        self._renumber(remap, nxt)
        return remap

    def _alloc(self) -> int:
        s = min(set(range(1, self.max_seqs + 1)) - self.used)
        self.used.add(s)
        return s

    def order(self) -> tuple[list[int], int, int, list[list[int]]]:
        n, old = self.size, self.n_rows
        remap = list(range(n))
        if n == old:
            return remap, old, old, []
        if sum(self.is_leaf(i) for i in range(n)) > self.max_seqs:
            raise ValueError("too many leaves")
        pending = sorted(range(old, n), key=self._key)
        for r, v in enumerate(pending):
            remap[v] = old + r
        self._renumber(remap, n)
        seq_before = self.seq[:old]
        ops: list[list[int]] = []
        for v in range(old, n):
            if any(self.parent[c] == v for c in range(v + 1, n)):
                continue
            a = v
            while a >= old:
                a = self.parent[a]
            if a < 0:
                s = self._alloc()
                ops.append([KV_CP, 0, -1, -1, s])
            elif self.seq[a] >= 0:
                s, self.seq[a] = self.seq[a], -1
            else:
                src = min(r for r in self._subtree(a) if r < old and seq_before[r] >= 0)
                s = self._alloc()
                ops.append([KV_CP, seq_before[src], -1, self.root_pos + self.depth[a] + 1, s])
            self.seq[v] = s
        self.n_rows, self.last_start = n, old
        return remap, old, n, ops

    def _subtree(self, a: int) -> list[int]:
        out, stack = [], [a]
        while stack:
            v = stack.pop()
            if self.alive[v]:
                out.append(v)
                stack.extend(c for c in range(v + 1, self.size) if self.parent[c] == v)
        return out

    def any_leaf_seq(self, i: int) -> int:
        leaves = [r for r in self._subtree(i) if self.is_leaf(r) and self.seq[r] >= 0]
        return self.seq[min(leaves)] if leaves else -1

    def segments(self, start: int, stop: int, size: int = 0, count: int = 0) -> list[int]:
        if not 0 <= start < stop <= self.n_rows or (size > 0) == (count > 0):
            raise ValueError("bad segmentation")
        if size > 0:
            return [*range(start, stop, size), stop]
        n = stop - start
        if count > n:
            raise ValueError("too many segments")
        base, extra, b, x = n // count, n % count, [start], start
        for k in range(count - 1):
            x += base + (1 if k < extra else 0)
            b.append(x)
        return [*b, stop]

    def row_seqs(self, i: int) -> list[int]:
        return sorted(self.seq[r] for r in self._subtree(i) if r < self.n_rows and self.seq[r] >= 0)

    def layout(self, start: int, stop: int) -> tuple[np.ndarray, ...]:
        rows = range(start, stop)
        seqs = [self.row_seqs(i) for i in rows]
        width = max([1, *(len(s) for s in seqs)])
        mat = np.full((len(rows), width), -1, np.int32)
        for r, s in enumerate(seqs):
            mat[r, : len(s)] = s
        i32 = lambda xs: np.asarray(list(xs), np.int32)  # noqa: E731
        return (
            i32(self.token[i] for i in rows),
            i32(self.root_pos + self.depth[i] for i in rows),
            mat,
            i32(len(s) for s in seqs),
            i32(self.parent[i] for i in rows),
            i32(self.depth[i] for i in rows),
        )


# ----------------------------------------------------------------------------------------------
# Verification


@dataclass
class RefDecision:
    status: int = PENDING
    path: list[int] = field(default_factory=lambda: [0])
    tokens: list[int] = field(default_factory=list)
    bonus: int = -1
    need_row: int = 0
    n_processed: int = 0


class RefVerification:
    """Step-wise verification of one lap: same walk and draws as the C++ ``Verification``."""

    def __init__(self, cfg: Config, root_pos: int, tokens, parents) -> None:
        self.cfg, self.root_pos = cfg, root_pos
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depth: list[int] = []
        self.dec = RefDecision()
        self.extend(tokens, parents, 0)

    def extend(self, tokens, parents, start: int) -> None:
        assert start == len(self.tokens)
        for t, p in zip(tokens, parents, strict=True):
            i = len(self.tokens)
            if i > 0 and not 0 <= p < i:
                raise ValueError("rows must be parents-first")
            if i > 0 and self._child(int(p), int(t)) >= 0:
                raise ValueError("duplicate child")
            self.tokens.append(int(t))
            self.parents.append(-1 if i == 0 else int(p))
            self.depth.append(0 if i == 0 else self.depth[p] + 1)

    def _child(self, node: int, token: int) -> int:
        for c in range(node + 1, len(self.tokens)):
            if self.parents[c] == node and self.tokens[c] == token:
                return c
        return -1

    def _begin(self, n: int, start: int, rows) -> list[int]:
        if start < self.dec.n_processed:
            raise ValueError("rows must arrive in order")
        ids = list(range(start, start + n)) if rows is None else [int(r) for r in rows]
        if any(r < start for r in ids) or any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            raise ValueError("row ids must be ascending and >= start")
        stop = start + n if rows is None else (ids[-1] + 1 if ids else start)
        if stop > len(self.tokens):
            raise ValueError("rows beyond the known tree")
        self.dec.n_processed = stop
        return ids

    def _walk(self, ids: list[int], target) -> RefDecision:
        d = self.dec
        if d.status == ACCEPTED:
            return d
        cur = d.path[-1]
        while cur < d.n_processed:
            if cur not in ids:
                raise ValueError(f"row {cur} is on the accepted path but its logits were never fed")
            x = target(ids.index(cur), cur)
            c = self._child(cur, x)
            if c < 0:
                d.status, d.bonus, d.need_row = ACCEPTED, x, -1
                return d
            d.path.append(c)
            d.tokens.append(x)
            cur = c
        d.need_row = cur
        return d

    def feed(self, logits: np.ndarray, start: int, rows=None) -> RefDecision:
        ids = self._begin(len(logits), start, rows)
        return self._walk(
            ids, lambda r, node: sample(logits[r], self.cfg, self.root_pos + self.depth[node] + 1)
        )

    def feed_targets(self, targets, start: int, rows=None) -> RefDecision:
        ids = self._begin(len(targets), start, rows)
        return self._walk(ids, lambda r, node: int(targets[r]))


# ----------------------------------------------------------------------------------------------
# Rollback plans


def plan_commit(tree: RefTree, d: RefDecision) -> dict:
    assert d.status == ACCEPTED and d.path[0] == 0
    n = d.path[-1]
    x = tree.any_leaf_seq(n)
    n_pos = tree.root_pos + tree.depth[n]
    plan = {
        "ops": [[KV_CP, x, tree.root_pos, n_pos + 1, 0], [KV_KEEP, 0, -1, -1, 0]],
        "survivors": [],
        "remap": [-1] * tree.n_rows,
        "path": list(d.path),
        "tokens": [tree.token[r] for r in d.path[1:]],
        "next_root_token": d.bonus,
        "next_root_pos": n_pos + 1,
    }
    tree.reset(d.bonus, n_pos + 1)
    return plan


def plan_prune(tree: RefTree, d: RefDecision) -> dict:
    assert d.status == PENDING and tree.size == tree.n_rows
    keep = set(d.path) | set(tree._subtree(d.path[-1]))
    ops, survivors, remap = [], [], [-1] * tree.n_rows
    for r in range(tree.n_rows):
        if not tree.alive[r]:
            continue
        if r in keep:
            remap[r] = len(survivors)
            survivors.append(r)
            continue
        if tree.seq[r] >= 0:
            ops.append([KV_RM, tree.seq[r], -1, -1, 0])
            tree.used.discard(tree.seq[r])
        tree.alive[r], tree.seq[r] = False, -1
    return {
        "ops": ops,
        "survivors": survivors,
        "remap": remap,
        "path": list(d.path),
        "tokens": [tree.token[r] for r in d.path[1:]],
        "next_root_token": -1,
        "next_root_pos": -1,
    }
