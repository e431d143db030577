"""The one KV-cache operation type (docs/design.md 1, "KvOp").

One numbering and one row layout ``(code, seq, p0, p1, arg)`` everywhere: the C++ core's plans
(``csrc/tree.hpp``), the wire's KV_OPS field and what a stage applies. p0/p1 = -1 mean "from the
start" / "to the end" as in llama.cpp's ``llama_memory_seq_*``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np

__all__ = ["KvOp", "KvOpCode"]


class KvOpCode(IntEnum):
    """KV cache operations, mirroring llama.cpp's llama_memory_seq_* calls."""

    RM = 1  # seq_rm(seq, p0, p1)
    CP = 2  # seq_cp(seq -> arg, p0, p1)
    KEEP = 3  # seq_keep(seq)
    ADD = 4  # seq_add(seq, p0, p1, delta=arg)
    # A slot between requests (docs/design.md 5.8): seq's cells copied into the stage's host
    # memory and freed, and put back (edgespec.llm.kv_park).
    PARK = 5  # park(seq)
    RESTORE = 6  # restore(seq)


class KvOp(NamedTuple):
    """One KV cache operation. ``arg`` is the destination seq for CP and the delta for ADD;
    p0/p1 = -1 mean "from the start" / "to the end" as in llama.cpp."""

    code: KvOpCode
    seq: int
    p0: int = -1
    p1: int = -1
    arg: int = 0

    @staticmethod
    def clear() -> list[KvOp]:
        """Empty the KV cache: forget every position of seq 0, then drop every other seq."""
        return [KvOp(KvOpCode.RM, 0, -1, -1), KvOp(KvOpCode.KEEP, 0)]

    @staticmethod
    def rows(ops: Any) -> list[KvOp]:
        """KvOps of an int32 ``[m, 5]`` array of the C++ core's plans (same layout, same codes;
        the wire validates what it receives, docs/design.md 5.1)."""
        return [KvOp(KvOpCode(c), s, p0, p1, a)
                for c, s, p0, p1, a in np.asarray(ops).reshape(-1, 5).tolist()]
