"""Tiny random-weight GGUF models that llama.cpp loads, for fast tests across the project.

    from tinygguf import make_tiny_gguf
    path = make_tiny_gguf(tmp_path / "tiny.gguf", arch="qwen2", n_layer=4, n_embd=64, seed=0)

* ``arch="qwen2"``: q/k/v biases, an untied ``output.weight`` head, a byte-level BPE ("gpt2")
  tokenizer with the qwen2 pre-tokenizer and ChatML specials/template.
* ``arch="llama"``: no biases, a tied head (no ``output.weight``), a global ``rope_freqs.weight``
  with non-trivial factors (so a shard that lost it gives different logits), and a SentencePiece
  ("llama") vocabulary of byte-fallback tokens plus single characters and a few pairs.

Both tokenizers cover every byte, so any text tokenizes. The vocabulary is small but at least
the 256 byte tokens plus specials (llama.cpp looks byte tokens up unconditionally); ``n_vocab``
pads it with merged pairs. Weights are float32, deterministic from ``seed``, and scaled so the
network is far from uniform: greedy decoding gives varied tokens, so equality tests mean something.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

__all__ = ["TINY_CHAT_TEMPLATE", "make_tiny_gguf", "min_vocab"]

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
    if arch == "qwen2":
        return 256 + len(_GPT2_SPECIALS)
    if arch == "llama":
        return len(_SPM_SPECIALS) + 256 + 1  # specials, byte tokens, "▁"
    raise ValueError(f"tiny models exist for qwen2 and llama, not {arch!r}")


def _gpt2_vocab(n_vocab: int) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    types = [gguf.TokenType.NORMAL] * 256
    merges: list[str] = []
    n_merges = n_vocab - 256 - len(_GPT2_SPECIALS)
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
    return tokens, [int(t) for t in types], merges, ids


def _spm_vocab(n_vocab: int) -> tuple[list[str], list[int], list[float]]:
    tokens = list(_SPM_SPECIALS)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
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
) -> Path:
    """Write a tiny random-weight model and return its path.

    Args:
        path: output file (parent directories are created).
        arch: "qwen2" or "llama".
        n_layer: transformer blocks (1..64).
        n_embd: hidden width, a multiple of ``2 * n_head``.
        n_vocab: vocabulary size; default ``min_vocab(arch) + 32``.
        seed: weights (and nothing else) depend on it.
        n_head / n_head_kv: attention heads (grouped-query when n_head_kv < n_head).
        n_ff: feed-forward width (default ``2 * n_embd``).
    """
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"tiny models exist for qwen2 and llama, not {arch!r}")
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
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    if arch == "qwen2":
        tokens, types, merges, ids = _gpt2_vocab(n_vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(ids["<|endoftext|>"])
        w.add_eos_token_id(ids["<|im_end|>"])
        w.add_pad_token_id(ids["<|endoftext|>"])
        w.add_add_bos_token(False)
    else:
        tokens, types, scores = _spm_vocab(n_vocab)
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

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
