"""One partition of a llama.cpp context's sequences between the slots of a ring
(docs/design.md 5.8), used alike by the stages' contexts (the head's ``SlotChain``) and the
shared draft context (``DraftSeqs``): with ``parallel=S`` slot ``i`` owns the seq ids
``[i*W, (i+1)*W)``, ``W = n_seq // S`` (``n_seq``: what the ring's contexts hold); its local
id 0 is its committed text, the others its trees' sequences. Neutral ground: the head and the drafters read it."""

from __future__ import annotations

from dataclasses import dataclass

#: llama.cpp's limit on sequence ids per context, and what a stage's context holds unless
#: the plan chose fewer to fit in memory (``planner.SEQ_CHOICES``).
N_SEQ = 256


def slot_width(parallel: int, n_seq: int = N_SEQ) -> int:
    """Seq ids per slot (the committed one and its tree seqs) of a context holding ``n_seq``
    (a ring may hold fewer than ``N_SEQ`` where memory is short, ``planner.SEQ_CHOICES``);
    ValueError unless ``1 <= parallel <= n_seq // 2`` (a slot needs a tree sequence besides
    its own)."""
    if isinstance(parallel, bool) or not isinstance(parallel, int) \
            or not 1 <= parallel <= n_seq // 2:
        raise ValueError(f"parallel must be in 1..{n_seq // 2} on a ring of {n_seq} "
                         f"sequences, got {parallel}")
    return n_seq // parallel


@dataclass(frozen=True)
class SeqRange:
    """Slot ``index``'s seq ids: local id ``s`` is ``base + s``, ``0 <= s < width``."""

    index: int
    width: int

    @property
    def base(self) -> int:
        return self.index * self.width

    def check(self, seq: int) -> int:
        """``seq`` (local), or ValueError naming the slot when it is outside the range."""
        if not 0 <= seq < self.width:
            raise ValueError(f"slot {self.index}: seq {seq} outside its {self.width}")
        return seq
