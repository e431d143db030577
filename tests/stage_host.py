"""``StageHost``: several windows of one model in one process, test scaffolding for the
piped-ring tests (``pipeline_fixtures``) and the stage tests. Nodes host their windows as
stage slots (``edgespec.node.datapath``), not through this class.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from edgespec.llm.gguf_read import ShardError, read_info
from edgespec.node.runtime import FingerprintMismatchError, StageRuntime


class StageHost:
    """Several windows of one model in one process: prima.cpp's piped ring, where a lap visits
    each device k times and a device holds k windows (docs/design.md 1: window / round).

    Each window is its own :class:`StageRuntime` (own context and KV cache). All windows must come
    from one model (same fingerprint) and must not overlap; :meth:`add_window` checks before
    loading and leaves the host unchanged when it refuses.
    """

    def __init__(self, sources: Iterable[Any] = (), **runtime_kwargs: Any) -> None:
        self.runtime_kwargs = dict(runtime_kwargs)
        self._windows: dict[int, StageRuntime] = {}
        try:
            for s in sources:
                self.add_window(s)
        except BaseException:
            self.close()
            raise

    @property
    def fingerprint(self) -> str | None:
        for rt in self._windows.values():
            return rt.fingerprint
        return None

    @property
    def windows(self) -> list[StageRuntime]:
        """Hosted runtimes in layer order."""
        return [self._windows[a] for a in sorted(self._windows)]

    def add_window(self, source: Any, **overrides: Any) -> StageRuntime:
        """Load one more window; refuses another model's shard or an overlapping range."""
        kwargs = {**self.runtime_kwargs, **overrides}
        fp = self.fingerprint
        if fp is not None:
            kwargs.setdefault("expect_fingerprint", fp)
        if not isinstance(source, tuple):
            info = read_info(source)
            if fp is not None and info.fingerprint != fp:
                raise FingerprintMismatchError(
                    f"{source} belongs to model {info.fingerprint}; this host runs {fp}")
            self._check_overlap(info.layer_range)
        rt = StageRuntime(source, **kwargs)
        try:
            self._check_overlap(rt.layer_range)
        except BaseException:
            rt.close()
            raise
        self._windows[rt.layer_range[0]] = rt
        return rt

    def _check_overlap(self, rng: tuple[int, int]) -> None:
        for a, rt in self._windows.items():
            b = rt.layer_range[1]
            if rng[0] < b and a < rng[1]:
                raise ShardError(f"window {rng[0]}:{rng[1]} overlaps hosted window {a}:{b}")

    def window(self, layer_start: int) -> StageRuntime:
        """The hosted window starting at ``layer_start``."""
        try:
            return self._windows[int(layer_start)]
        except KeyError:
            raise KeyError(f"no hosted window starts at layer {layer_start} "
                           f"(hosted: {[rt.layer_range for rt in self.windows]})") from None

    def remove_window(self, layer_start: int) -> None:
        self._windows.pop(int(layer_start)).close()

    def close(self) -> None:
        for rt in self._windows.values():
            rt.close()
        self._windows.clear()

    def __enter__(self) -> StageHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
