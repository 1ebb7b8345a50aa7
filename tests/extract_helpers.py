"""A Qwen3-thinking extraction case on Qwen3's real tokenizer (tests/real_tokenizers.py), shared
by the extraction and loop-guard tests: the prompt (ending with `<think>\\n`) and its end tokens,
generations of one fixed answer, and the extract stage's report on a set of them."""

from __future__ import annotations

from eaglet.extract import write_examples
from eaglet.reasoning import detect_format
from eaglet.records.generations import Generation
from eaglet.records.io import write_jsonl
from eaglet.records.prompts import Prompt
from tests.real_tokenizers import qwen3_tokenizer

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
# A Qwen3-thinking turn: the prompt ends with `<think>\n`, the model writes the rest.
OUTPUT = "Two plus two is four.\n</think>\n\nThe answer is 4.<|im_end|>"


def qwen3_thinking_setup():
    """(tokenizer, reasoning format, prompt, end ids) of the Qwen3-thinking case."""
    tokenizer = qwen3_tokenizer()
    reasoning_format = detect_format(tokenizer, "think_open_in_prompt")
    prompt_text = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=False
    )
    prompt_text += "<think>\n"
    prompt = Prompt(
        sample_id="s",
        source="chat",
        prompt_ids=tokenizer.encode(prompt_text, add_special_tokens=False),
        prompt_text=prompt_text,
        messages=QUESTION,
    )
    end_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    return tokenizer, reasoning_format, prompt, end_ids


def make_generation(
    prompt: Prompt, tokenizer, raw: dict, sample_id: str = "s", source: str = "chat"
):
    return Generation(
        sample_id=sample_id,
        source=source,
        prompt_ids=prompt.prompt_ids,
        output_ids=tokenizer.encode(OUTPUT, add_special_tokens=False),
        finish_reason="stop",
        engine="openai" if raw else "local",
        raw=raw,
    )


def gate_report(tmp_path, generations, prompt, reasoning_format, tokenizer, end_ids) -> dict:
    """The extract stage's report on `generations` of `prompt` (files in `tmp_path`)."""
    write_jsonl(tmp_path / "generations.jsonl", generations)
    write_jsonl(
        tmp_path / "prompts.jsonl",
        [prompt.model_copy(update={"sample_id": g.sample_id}) for g in generations],
    )
    return write_examples(
        tmp_path / "generations.jsonl",
        [tmp_path / "prompts.jsonl"],
        tmp_path,
        tokenizer,
        reasoning_format,
        end_ids,
        {},
    )


def generation_variants(prompt, tokenizer, n: int, **changes) -> list[Generation]:
    """`n` generations of OUTPUT (ids g0, g1, ...), each with `changes`."""
    return [
        make_generation(prompt, tokenizer, {}, sample_id=f"g{i}").model_copy(update=changes)
        for i in range(n)
    ]
