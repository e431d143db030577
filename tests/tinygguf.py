"""Tiny random-weight GGUF models that llama.cpp loads, for fast tests across the project.

    from tinygguf import make_tiny_gguf
    path = make_tiny_gguf(tmp_path / "tiny.gguf", arch="qwen2", n_layer=4, n_embd=64, seed=0)

* ``arch="qwen2"``: q/k/v biases, an untied ``output.weight`` head, a byte-level BPE ("gpt2")
  tokenizer with the qwen2 pre-tokenizer and ChatML specials/template.
* ``arch="llama"``: no biases, a tied head (no ``output.weight``), a global ``rope_freqs.weight``
  with non-trivial factors (so a shard that lost it gives different logits), and a SentencePiece
  ("llama") vocabulary of byte-fallback tokens plus single characters and a few pairs.

Newer families reuse one of the two tokenizers and add what makes them hard to cut into layer
windows (each trap below is exercised, so a shard that mishandles it gives different logits):

* ``qwen3``: per-head q/k RMS norms, tied head.      ``qwen3moe``: q/k norms, routed experts.
* ``gemma2``: token embeddings scaled by sqrt(n_embd), post-attention/post-FFN norms, attention
  and final logit soft-capping, sliding window on every other layer (period 2).
* ``gemma3``: q/k norms, post norms, sliding window on 5 of every 6 layers (period 6) with their
  own RoPE base.
* ``phi3``: fused qkv and gate/up projections, global ``rope_factors_long/short`` tensors.
* ``deepseek2``: multi-head latent attention (q/kv low-rank projections, split k_b/v_b),
  ``leading_dense`` dense blocks before routed + shared experts, sigmoid gating with a bias.
* ``gpt-oss``: attention sinks and biases, routed experts with biases, sliding window on every
  other layer.
* ``llama`` with ``n_expert``: Mixtral-style routed experts.

Every tokenizer covers every byte, so any text tokenizes. The vocabulary is small but at least
the 256 byte tokens plus specials (llama.cpp looks byte tokens up unconditionally); ``n_vocab``
pads it with merged pairs. Weights are float32, deterministic from ``seed``, and scaled so the
network is far from uniform: greedy decoding gives varied tokens, so equality tests mean something.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

__all__ = ["TINY_ARCHITECTURES", "TINY_CHAT_TEMPLATE", "make_tiny_gguf", "min_vocab"]

#: Architectures the generator writes, and their tokenizer ("gpt2" byte-level BPE or "llama" SPM).
TINY_ARCHITECTURES = {
    "qwen2": ("gpt2", "qwen2"), "llama": ("llama", None), "qwen3": ("gpt2", "qwen2"),
    "qwen3moe": ("gpt2", "qwen2"), "gemma2": ("llama", None), "gemma3": ("llama", None),
    "phi3": ("llama", None), "deepseek2": ("gpt2", "deepseek-v3"), "gpt-oss": ("gpt2", "gpt-4o"),
}

# ChatML, the format the real Qwen2.5 models use.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_GPT2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_SPM_SPECIALS = ["<unk>", "<s>", "</s>"]
# Pairs merged into extra tokens (common English/code bigrams), used in this order.
_PAIRS = [
    " t", "he", " a", "in", "er", "an", "on", " s", "re", "at", "en", "nd", " w", "or", "es", " o",
    "is", "it", " c", "ed", "ar", " f", " b", "ou", " p", "al", " m", "le", "ro", "te", "de", "st",
    "as", "se", "ic", "nt", "io", "()", "  ", "\n ", "= ", " =", "ef", "lf", "rn", "tu", "ur", "pr",
    "(s", "):", "fo", " i", "im", "po",
]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character map (what llama.cpp's BPE expects).
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _unique_pairs() -> list[str]:
    seen: list[str] = []
    for p in _PAIRS:
        if len(p) == 2 and p not in seen:
            seen.append(p)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    for a in letters:
        for b in letters:
            if a + b not in seen:
                seen.append(a + b)
    return seen


def min_vocab(arch: str) -> int:
    """Smallest ``n_vocab`` :func:`make_tiny_gguf` accepts for ``arch``."""
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"tiny models exist for {', '.join(TINY_ARCHITECTURES)}, not {arch!r}")
    if TINY_ARCHITECTURES[arch][0] == "gpt2":
        return 256 + len(_GPT2_SPECIALS)
    return len(_SPM_SPECIALS) + len(_spm_extra(arch)) + 256 + 1  # specials, byte tokens, "▁"


def _spm_extra(arch: str) -> tuple[str, ...]:
    # llama.cpp's phi3 vocabulary looks these up by text when it loads.
    return ("<|end|>", "<|endoftext|>") if arch == "phi3" else ()


def _gpt2_vocab(n_vocab: int, n_pad: int = 0) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [gguf.TokenType.NORMAL] * 256
    merges: list[str] = []
    n_merges = n_vocab - n_pad - 256 - len(_GPT2_SPECIALS)
    pairs = _unique_pairs()
    if n_merges > len(pairs):
        raise ValueError(f"n_vocab too large for the tiny tokenizer (max {256 + len(pairs) + 3})")
    for pair in pairs[:n_merges]:
        a, b = (b2u[c] for c in pair.encode("utf-8"))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(gguf.TokenType.NORMAL)
    ids = {}
    for s in _GPT2_SPECIALS:
        ids[s] = len(tokens)
        tokens.append(s)
        types.append(gguf.TokenType.CONTROL)
    for _ in range(n_pad):  # padding to a round size, as larger checkpoints of a family have
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(gguf.TokenType.UNUSED)
    return tokens, [int(t) for t in types], merges, ids


def _spm_vocab(n_vocab: int, extra_specials: tuple[str, ...] = ()) -> tuple[list[str], list[int], list[float]]:
    tokens = list(_SPM_SPECIALS)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
    for special in extra_specials:
        tokens.append(special)
        types.append(gguf.TokenType.CONTROL)
        scores.append(0.0)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    # Pieces: "▁" (SentencePiece's space), single characters, then pairs; higher score = merged first.
    pieces = ["\u2581"] + list("etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789")
    pieces += list(".,:;!?()[]{}=+-*/_'\"#<>")
    pieces += ["\u2581" + c for c in "tawsobcfpmidhelnr"] + [p for p in _unique_pairs() if " " not in p and "\n" not in p]
    budget = n_vocab - len(tokens)
    for i, piece in enumerate(pieces[:budget]):
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        scores.append(-float(i) if len(piece) > 1 else -1000.0 - i)
    if len(tokens) < n_vocab:
        raise ValueError(f"n_vocab too large for the tiny SPM tokenizer (max {len(tokens)})")
    return tokens, [int(t) for t in types], scores


def make_tiny_gguf(
    path: str | Path,
    arch: str = "qwen2",
    n_layer: int = 4,
    n_embd: int = 64,
    n_vocab: int | None = None,
    seed: int = 0,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int | None = None,
    context_length: int = 4096,
    n_expert: int = 0,
    sliding_window: int = 4,
    leading_dense: int = 1,
    q_lora_rank: int = 32,
    n_pad: int = 0,
    expert_gating: bool = True,
) -> Path:
    """Write a tiny random-weight model and return its path.

    Args:
        path: output file (parent directories are created).
        arch: one of :data:`TINY_ARCHITECTURES`.
        n_layer: transformer blocks (1..64).
        n_embd: hidden width, a multiple of ``2 * n_head``.
        n_vocab: vocabulary size; default ``min_vocab(arch) + 32``.
        seed: weights (and nothing else) depend on it.
        n_head / n_head_kv: attention heads (grouped-query when n_head_kv < n_head).
        n_ff: feed-forward width (default ``2 * n_embd``; per expert ``n_ff // 2``).
        n_expert: routed experts (qwen3moe, deepseek2 and gpt-oss default to 4; ``llama`` with
            ``n_expert > 0`` is Mixtral-style).
        sliding_window: window of the sliding-window layers (gemma2, gemma3, gpt-oss): small, so
            a test prompt longer than it tells windowed layers from global ones.
        leading_dense: deepseek2's dense blocks before the first MoE block.
        q_lora_rank: deepseek2's query low-rank width; 0 = a "lite" model (plain ``attn_q``).
        n_pad: byte-level BPE only: the last ``n_pad`` of ``n_vocab`` tokens are unused padding.
        expert_gating: deepseek2: write ``expert_gating_func`` (sigmoid); False leaves llama.cpp
            to infer it from the layer count and vocabulary, as older GGUFs do.
    """
    if arch not in TINY_ARCHITECTURES:
        raise ValueError(f"tiny models exist for {', '.join(TINY_ARCHITECTURES)}, not {arch!r}")
    if not 1 <= n_layer <= 64:
        raise ValueError(f"n_layer must be in 1..64, got {n_layer}")
    if n_head < 1 or n_head_kv < 1 or n_head % n_head_kv:
        raise ValueError(f"n_head ({n_head}) must be a positive multiple of n_head_kv ({n_head_kv})")
    if n_embd % (2 * n_head):
        raise ValueError(f"n_embd ({n_embd}) must be a multiple of 2 * n_head ({2 * n_head})")
    n_vocab = n_vocab if n_vocab is not None else min_vocab(arch) + 32
    if n_vocab < min_vocab(arch):
        raise ValueError(f"n_vocab must be >= {min_vocab(arch)} for {arch} (every byte needs a token)")
    n_ff = n_ff if n_ff is not None else 2 * n_embd
    if arch in ("qwen3moe", "deepseek2", "gpt-oss") and not n_expert:
        n_expert = 4
    if arch == "deepseek2":
        n_head_kv = 1  # latent attention caches one shared latent "head"
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"edgespec-tiny-{arch}-{n_layer}L-{n_embd}d-seed{seed}")
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim // 2 if arch == "deepseek2" else head_dim)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    if TINY_ARCHITECTURES[arch][0] == "gpt2":
        tokens, types, merges, ids = _gpt2_vocab(n_vocab, n_pad)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(TINY_ARCHITECTURES[arch][1])
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(ids["<|endoftext|>"])
        w.add_eos_token_id(ids["<|im_end|>"])
        w.add_pad_token_id(ids["<|endoftext|>"])
        w.add_add_bos_token(False)
    else:
        tokens, types, scores = _spm_vocab(n_vocab, _spm_extra(arch))
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
    w.add_chat_template(TINY_CHAT_TEMPLATE)

    # Scales: small embeddings and residual branches of gain 2, so each layer's update outweighs
    # the input token (with a tied head, the token's own embedding row would otherwise win and
    # greedy decoding repeats one token); q/k scaled up so attention is peaked and depends on the
    # context; a sharp head.
    s_in = 1.0 / np.sqrt(n_embd)
    gain = 2.0
    if arch in ("qwen2", "llama") and not n_expert:
        _classic_tensors(w, arch, normal, n_layer, n_embd, n_embd_kv, n_ff, n_vocab, head_dim, s_in, gain)
    else:
        _family_tensors(w, arch, normal, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                        n_head_kv=n_head_kv, n_ff=n_ff, n_vocab=n_vocab, n_expert=n_expert,
                        sliding_window=sliding_window, leading_dense=leading_dense,
                        q_lora_rank=q_lora_rank, expert_gating=expert_gating, s_in=s_in, gain=gain)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _classic_tensors(w: gguf.GGUFWriter, arch: str, normal, n_layer: int, n_embd: int, n_embd_kv: int,
                     n_ff: int, n_vocab: int, head_dim: int, s_in: float, gain: float) -> None:
    """qwen2 / dense llama, drawn in the same order as always (fixtures keep their weights)."""
    w.add_tensor("token_embd.weight", normal((n_vocab, n_embd), 0.15))
    if arch == "llama":
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 4.0, head_dim // 2, dtype=np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", (1.0 + normal((n_embd,), 0.1)))
        w.add_tensor(p + "attn_q.weight", normal((n_embd, n_embd), 2.0 * s_in))
        w.add_tensor(p + "attn_k.weight", normal((n_embd_kv, n_embd), 2.0 * s_in))
        w.add_tensor(p + "attn_v.weight", normal((n_embd_kv, n_embd), s_in))
        if arch == "qwen2":
            w.add_tensor(p + "attn_q.bias", normal((n_embd,), 0.1))
            w.add_tensor(p + "attn_k.bias", normal((n_embd_kv,), 0.1))
            w.add_tensor(p + "attn_v.bias", normal((n_embd_kv,), 0.1))
        w.add_tensor(p + "attn_output.weight", normal((n_embd, n_embd), gain * s_in))
        w.add_tensor(p + "ffn_norm.weight", (1.0 + normal((n_embd,), 0.1)))
        w.add_tensor(p + "ffn_gate.weight", normal((n_ff, n_embd), s_in))
        w.add_tensor(p + "ffn_up.weight", normal((n_ff, n_embd), s_in))
        w.add_tensor(p + "ffn_down.weight", normal((n_embd, n_ff), gain / np.sqrt(n_ff)))
    w.add_tensor("output_norm.weight", np.ones((n_embd,), dtype=np.float32))
    if arch == "qwen2":
        w.add_tensor("output.weight", normal((n_vocab, n_embd), 3.0 * s_in))


def _family_tensors(w: gguf.GGUFWriter, arch: str, normal, *, n_layer: int, n_embd: int, n_head: int,
                    n_head_kv: int, n_ff: int, n_vocab: int, n_expert: int, sliding_window: int,
                    leading_dense: int, q_lora_rank: int, expert_gating: bool, s_in: float,
                    gain: float) -> None:
    """Metadata and tensors of the newer families (shapes as llama.cpp creates them; numpy
    shapes are ggml's reversed)."""
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    n_ff_exp = max(8, n_ff // 2)
    n_used = min(2, n_expert)
    key = f"{arch}."

    def norm(shape: tuple[int, ...]) -> np.ndarray:
        return 1.0 + normal(shape, 0.1)

    if n_expert:
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_used)
        if arch != "llama":
            w.add_expert_feed_forward_length(n_ff_exp)
    if arch in ("qwen3", "qwen3moe", "gemma2", "gemma3", "gpt-oss"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3", "gpt-oss"):
        w.add_sliding_window(sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(20.0)
        w.add_final_logit_softcapping(10.0)
    if arch == "gemma3":
        w.add_float32(key + "rope.freq_base_swa", 1000.0)

    # deepseek2: multi-head latent attention sizes.
    kv_lora, qk_rope, qk_nope, v_head = 32, head_dim // 2, head_dim, head_dim
    if arch == "deepseek2":
        w.add_leading_dense_block_count(leading_dense)
        if q_lora_rank:
            w.add_q_lora_rank(q_lora_rank)
        w.add_kv_lora_rank(kv_lora)
        w.add_key_length(kv_lora + qk_rope)  # MLA: keys are the latent + the rope part
        w.add_value_length(kv_lora)
        w.add_key_length_mla(qk_nope + qk_rope)
        w.add_value_length_mla(v_head)
        w.add_expert_shared_count(1)
        w.add_expert_weights_scale(2.5)
        w.add_expert_weights_norm(True)
        if expert_gating:
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)

    tied = arch in ("qwen3", "gemma2", "gemma3")
    # gemma scales token embeddings by sqrt(n_embd): draw them that much smaller.
    emb_std = 0.15 / np.sqrt(n_embd) if arch in ("gemma2", "gemma3") else 0.15
    w.add_tensor("token_embd.weight", normal((n_vocab, n_embd), emb_std))
    if arch == "phi3":
        w.add_tensor("rope_factors_long.weight", np.linspace(1.0, 3.0, head_dim // 2, dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.linspace(1.0, 2.0, head_dim // 2, dtype=np.float32))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm((n_embd,)))
        # attention
        if arch == "phi3":
            w.add_tensor(p + "attn_qkv.weight", np.concatenate([
                normal((n_embd, n_embd), 2.0 * s_in), normal((n_embd_kv, n_embd), 2.0 * s_in),
                normal((n_embd_kv, n_embd), s_in)]))
            w.add_tensor(p + "attn_output.weight", normal((n_embd, n_embd), gain * s_in))
        elif arch == "deepseek2":
            q_out = n_head * (qk_nope + qk_rope)
            if q_lora_rank:
                w.add_tensor(p + "attn_q_a.weight", normal((q_lora_rank, n_embd), s_in))
                w.add_tensor(p + "attn_q_a_norm.weight", norm((q_lora_rank,)))
                w.add_tensor(p + "attn_q_b.weight", normal((q_out, q_lora_rank), 2.0 / np.sqrt(q_lora_rank)))
            else:
                w.add_tensor(p + "attn_q.weight", normal((q_out, n_embd), 2.0 * s_in))
            w.add_tensor(p + "attn_kv_a_mqa.weight", normal((kv_lora + qk_rope, n_embd), 2.0 * s_in))
            w.add_tensor(p + "attn_kv_a_norm.weight", norm((kv_lora,)))
            w.add_tensor(p + "attn_k_b.weight", normal((n_head, kv_lora, qk_nope), 1.0 / np.sqrt(qk_nope)))
            w.add_tensor(p + "attn_v_b.weight", normal((n_head, v_head, kv_lora), 1.0 / np.sqrt(kv_lora)))
            w.add_tensor(p + "attn_output.weight", normal((n_embd, n_head * v_head), gain * s_in))
        else:
            w.add_tensor(p + "attn_q.weight", normal((n_head * head_dim, n_embd), 2.0 * s_in))
            w.add_tensor(p + "attn_k.weight", normal((n_embd_kv, n_embd), 2.0 * s_in))
            w.add_tensor(p + "attn_v.weight", normal((n_embd_kv, n_embd), s_in))
            w.add_tensor(p + "attn_output.weight", normal((n_embd, n_head * head_dim), gain * s_in))
            if arch in ("qwen3", "qwen3moe", "gemma3"):
                w.add_tensor(p + "attn_q_norm.weight", norm((head_dim,)))
                w.add_tensor(p + "attn_k_norm.weight", norm((head_dim,)))
            if arch == "gpt-oss":
                w.add_tensor(p + "attn_q.bias", normal((n_head * head_dim,), 0.1))
                w.add_tensor(p + "attn_k.bias", normal((n_embd_kv,), 0.1))
                w.add_tensor(p + "attn_v.bias", normal((n_embd_kv,), 0.1))
                w.add_tensor(p + "attn_output.bias", normal((n_embd,), 0.1))
                w.add_tensor(p + "attn_sinks.weight", normal((n_head,), 1.0))
        if arch in ("gemma2", "gemma3", "gpt-oss"):
            w.add_tensor(p + "post_attention_norm.weight", norm((n_embd,)))
        if arch != "gpt-oss":
            w.add_tensor(p + "ffn_norm.weight", norm((n_embd,)))
        # feed-forward
        dense = arch in ("qwen3", "gemma2", "gemma3", "phi3") or (arch == "deepseek2" and i < leading_dense)
        if dense and arch == "phi3":
            w.add_tensor(p + "ffn_up.weight", np.concatenate([normal((n_ff, n_embd), s_in),
                                                              normal((n_ff, n_embd), s_in)]))
            w.add_tensor(p + "ffn_down.weight", normal((n_embd, n_ff), gain / np.sqrt(n_ff)))
        elif dense:
            w.add_tensor(p + "ffn_gate.weight", normal((n_ff, n_embd), s_in))
            w.add_tensor(p + "ffn_up.weight", normal((n_ff, n_embd), s_in))
            w.add_tensor(p + "ffn_down.weight", normal((n_embd, n_ff), gain / np.sqrt(n_ff)))
        else:
            ff = n_ff if arch == "llama" else n_ff_exp
            w.add_tensor(p + "ffn_gate_inp.weight", normal((n_expert, n_embd), 4.0 * s_in))
            w.add_tensor(p + "ffn_gate_exps.weight", normal((n_expert, ff, n_embd), s_in))
            w.add_tensor(p + "ffn_up_exps.weight", normal((n_expert, ff, n_embd), s_in))
            w.add_tensor(p + "ffn_down_exps.weight", normal((n_expert, n_embd, ff), gain / np.sqrt(ff)))
            if arch == "gpt-oss":
                w.add_tensor(p + "ffn_gate_inp.bias", normal((n_expert,), 0.1))
                w.add_tensor(p + "ffn_gate_exps.bias", normal((n_expert, ff), 0.1))
                w.add_tensor(p + "ffn_up_exps.bias", normal((n_expert, ff), 0.1))
                w.add_tensor(p + "ffn_down_exps.bias", normal((n_expert, n_embd), 0.1))
            if arch == "deepseek2":
                w.add_tensor(p + "exp_probs_b.bias", normal((n_expert,), 0.1))
                w.add_tensor(p + "ffn_gate_shexp.weight", normal((ff, n_embd), s_in))
                w.add_tensor(p + "ffn_up_shexp.weight", normal((ff, n_embd), s_in))
                w.add_tensor(p + "ffn_down_shexp.weight", normal((n_embd, ff), gain / np.sqrt(ff)))
        if arch in ("gemma2", "gemma3"):
            w.add_tensor(p + "post_ffw_norm.weight", norm((n_embd,)))
    w.add_tensor("output_norm.weight", np.ones((n_embd,), dtype=np.float32))
    if not tied:
        w.add_tensor("output.weight", normal((n_vocab, n_embd), 3.0 * s_in))


def make_bare_gguf(path: str | Path, arch: str) -> Path:
    """A GGUF that only names ``arch`` (two blocks, an embedding table, nothing else): enough
    for the shard code to read the architecture and refuse it."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
