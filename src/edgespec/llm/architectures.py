"""Architectures: how llama.cpp's layer-indexed traps are handled when a model is cut into windows.

Every place where llama.cpp reads something that depends on a layer's absolute index or on the
number of layers in the file (sliding-window periods, leading dense blocks, size-dependent
constants, required heads). A window renumbers its blocks from 0 and has fewer of them, so each
such trap either gets rewritten metadata or is refused (docs/design.md 3.1). Architectures outside
the table are refused by name (:data:`REFUSED_ARCHITECTURES` says why for those known not to work).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import gguf

from edgespec.llm.gguf_read import CorruptShardError, GGUFHeader, ShardError, window_role
from edgespec.llm.gguf_write import kv_bool_array, kv_u32


class UnsupportedArchitectureError(ShardError):
    """The architecture has not been tested with layer-window sharding yet."""



@dataclass(frozen=True)
class ArchHandling:
    """How windows of one llama.cpp architecture are cut.

    Attributes:
        swa_period: llama.cpp's default sliding-window period (a layer ``il`` slides when
            ``il % period < period - 1``, or the reverse with ``swa_dense_first``); windows get
            the explicit per-layer ``attention.sliding_window_pattern`` of their absolute layers,
            because the period restarts at the window's layer 0. None: no sliding window.
        swa_if_window_key: sliding layers exist only when ``attention.sliding_window`` > 0.
        dense_lead: ``leading_dense_block_count`` counts the window's own leading dense blocks.
        head_required: llama.cpp insists on ``output.weight`` in every file (no tied fallback).
        restore_input: the graph tensor that rescales *every* input, hidden states included
            (gemma2's ``inp_scaled``); a window after the first overwrites it with the states it
            was given (see :class:`edgespec.node.runtime.StageRuntime`), so they enter unscaled.
        traps: every layer-indexed trap of the architecture and how windows handle it (what
            was checked against llama.cpp; the README's table says the same).
    """

    name: str
    traps: tuple[str, ...]
    swa_period: int | None = None
    swa_dense_first: bool = False
    swa_if_window_key: bool = False
    dense_lead: bool = False
    head_required: bool = False
    restore_input: str | None = None


_COMMON = ("per-layer metadata arrays sliced to the window", "tied or untied head kept on the last window only",
           "stub vocabulary on middle windows")

ARCHITECTURES: dict[str, ArchHandling] = {a.name: a for a in (
    ArchHandling("llama", _COMMON + ("global rope_freqs.weight kept in every window",
                                     "Mixtral-style routed experts (ffn_*_exps) stay in their block")),
    ArchHandling("qwen2", _COMMON + ("q/k/v biases",)),
    ArchHandling("qwen3", _COMMON + ("per-head q/k norms",)),
    ArchHandling("qwen3moe", _COMMON + ("per-head q/k norms", "routed experts stay in their block")),
    ArchHandling("gemma2", _COMMON + (
        "sliding window on every other absolute layer: explicit per-layer pattern",
        "llama.cpp scales every input by sqrt(n_embd), hidden states too: later windows overwrite "
        "inp_scaled with the states they were given",
        "attention soft-capping per layer, final soft-capping on the last window",
        "27B attention scale chosen from n_layer == 46: such models are refused"), swa_period=2,
        restore_input="inp_scaled"),
    ArchHandling("gemma3", _COMMON + (
        "sliding window on 5 of every 6 absolute layers, with its own RoPE base: explicit pattern",
        "token embeddings scaled by sqrt(n_embd) for token input only (first window)",
        "27B attention scale chosen from n_layer == 62: such models are refused"),
        swa_period=6, swa_if_window_key=True),
    ArchHandling("phi3", _COMMON + (
        "fused qkv and gate/up", "global rope_factors_long/short kept",
        "long or short RoPE factors chosen from the context size: the same in every window, as "
        "every window of a ring gets the ring's n_ctx",
        "llama.cpp ignores phi3's sliding window: nothing to rewrite")),
    ArchHandling("deepseek2", _COMMON + (
        "multi-head latent attention (per-block tensors only)",
        "leading_dense_block_count rewritten per window",
        "routed + shared experts stay in their block",
        "'lite' (no q_lora_rank) inferred from n_layer 26/27: q_lora_rank pinned, windows of those "
        "sizes refused for non-lite models",
        "expert gating default inferred from n_layer: pinned in every window"), dense_lead=True),
    ArchHandling("gpt-oss", _COMMON + (
        "sliding window on every other absolute layer: explicit per-layer pattern",
        "attention sinks and expert biases (per-block)",
        "output.weight required in every file: middle windows get a 1-row stub, the first keeps it"),
        swa_period=2, head_required=True),
)}

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

# Architectures llama.cpp loads but whose windows cannot be made exact, and why.
_RECURRENT = ("its recurrent state layers cannot drop a rejected draft by position, which tree "
              "verification needs")
REFUSED_ARCHITECTURES: dict[str, str] = {
    "gemma3n": "every layer also reads per-layer embeddings of the token ids, which a window after "
               "the first never sees",
    "glm4moe": "llama.cpp aborts the process when a glm4moe file without M-RoPE sections is given "
               "hidden states instead of token ids, and every window after the first is",
    **{a: _RECURRENT for a in ("mamba", "mamba2", "rwkv6", "rwkv7", "qwen3next", "jamba",
                               "falcon-h1", "lfm2", "granitehybrid", "nemotron_h")},
}


def arch_handling(arch: str) -> ArchHandling:
    """The table entry of ``arch``, or a one-line refusal naming it."""
    if arch in REFUSED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} cannot be split into layer windows: {REFUSED_ARCHITECTURES[arch]}; "
            "run it unsplit on one machine")
    handling = ARCHITECTURES.get(arch)
    if handling is None:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} cannot be split into layer windows yet: how llama.cpp indexes its "
            f"layers has not been checked (supported: {', '.join(SUPPORTED_ARCHITECTURES)}); "
            "run it unsplit on one machine, or ask for support with the model's name")
    return handling


def _swa_layers(h: GGUFHeader, arch: str, handling: ArchHandling) -> list[bool] | None:
    """Which absolute layers of the full model slide (None: the model has no sliding window)."""
    n_total = h.get(f"{arch}.block_count")
    kv = h.kv.get(f"{arch}.attention.sliding_window_pattern")
    if kv is not None and kv.vtype == gguf.GGUFValueType.ARRAY:
        return None  # an explicit per-layer array: sliced like every per-layer array
    if handling.swa_period is None:
        return None
    if handling.swa_if_window_key and not (h.get(f"{arch}.attention.sliding_window") or 0) > 0:
        return None
    period = handling.swa_period
    if kv is not None and isinstance(kv.value, int):
        period = kv.value
    if period == 0:
        return [True] * n_total
    if handling.swa_dense_first:
        return [il % period != 0 for il in range(n_total)]
    return [il % period < period - 1 for il in range(n_total)]


# Layer counts from which llama.cpp infers a model size that changes a constant: gemma's 27B
# attention scale; deepseek2's "lite" variants (no query low-rank projection).
_SIZE_TRAPS = {"gemma2": (46,), "gemma3": (62,)}
_DEEPSEEK2_LITE_LAYERS = (26, 27)


def _deepseek2_is_lite(n_layer: int, n_vocab: int) -> bool:
    return n_layer in _DEEPSEEK2_LITE_LAYERS or (n_layer == 48 and n_vocab == 128256)


def check_windows(h: GGUFHeader, arch: str, ranges: Sequence[tuple[int, int]], n_layer: int,
                   n_vocab: int) -> None:
    """Refuse windows whose layer count would make llama.cpp pick other constants."""
    if arch in _SIZE_TRAPS:
        n_embd = h.get(f"{arch}.embedding_length")
        n_head = h.get(f"{arch}.attention.head_count")
        n_head = n_head[0] if isinstance(n_head, list) and n_head else n_head
        if not isinstance(n_embd, int) or not isinstance(n_head, int) or n_head <= 0:
            raise CorruptShardError(f"{h.path} lacks {arch}.embedding_length / attention.head_count")
        head_dim = h.get(f"{arch}.attention.key_length") or n_embd // n_head
        scale_differs = n_embd // n_head != int(head_dim)
        for a, b in ranges:
            sizes = {n_layer, b - a}
            if (a, b) != (0, n_layer) and scale_differs and sizes & set(_SIZE_TRAPS[arch]):
                raise ShardError(
                    f"{arch}: llama.cpp picks the attention scale of a {n_layer}-layer model from its "
                    f"layer count, so window {a}:{b} would compute other attention; run this model "
                    "unsplit")
    if arch == "deepseek2" and not _deepseek2_is_lite(n_layer, n_vocab):
        for a, b in ranges:
            role = window_role(a, b, n_layer)
            if (a, b) != (0, n_layer) and _deepseek2_is_lite(b - a, 1 if role == "middle" else n_vocab):
                raise ShardError(
                    f"deepseek2: llama.cpp treats a {b - a}-layer file as a 'lite' model (no query "
                    f"low-rank projection), so window {a}:{b} would not load; choose other ranges")


def arch_metadata(h: GGUFHeader, arch: str, n_layer: int, n_vocab: int, a: int, b: int,
                   dropped: set[str]) -> list[bytes]:
    """Rewritten or pinned metadata of window ``[a, b)``; ``dropped`` receives the source keys
    they replace."""
    handling = ARCHITECTURES[arch]
    out: list[bytes] = []
    swa = _swa_layers(h, arch, handling)
    if swa is not None:
        key = f"{arch}.attention.sliding_window_pattern"
        dropped.add(key)
        out.append(kv_bool_array(key, swa[a:b]))
    if handling.dense_lead:
        key = f"{arch}.leading_dense_block_count"
        lead = h.get(key)
        if isinstance(lead, int):
            dropped.add(key)
            out.append(kv_u32(key, max(0, min(lead, b) - a)))
    if arch == "deepseek2":
        if h.get(f"{arch}.attention.q_lora_rank") is None:
            # Absent means "lite" only while the layer count says so: pin it for every window.
            out.append(kv_u32(f"{arch}.attention.q_lora_rank", 0))
        if h.get(f"{arch}.expert_gating_func") is None:
            sigmoid = n_layer in (47, 48) and n_vocab == 154880
            out.append(kv_u32(f"{arch}.expert_gating_func", 2 if sigmoid else 1))
    return out
