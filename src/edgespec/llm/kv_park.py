"""Parking an idle slot's KV in host memory (docs/design.md 5.8, "idle slots' KV").

llama.cpp attends over the used span of a stage's unified KV cache, masking other sequences'
cells but still computing over them, so the cells an idle slot keeps for its conversation's
next turn slow every other slot's decodes (docs/experiments.md 8: 8-10% for a 1-row
decode beside 3 idle slots of 300 cells). Parking copies a sequence's cells out of llama.cpp
(``llama_state_seq_get_data``) and frees them; restoring copies them back
(``llama_state_seq_set_data``, which takes free cells wherever they are, contiguous or not:
``tests/test_kv_park.py`` checks it). Nothing is recomputed, so the next turn still computes
only its new tokens. The stages park a slot's cells (``edgespec.node.runtime``), and so does
the draft-model context the head's slots share (``edgespec.drafters.draft_context``).

Memory: at most one parked copy per sequence id, of cells that were live in the cache before,
so what a context holds parked never exceeds its KV cache's own size.
"""

from __future__ import annotations

import ctypes
from typing import Any

from edgespec.llm import capi


class KvParking:
    """Parked sequences of one llama.cpp context: seq id -> its cells in llama.cpp's own
    sequence-state format. The caller holds the context's lock."""

    def __init__(self) -> None:
        self._parked: dict[int, Any] = {}

    def nbytes(self) -> int:
        return sum(len(b) for b in self._parked.values())

    def clear(self) -> None:
        self._parked.clear()

    def forget(self, seq: int, p0: int, p1: int) -> None:
        """An RM of ``seq`` (-1: every sequence) over ``[p0, p1)`` reaches parked cells too: a
        whole sequence removed drops its parked copy (the ring's own operations never touch a
        parked sequence; a later head clearing the cache does)."""
        if p0 <= 0 and p1 < 0:
            if seq < 0:
                self._parked.clear()
            else:
                self._parked.pop(seq, None)

    def keep_only(self, seq: int) -> None:
        """``seq_keep(seq)``: every other sequence's parked copy goes too."""
        for s in [s for s in self._parked if s != seq]:
            del self._parked[s]

    def park(self, ctx: Any, mem: Any, seq: int) -> int:
        """Copy ``seq``'s cells out and free them; returns the bytes parked. An empty ``seq``
        parks nothing (0). When llama.cpp cannot copy them, ``seq`` stays live (0 too): only
        speed is lost."""
        self._parked.pop(seq, None)
        if capi.llama_memory_seq_pos_max(mem, seq) < 0:
            return 0
        n = int(capi.llama_state_seq_get_size(ctx, seq))
        buf = (ctypes.c_uint8 * n)()
        if n == 0 or capi.llama_state_seq_get_data(ctx, buf, n, seq) != n:
            return 0
        capi.llama_memory_seq_rm(mem, seq, -1, -1)
        self._parked[seq] = buf
        return n

    def restore(self, ctx: Any, mem: Any, seq: int) -> bool:
        """Put ``seq``'s parked cells back (what ``seq`` holds meanwhile is replaced). False
        when nothing is parked for it: it was empty, or parking failed and it stayed live.
        Raises ``MemoryError`` when the cache has no room for them; ``seq`` is then empty."""
        buf = self._parked.pop(seq, None)
        if buf is None:
            return False
        if capi.llama_state_seq_set_data(ctx, buf, len(buf), seq) != len(buf):
            capi.llama_memory_seq_rm(mem, seq, -1, -1)
            raise MemoryError(f"no room in the KV cache to restore the {len(buf)} bytes "
                              f"parked for sequence {seq}")
        return True
