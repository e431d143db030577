"""What one generation did: tokens, laps, acceptance, time (``GenerationStats``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from edgespec.laps import LapTimes


@dataclass
class GenerationStats:
    """What one generation cost and gained."""

    mode: str = "none"
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually computed (the rest came from KV reuse)
    tokens: int = 0
    laps: int = 0  # verification results consumed (segments in flow mode)
    steps: int = 0  # verification steps decided: a tree, or a plain lap (one token)
    accepted_hist: Counter = field(default_factory=Counter)  # tokens gained per step -> count
    draft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    rows_sent: int = 0
    rows_pruned: int = 0
    budget: int = 0
    segment: int = 0
    recoveries: int = 0  # ring rebuilds after a node loss during this generation
    plain_steps: int = 0  # steps with no tree (a plain lap, or the prefill's first token)
    plain_laps: int = 0  # of those, the ones that waited for a lap of their own
    probes: int = 0  # flow: trials of tree steps after drafting had stopped paying
    # Plain laps: time from handing the batch to the chain to its result. What is left of
    # decode_s (in mode none) is the head's own work per token: engine, API, caller.
    plain_wait_s: float = 0.0
    lap_timing: LapTimes = field(default_factory=LapTimes)  # docs/design.md 8.1
    # Time to first token: from the request's start (its wait for a slot included) to its
    # first token; None until one came. queue_ms: of that, the wait for a free slot.
    ttft_ms: float | None = None
    queue_ms: float = 0.0

    def merged(self, earlier: GenerationStats | None) -> GenerationStats:
        """These statistics with an earlier part of the same generation added in."""
        if earlier is None:
            return self
        out = GenerationStats(**{**self.__dict__, "accepted_hist": Counter(self.accepted_hist)})
        out.accepted_hist.update(earlier.accepted_hist)
        out.prompt_tokens = earlier.prompt_tokens
        if earlier.ttft_ms is not None:
            out.ttft_ms = earlier.ttft_ms
        out.queue_ms = earlier.queue_ms
        for name in ("prefill_tokens", "laps", "steps", "draft_s", "prefill_s", "decode_s",
                     "rows_sent", "rows_pruned", "recoveries", "plain_steps", "plain_laps",
                     "probes", "plain_wait_s"):
            setattr(out, name, getattr(out, name) + getattr(earlier, name))
        out.lap_timing = self.lap_timing.merged(earlier.lap_timing)
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean tokens gained per step (accepted draft tokens + the bonus token)."""
        n = sum(self.accepted_hist.values())
        return sum(k * v for k, v in self.accepted_hist.items()) / n if n else 0.0

    def as_dict(self) -> dict:
        return {
            "mode": self.mode, "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens, "tokens": self.tokens, "laps": self.laps,
            "steps": self.steps, "mean_accepted_per_step": round(self.mean_accepted, 3),
            "accepted_hist": dict(sorted(self.accepted_hist.items())),
            "draft_ms": round(self.draft_s * 1e3, 2), "prefill_ms": round(self.prefill_s * 1e3, 2),
            "decode_ms": round(self.decode_s * 1e3, 2),
            "tokens_per_s": round(self.tokens_per_s, 3), "rows_sent": self.rows_sent,
            "rows_pruned": self.rows_pruned, "budget": self.budget, "segment": self.segment,
            "recoveries": self.recoveries, "plain_steps": self.plain_steps,
            "probes": self.probes,
            "plain_lap_ms": round(self.plain_wait_s * 1e3 / self.plain_laps, 2)
            if self.plain_laps else None,
            "lap_timing": self.lap_timing.as_dict(),
            "ttft_ms": round(self.ttft_ms, 2) if self.ttft_ms is not None else None,
            "queue_ms": round(self.queue_ms, 2),
        }
