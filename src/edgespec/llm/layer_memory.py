"""What each layer of a GGUF model weighs in memory (:func:`model_memory`): the planner counts
windows with it (``edgespec.head.memory``), a node sizes what it offloads to a GPU with it
(``edgespec.node.offload``).

Per layer from the GGUF itself: a block's own tensors (so mixture-of-experts blocks, whose
experts are most of the model, weigh what they weigh, and leading dense blocks little), and the
KV cache each layer keeps per token: keys and values per KV head, or for multi-head latent
attention (deepseek2) one compressed latent plus its rope part and no separate values."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_KV_BYTES = 2  # f16 cache cells, llama.cpp's default type_k / type_v


@dataclass(frozen=True)
class ModelMemory:
    """Bytes a layer window of one model needs (see :func:`model_memory`)."""

    layer_weights: list[int]  # bytes of each block's tensors
    kv_per_token: list[int]  # KV cache bytes per layer per context cell
    embd_bytes: int  # token embeddings, held by the first and the last window
    head_bytes: int  # output norm and head (none with tied embeddings), held by the last window
    head_on_first: bool = False  # the architecture wants a head in every file (gpt-oss)
    n_vocab: int = 0  # the last window's logits buffer: n_vocab floats per sequence

    @property
    def n_layer(self) -> int:
        return len(self.layer_weights)

    def layer_bytes(self, i: int, n_ctx: int) -> int:
        """Weights plus KV cache of layer ``i`` at ``n_ctx`` cells."""
        return self.layer_weights[i] + self.kv_per_token[i] * n_ctx

    def head_layers(self) -> float:
        """The output head's decode work in layers: the bytes each row reads there (the
        embeddings when they are tied) over a layer's mean weights. Decoding a few rows on a
        device reads every weight once, so time follows bytes (docs/design.md 5.3)."""
        layers = sum(self.layer_weights) / max(1, len(self.layer_weights))
        return (self.head_bytes or self.embd_bytes) / max(1.0, layers)

    def window_bytes(self, a: int, b: int, n_ctx: int) -> int:
        """A window's weights, KV cache, and the embeddings / head when it holds the ends."""
        total = sum(self.layer_bytes(i, n_ctx) for i in range(a, b))
        first, last = a == 0, b == self.n_layer
        if first or last:
            total += self.embd_bytes
        if last or (first and self.head_on_first):
            total += self.head_bytes
        return total


def model_memory(path: str | Path) -> ModelMemory:
    """Per-layer memory of a full GGUF model, read from its tensor directory and metadata.

    The KV cache of a layer stores, per cell, ``key_length * n_head_kv`` key and
    ``value_length * n_head_kv`` value elements (per-layer head counts honoured); with
    multi-head latent attention (``attention.key_length_mla`` present) llama.cpp caches only
    the latent keys (``kv_lora_rank + rope dims``; values are a view of them). Sliding-window
    layers are counted at full size: edgespec's contexts keep llama.cpp's full-size SWA cache.
    """
    import re

    from edgespec.llm.architectures import ARCHITECTURES
    from edgespec.llm.gguf_read import open_gguf

    with open_gguf(path) as h:
        arch, n_layer, n_embd, n_vocab = h.dims()
        weights = [0] * n_layer
        embd = head = 0
        for t in h.tensors:
            m = re.match(r"^blk\.(\d+)\.", t.name)
            if m:
                i = int(m.group(1))
                if i < n_layer:
                    weights[i] += t.nbytes
            elif t.name == "token_embd.weight":
                embd = t.nbytes
            elif t.name.startswith("output"):
                head += t.nbytes

        def per_layer(key: str, default: int) -> list[int]:
            v = h.get(f"{arch}.{key}")
            if isinstance(v, list) and len(v) >= n_layer:
                return [int(x) for x in v[:n_layer]]
            return [int(v) if isinstance(v, int) else default] * n_layer

        n_head = per_layer("attention.head_count", 1)
        n_head_kv = per_layer("attention.head_count_kv", 0)
        n_head_kv = [kv or q for kv, q in zip(n_head_kv, n_head, strict=True)]
        if h.get(f"{arch}.attention.key_length_mla") is not None:
            rank = int(h.get(f"{arch}.attention.kv_lora_rank") or 0)
            rope = int(h.get(f"{arch}.rope.dimension_count") or 0)
            kv = [(rank + rope) * _KV_BYTES] * n_layer
        else:
            kv = []
            for i in range(n_layer):
                k_len = h.get(f"{arch}.attention.key_length") or n_embd // max(1, n_head[i])
                v_len = h.get(f"{arch}.attention.value_length") or k_len
                kv.append((int(k_len) + int(v_len)) * n_head_kv[i] * _KV_BYTES)
        handling = ARCHITECTURES.get(arch)
    return ModelMemory(weights, kv, embd, head, bool(handling and handling.head_required),
                       int(n_vocab))
