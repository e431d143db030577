"""The data that travels the ring: a ``Batch`` of rows into stage 0, the last stage's
``Result``, and the ``Sampling`` by which it picks target tokens. Neutral ground: the head
(``edgespec.head``), the wire (``edgespec.wire.frames``) and the nodes (``edgespec.node``) all
read these types, and none of them owns them (docs/design.md 7).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgespec.tree.kvop import KvOp


@dataclass(frozen=True)
class Sampling:
    """How the last stage picks the target token of a row. temperature 0 = greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def as_meta(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "seed": self.seed}

    @classmethod
    def from_meta(cls, meta: dict) -> Sampling:
        return cls(float(meta.get("temperature", 0.0)), int(meta.get("top_k", 0)),
                   float(meta.get("top_p", 1.0)), int(meta.get("seed", 0)))


@dataclass
class Batch:
    """One message into the ring: rows of tokens with positions and seq ids."""

    tokens: np.ndarray  # int32 [n]
    pos: np.ndarray  # int32 [n]
    seq_ids: list[list[int]]  # per row: the llama.cpp sequences the row belongs to
    nodes: np.ndarray  # int32 [n]: tree node per row (prefill rows: any unique ids)
    want: np.ndarray  # bool [n]: rows whose target token the head needs
    lap: int = 0
    segment: int = 0
    pre_ops: list[KvOp] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    # Lap-timing stamps of the stages it went through (edgespec.laps; rides in META).
    timing: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)
        self.pos = np.ascontiguousarray(self.pos, dtype=np.int32)
        self.nodes = np.ascontiguousarray(self.nodes, dtype=np.int32)
        self.want = np.ascontiguousarray(self.want, dtype=bool)
        n = len(self.tokens)
        if not (len(self.pos) == len(self.seq_ids) == len(self.nodes) == len(self.want) == n):
            raise ValueError("batch fields disagree on the number of rows")

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, keep: np.ndarray) -> Batch:
        """The same batch restricted to rows where ``keep`` is true (pruning in flight)."""
        idx = np.flatnonzero(keep)
        return Batch(self.tokens[idx], self.pos[idx], [self.seq_ids[i] for i in idx],
                     self.nodes[idx], self.want[idx], self.lap, self.segment, self.pre_ops,
                     self.sampling, self.timing)


@dataclass
class Result:
    """The last stage's answer to one batch."""

    lap: int
    segment: int
    nodes: np.ndarray  # int32 [k]: the wanted rows that survived pruning
    targets: np.ndarray  # int32 [k]: the target model's token at each of those nodes
    timing: list | None = None  # the stages' lap-timing stamps (edgespec.laps)
    received: float = 0.0  # when the head had it off the wire (edgespec.laps.now)
