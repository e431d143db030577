"""Mode ``none``: pipelined autoregressive decoding, one token per lap (the baseline)."""

from __future__ import annotations

from edgespec.head.engine.mode import Mode, Steps
from edgespec.sampling import SamplerSettings


class NoneMode(Mode):
    """Each step is one plain lap (``StepContext.plain_step``); the drafter is not used."""

    name = "none"
    summary = "plain pipelined decoding, one token per lap of the ring"
    needs_drafter = False

    def steps(self, root: int, sampling: SamplerSettings) -> Steps:
        while True:
            gained = yield from self.ctx.plain_step(root, sampling, tell_drafter=False)
            root = gained[-1]
            yield gained
