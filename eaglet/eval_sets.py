"""Named evaluation sets (`evaluate.sets`): the prompt sets users compare drafts on, read from a
local copy in each set's own format (or its hub id), into prompts of one or more user turns.

- `mt-bench`: rows `question_id`, `category`, `turns` (two); both turns are asked, the second
  after the target's own first answer; a local copy of FastChat's `question.jsonl`.
- `gsm8k`: `question` (and `answer`); hub `openai/gsm8k` (config `main`), split `test`.
- `math-500`: `problem`, category `subject`; hub `HuggingFaceH4/MATH-500`, split `test`.
- `humaneval`: `prompt` (and `task_id`); hub `openai/openai_humaneval`, split `test`.
- `speed-bench`: `category` and `turns` (or `prompt`); a local copy.
- `custom`: any row `download` reads (ShareGPT, OpenAI messages): its first user turn.

A row without its format's prompt field is an error naming the file, the line and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglet.config.evaluate import EvalSet
from eaglet.local_paths import is_hub_dataset

# name -> (hub id, hub config, split) where the set has a canonical hub copy
HUB = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "math-500": ("HuggingFaceH4/MATH-500", None, "test"),
    "humaneval": ("openai/openai_humaneval", None, "test"),
}
PROMPT_FIELD = {"gsm8k": "question", "math-500": "problem", "humaneval": "prompt"}
CATEGORY_FIELD = {"mt-bench": "category", "math-500": "subject", "speed-bench": "category"}


# A hard bound checked before any tokenizing: a prompt of more characters than this many per
# token of the target's context cannot fit it whatever the tokenizer (a 2 MB turn once kept a
# tokenizer busy for minutes before its length was known).
MAX_CHARS_PER_TOKEN = 64


class EvalSetError(ValueError):
    """A set file that is not in its format; the message names the file, line and field."""


@dataclass(frozen=True)
class EvalPrompt:
    prompt_id: str
    turns: list[str]  # user turns: the second (MT-Bench) is asked after the target's answer
    category: str | None = None
    tools: list[dict[str, Any]] | None = field(default=None, compare=False)


def _rows(spec: EvalSet) -> list[dict[str, Any]]:
    path = Path(spec.path)
    if not path.exists() and is_hub_dataset(spec.path):
        from datasets import load_dataset

        hub_id, subset, split = HUB.get(spec.name, (spec.path, None, "test"))
        return list(load_dataset(spec.path or hub_id, subset, split=split))
    if path.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise EvalSetError(f"{path}:{number}: not valid JSON ({exc})") from None
    return rows


def _turns(spec: EvalSet, row: dict[str, Any], where: str) -> list[str]:
    if spec.name in PROMPT_FIELD:
        name = PROMPT_FIELD[spec.name]
        if not isinstance(row.get(name), str):
            raise EvalSetError(f"{where}: no string {name!r}, which a {spec.name} row holds")
        return [row[name]]
    if spec.name in ("mt-bench", "speed-bench"):
        turns = row.get("turns")
        if turns is None and spec.name == "speed-bench" and isinstance(row.get("prompt"), str):
            return [row["prompt"]]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise EvalSetError(
                f"{where}: no 'turns' (a list of strings), which a {spec.name} row holds"
            )
        return list(turns)
    from eaglet.datasets import normalise_row

    messages, _ = normalise_row(row, where)
    turns = [m["content"] for m in messages if m["role"] == "user"]
    if not turns:
        raise EvalSetError(f"{where}: no user turn")
    return turns[:1]


def read_set(spec: EvalSet) -> list[EvalPrompt]:
    """The set's prompts in file order, at most `spec.limit`."""
    prompts = []
    for index, row in enumerate(_rows(spec)):
        where = f"{spec.path}:{index + 1}"
        category = row.get(CATEGORY_FIELD.get(spec.name, ""))
        prompt_id = row.get("question_id", row.get("task_id", row.get("id", index)))
        prompts.append(
            EvalPrompt(
                str(prompt_id), _turns(spec, row, where), str(category) if category else None
            )
        )
        if spec.limit is not None and len(prompts) >= spec.limit:
            break
    return prompts


def too_long_to_tokenize(prompt: EvalPrompt, context: int | None) -> str | None:
    """Why `prompt` is over the target's context without tokenizing it (`MAX_CHARS_PER_TOKEN`
    characters per token at most), or None."""
    chars = sum(len(turn) for turn in prompt.turns)
    if context is not None and chars > context * MAX_CHARS_PER_TOKEN:
        return (
            f"{chars:,} characters, over {MAX_CHARS_PER_TOKEN} per token of the "
            f"{context}-token context"
        )
    return None
