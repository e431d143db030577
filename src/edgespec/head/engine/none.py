"""Mode ``none``: pipelined autoregressive decoding, one token per lap (the baseline)."""

from __future__ import annotations

from collections.abc import Iterator

from edgespec.head.engine.mode import Mode
from edgespec.sampling import SamplerSettings


class NoneMode(Mode):
    """Each step is one plain lap (``StepContext.plain_step``); the drafter is not used."""

    name = "none"
    summary = "plain pipelined decoding, one token per lap of the ring"
    needs_drafter = False

    def steps(self, root: int, sampling: SamplerSettings) -> Iterator[list[int]]:
        while True:
            gained = self.ctx.plain_step(root, sampling, tell_drafter=False)
            root = gained[-1]
            yield gained
