"""The draft-model drafter across families: any draft sharing the target's tokenizer works (also
when one of the two pads its vocabulary with unused tokens), drafting changes no output, and a
draft with another tokenizer is refused in one line naming both models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tinygguf import make_tiny_gguf, min_vocab

from edgespec.api import Ring
from edgespec.drafters import DraftModelDrafter, TokenizerMismatchError
from edgespec.drafters.tokenizer import check_draft_tokenizer

PROMPT = [(i * 29 + 5) % 250 + 3 for i in range(20)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("draft-pairs")
    n = min_vocab("qwen3") + 32
    return {
        # Qwen3-8B / Qwen3-0.6B style: one tokenizer, a dense draft for an expert target.
        "qwen3moe": make_tiny_gguf(base / "qwen3moe.gguf", arch="qwen3moe", n_layer=4, seed=1, n_vocab=n),
        "qwen3": make_tiny_gguf(base / "qwen3.gguf", arch="qwen3", n_layer=2, seed=2, n_vocab=n),
        # The same tokenizer padded with 64 unused tokens (a bigger checkpoint's vocabulary).
        "qwen3-padded": make_tiny_gguf(base / "qwen3-padded.gguf", arch="qwen3", n_layer=2, seed=2,
                                       n_vocab=n + 64, n_pad=64),
        "gemma3": make_tiny_gguf(base / "gemma3.gguf", arch="gemma3", n_layer=2, seed=3),
    }


def test_same_tokenizer_across_families_and_padding(tiny) -> None:
    check_draft_tokenizer(tiny["qwen3"], tiny["qwen3moe"])
    check_draft_tokenizer(tiny["qwen3-padded"], tiny["qwen3moe"])
    check_draft_tokenizer(tiny["qwen3"], tiny["qwen3-padded"])


def test_other_tokenizer_refused_naming_both(tiny) -> None:
    with pytest.raises(TokenizerMismatchError, match="gemma3.gguf has a different tokenizer than qwen3moe.gguf"):
        DraftModelDrafter(tiny["gemma3"], tiny["qwen3moe"], n_ctx=256)


def test_refusal_is_one_line_on_the_command_line(tiny, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "edgespec", "chat", "--model", str(tiny["qwen3moe"]), "--local", "2",
         "--draft", str(tiny["gemma3"]), "--draft-quant", "none"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("edgespec:")]
    assert len(errors) == 1 and "different tokenizer" in errors[0] and "gemma3.gguf" in errors[0]


@pytest.mark.parametrize("draft", ["qwen3", "qwen3-padded"])
def test_drafting_changes_no_output(tiny, draft: str) -> None:
    """A padded draft would propose padding ids the target does not have: proposals stay in the
    shared vocabulary, and speculative decoding gives plain decoding's tokens."""
    with Ring.local(tiny["qwen3moe"], stages=2, processes=False, draft=tiny[draft], draft_quant="none",
                    n_ctx=512, budget=12, segments=2) as ring:
        want = ring.generate(PROMPT, max_tokens=24, spec="none").tokens
        for mode in ("sync", "flow"):
            ring.reset()
            assert ring.generate(PROMPT, max_tokens=24, spec=mode).tokens == want, mode
