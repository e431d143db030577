"""What a layer window of a model holds in a node's memory, as the planner counts it against the
node's free memory (``window_need``, the ends' share ``ends_need``; measured against real
windows in docs/experiments.md 13). What each layer weighs is read from the GGUF by
:func:`edgespec.llm.layer_memory.model_memory`."""

from __future__ import annotations

from edgespec.llm.layer_memory import ModelMemory, model_memory

__all__ = ["ModelMemory", "model_memory", "WINDOW_OVERHEAD", "TREE_ROWS", "logits_bytes",
           "ends_need", "window_need"]

#: What a window takes beyond its weights and KV cache: llama.cpp's compute buffers as a
#: prefill touches them, the node's buffers for one batch. Measured on the 1.5B's middle window
#: of 9 layers at n_ctx 4096 (``bench/device_memory.py``: peak resident, anonymous and file
#: pages, after a 300-row prefill, a 64-row tree and 5 decodes, less the idle process's 44 MiB,
#: less weights and KV): 88 MiB. The node's idle process is used memory already when it
#: reports what is free. The windows with the real vocabulary hold more (``ends_need``).
WINDOW_OVERHEAD = 96 << 20

#: Logits rows of the last window's largest verification batch (a tree of the largest budget,
#: ``CostModel.BUDGETS``, and its root): written, so resident, once a tree is verified.
TREE_ROWS = 64


def logits_bytes(memory: ModelMemory, n_seq_max: int) -> int:
    """The logits buffer of a context with the model's vocabulary: llama.cpp reserves and
    clears ``n_vocab`` floats for ``n_seq_max`` outputs when the context is made (148 MiB for
    Qwen2.5's vocabulary at 256 sequences), also in a first window, which never computes
    logits; the node gives the pages back before its first decode
    (``Context.release_output_reserve``)."""
    return 4 * memory.n_vocab * n_seq_max


def ends_need(memory: ModelMemory, first: bool, last: bool, n_seq_max: int) -> int:
    """What a window holding an end of the model takes beyond its layers and
    ``WINDOW_OVERHEAD``. Model files are mapped and their pages released once loaded
    (``llamacpp.load_model``), so token embeddings cost only the rows a window reads, and a last
    window's unused embeddings nothing. Each end holds a head: the last one reads it every step
    (the embeddings' repacked copy when they are tied), the first one holds the repacked copy
    llama.cpp makes of the embeddings when its file has no head (or its own head, with
    ``head_on_first``). The logits buffer llama.cpp clears at creation is resident before any
    compute buffer is touched, so it counts beyond ``WINDOW_OVERHEAD`` only where it is bigger;
    the last window also writes the logits of a tree. Measured peaks of the 1.5B's first and
    last windows (10 and 9 layers, 256 sequences): 604 and 664 MiB against 633 and 688
    counted, the idle process's 44 MiB included."""
    if not (first or last):
        return 0
    if last:
        head = memory.head_bytes or memory.embd_bytes
    else:
        head = memory.head_bytes if memory.head_on_first else memory.embd_bytes
    need = head + max(0, logits_bytes(memory, n_seq_max) - WINDOW_OVERHEAD)
    if last:
        need += logits_bytes(memory, min(TREE_ROWS, n_seq_max))
    return need


def window_need(memory: ModelMemory, a: int, b: int, n_ctx: int, n_seq_max: int) -> int:
    """What a loaded window ``[a, b)`` takes, as the planner counts it against a node's free
    memory: weights, KV cache, llama.cpp's buffers, and what the ends hold (``ends_need``)."""
    layers = sum(memory.layer_bytes(i, n_ctx) for i in range(a, b))
    return (layers + WINDOW_OVERHEAD
            + ends_need(memory, a == 0, b == memory.n_layer, n_seq_max))
