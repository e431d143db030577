"""One drafted tree while its segments are in flight (``TreeInFlight``), and the conversions between
the C++ core's types and the engine's (sampling settings, KV operations)."""

from __future__ import annotations

from dataclasses import dataclass, field

from edgespec.batch import Result, TargetScores
from edgespec.sampling import SamplerSettings
from edgespec.tree import core


@dataclass
class TreeInFlight:
    """State of one tree (lap id) while its segments are in flight."""

    lap: int
    tree: core.TokenTree
    verifier: core.Verification | None
    outstanding: set[int] = field(default_factory=set)  # segment ids not yet answered
    sent_rows: int = 0
    next_segment: int = 0
    t0: float = 0.0
    expansions: int = 0
    seg_rows: dict[int, tuple[int, int]] = field(default_factory=dict)
    streamed: int = 0  # accepted tokens already handed out before the step's decision
    verified_rows: int = 0  # rows [0, verified_rows) were fed to the verifier
    frontier: int = 0  # deepest accepted node so far (flow: expansion goes below it)
    frontier_tokens: list[int] = field(default_factory=list)  # accepted tokens down to it
    # Per row (tree node), where its target's log probabilities are, when the request asked
    # for them: (the result's ``TargetScores``, its row there). Read only for the rows on the
    # accepted path (``ScoreQueue.path``).
    scores: dict[int, tuple[TargetScores, int]] = field(default_factory=dict)

    def note(self, res: Result) -> None:
        """Keep where a result's log probabilities are, by row, if it has any."""
        if res.scores is not None:
            for i, node in enumerate(res.nodes.tolist()):
                self.scores[node] = (res.scores, i)


def sampling_config(s: SamplerSettings) -> core.SamplerConfig:
    """The verifier's settings: it walks targets the last stage drew (``feed_targets``), so
    only greedy or not and the seed matter to it."""
    return core.SamplerConfig(temperature=s.temperature, seed=s.seed)
