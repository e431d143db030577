"""The drafter interface: what the speculative engine asks of anything that proposes tokens.

A drafter proposes a scored *tree* of candidate continuations under the last accepted token
(the root), and is told afterwards which tokens the target accepted. The shape follows
llama.cpp's ``common/speculative.h`` (init / draft / accept) and vLLM's ``ProposerInterface``,
extended to trees and to FlowSpec's dynamic expansion (``propose_under``).

Vocabulary used by every drafter:

* **history**: the prompt plus every accepted token, in order. Its last token is the *root*: it
  is accepted but the target has not processed it yet; the next tree hangs below it.
* **step**: everything between two ``accept`` calls. Within a step a drafter remembers the
  nodes it already proposed (by their token path below the root), so that ``propose_under``
  returns new nodes instead of repeating old ones.
* **path**: a tuple of token ids below the root, ``()`` being the root itself.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

Path = tuple[int, ...]


@dataclass(frozen=True)
class DraftTree:
    """Drafted nodes under one root, in parents-first order.

    ``parents[i]`` is the index of node i's parent (always ``< i``) or -1 for a child of the root;
    ``tokens[i]`` is the node's token id; ``logprobs[i]`` is the drafter's log-probability of that
    token given its parent path (a draft model's log-softmax, or retrieval's log of normalised
    match frequency). Cumulative scores and the global top-B are the C++ ``TokenTree``'s job.
    """

    parents: np.ndarray  # int32 (n,)
    tokens: np.ndarray  # int32 (n,)
    logprobs: np.ndarray  # float32 (n,)

    def __post_init__(self) -> None:
        # Coerce once so that every consumer sees the documented dtypes and flat shapes.
        object.__setattr__(self, "parents", np.ascontiguousarray(self.parents, dtype=np.int32))
        object.__setattr__(self, "tokens", np.ascontiguousarray(self.tokens, dtype=np.int32))
        object.__setattr__(self, "logprobs", np.ascontiguousarray(self.logprobs, dtype=np.float32))
        n = self.tokens.shape
        if self.parents.ndim != 1 or self.parents.shape != n or self.logprobs.shape != n:
            raise ValueError(
                "DraftTree arrays must be 1-D and of equal length, got "
                f"parents {self.parents.shape}, tokens {n}, logprobs {self.logprobs.shape}"
            )
        if n[0] and np.any(self.parents >= np.arange(n[0], dtype=np.int32)):
            raise ValueError("DraftTree must be parents-first: every parents[i] must be < i")
        if n[0] and np.any(self.parents < -1):
            raise ValueError("DraftTree parents must be >= -1 (-1 = the root)")

    @staticmethod
    def empty() -> DraftTree:
        """A tree with no nodes (nothing worth proposing)."""
        return DraftTree(np.empty(0, np.int32), np.empty(0, np.int32), np.empty(0, np.float32))

    @staticmethod
    def from_nodes(nodes: Iterable[tuple[int, int, float]]) -> DraftTree:
        """Build from ``(parent, token, logprob)`` triples already in parents-first order."""
        rows = list(nodes)
        if not rows:
            return DraftTree.empty()
        parents, tokens, logprobs = zip(*rows, strict=True)
        return DraftTree(np.array(parents), np.array(tokens), np.array(logprobs))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def depths(self) -> np.ndarray:
        """Depth of every node (1 for a child of the root)."""
        depth = np.zeros(len(self), np.int32)
        for i, p in enumerate(self.parents.tolist()):
            depth[i] = 1 if p < 0 else depth[p] + 1
        return depth

    def scores(self) -> np.ndarray:
        """Cumulative log-probability of every node (sum of logprobs along its path)."""
        score = np.zeros(len(self), np.float64)
        for i, p in enumerate(self.parents.tolist()):
            score[i] = self.logprobs[i] + (0.0 if p < 0 else score[p])
        return score

    def paths(self) -> list[Path]:
        """Token path below the root of every node, e.g. ``(t1, t2)`` for a depth-2 node."""
        out: list[Path] = []
        for p, t in zip(self.parents.tolist(), self.tokens.tolist(), strict=True):
            out.append((out[p] if p >= 0 else ()) + (t,))
        return out

    def best_chain(self) -> list[int]:
        """Tokens of the path that always follows the highest-logprob child (for tests, greedy)."""
        chain: list[int] = []
        parent = -1
        while True:
            kids = np.flatnonzero(self.parents == parent)
            if kids.size == 0:
                return chain
            best = int(kids[np.argmax(self.logprobs[kids])])
            chain.append(int(self.tokens[best]))
            parent = best


def check_request(budget: int, max_depth: int) -> None:
    """Reject nonsense budgets early, with a message that says which argument is wrong."""
    if not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"budget must be an integer >= 0, got {budget!r}")
    if not isinstance(max_depth, (int, np.integer)) or max_depth < 0:
        raise ValueError(f"max_depth must be an integer >= 0, got {max_depth!r}")


class StepLedger:
    """Token paths (below the root) already proposed in the current step.

    ``propose_under`` uses it to return only new nodes, plus the already-proposed nodes needed to
    connect them to the requested node (those duplicates are merged by the C++ tree).
    """

    def __init__(self) -> None:
        self._paths: set[Path] = set()

    def clear(self) -> None:
        self._paths.clear()

    def __contains__(self, path: Path) -> bool:
        return path in self._paths

    def __len__(self) -> int:
        return len(self._paths)

    def add_tree(self, tree: DraftTree, under: Path = ()) -> None:
        """Record every node of ``tree`` whose root is the node at ``under``."""
        for p in tree.paths():
            self._paths.add(under + p)
        # The nodes on the way to `under` exist too (they connect the subtree to the root).
        for k in range(1, len(under) + 1):
            self._paths.add(under[:k])


class Drafter(abc.ABC):
    """Proposes trees of candidate tokens for the target model to verify in one lap.

    Call order: ``begin`` once per generation, then steps of ``propose`` (and any number of
    ``propose_under`` while the ring is busy) closed by one ``accept``. Drafters are not
    thread-safe: an engine that expands from another thread must serialise the calls.
    """

    def __init__(self) -> None:
        self._ledger = StepLedger()  # nodes proposed (by anyone) in the current step

    # Start a generation: forget the previous one and index/prefill the prompt.
    @abc.abstractmethod
    def begin(self, prompt_tokens: Sequence[int]) -> None: ...

    # Draft up to `budget` nodes, at most `max_depth` deep, under `root` (the last accepted token).
    @abc.abstractmethod
    def propose(self, root: int, budget: int, max_depth: int) -> DraftTree: ...

    # FlowSpec expansion: up to `budget` *new* nodes under the node at `path` (tokens below root).
    @abc.abstractmethod
    def propose_under(self, path: Sequence[int], budget: int, max_depth: int) -> DraftTree: ...

    # The target accepted these tokens (accepted tree path, then the bonus token); end the step.
    @abc.abstractmethod
    def accept(self, accepted_tokens: Sequence[int]) -> None: ...

    # The generation ended (the next call is `begin`): set aside what an idle drafter holds.
    def idle(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Nothing by default; a draft model on a context shared with other slots parks its
        committed text's cells (``DraftModelDrafter.idle``)."""

    # Release what the drafter holds (a draft model's context); it cannot be used afterwards.
    def close(self) -> None:  # noqa: B027 - an optional hook, not abstract
        """Free resources; the default drafter holds none."""

    # Tell the drafter that these nodes (rooted at `under`) are already in this step's tree.
    def note_proposed(self, tree: DraftTree, under: Sequence[int] = ()) -> None:
        """Record nodes proposed by someone else (e.g. the hybrid's other drafter) this step.

        ``propose_under`` will not propose them again. Call after ``propose`` opened the step.
        """
        self._ledger.add_tree(tree, tuple(int(t) for t in under))

    @property
    @abc.abstractmethod
    def history(self) -> Sequence[int]:
        """Prompt plus accepted tokens; the last one is the root of the next tree."""

    def _check_root(self, root: int) -> None:
        """The root must be the last accepted token, or drafter and engine disagree on the text."""
        hist = self.history
        if not hist:
            raise RuntimeError("propose() called before begin(): the drafter has no history")
        if int(root) != int(hist[-1]):
            raise ValueError(
                f"root token {root} is not the last accepted token {hist[-1]}: call accept() "
                "with every accepted token (path + bonus) before proposing under the new root"
            )


def select_new(
    candidates: Iterable[tuple[Path, int, float]],
    under: Path,
    ledger: StepLedger,
    budget: int,
) -> DraftTree:
    """Keep up to ``budget`` new nodes of a candidate tree, plus the known ancestors they need.

    ``candidates`` are ``(path_below_under, token, logprob)`` rows in best-first order (a parent
    always before its children). A candidate already in ``ledger`` costs no budget; it is emitted
    only when a new node below it is emitted, so that the returned tree stays connected.
    """
    chosen: set[Path] = set()
    rank: dict[Path, tuple[int, float]] = {}
    n_new = 0
    for i, (path, _token, logprob) in enumerate(candidates):
        if n_new >= budget:
            break
        rank[path] = (i, logprob)
        if under + path in ledger:
            continue
        parent = path[:-1]
        if parent and parent not in chosen and under + parent not in ledger:
            continue  # parent was dropped (budget), so this node cannot be connected
        chosen.add(path)
        n_new += 1
    # Add the known ancestors of chosen nodes; candidate order is already parents-first.
    needed: set[Path] = set(chosen)
    for path in chosen:
        for k in range(1, len(path)):
            needed.add(path[:k])
    index: dict[Path, int] = {}
    rows: list[tuple[int, int, float]] = []
    for path in sorted(needed, key=lambda p: rank[p][0]):
        index[path] = len(rows)
        rows.append((index[path[:-1]] if len(path) > 1 else -1, path[-1], rank[path][1]))
    return DraftTree.from_nodes(rows)
