"""The records every stage reads and writes, defined once, and their JSONL files.

Records are pydantic models so a malformed line is an error that names the file, the line and
the sample id instead of a KeyError three stages later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

FinishReason = Literal["stop", "length", "error"]


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sample(Record):
    """One conversation from a dataset, normalised to OpenAI-style messages."""

    sample_id: str
    source: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


# Sample ids of the later turns of a conversation regenerated turn by turn: `<id>#turn<k>`.
TURN_SEPARATOR = "#turn"


def conversation_id(sample_id: str) -> str:
    """The conversation a (turn) record belongs to."""
    return sample_id.split(TURN_SEPARATOR, 1)[0]


class Prompt(Record):
    """The chat-templated prompt the target answers: everything before the regenerated turn."""

    sample_id: str
    source: str
    prompt_ids: list[int]
    prompt_text: str
    # The conversation the prompt renders, for engines that take messages (openai).
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # tokenize.regenerate="all": the dataset's user/tool messages after each later assistant
    # turn, one list per turn still to regenerate (see eaglet/turns.py).
    followups: list[list[dict[str, Any]]] = []


class Generation(Record):
    """What the target produced for one prompt, token-exact where the engine allows."""

    sample_id: str
    source: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    engine: str
    token_exact: bool = True
    raw: dict[str, Any] = {}

    @classmethod
    def answering(
        cls,
        prompt: Prompt,
        output_ids: list[int],
        finish_reason: FinishReason,
        engine: str,
        token_exact: bool = True,
        raw: dict[str, Any] | None = None,
    ) -> Generation:
        """The record of `prompt` answered with `output_ids`."""
        return cls(
            sample_id=prompt.sample_id,
            source=prompt.source,
            prompt_ids=prompt.prompt_ids,
            output_ids=output_ids,
            finish_reason=finish_reason,
            engine=engine,
            token_exact=token_exact,
            raw=raw or {},
        )


class Example(Record):
    """One training sequence: the prompt and the target's own answer, split and masked."""

    sample_id: str
    source: str
    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]] = []
    input_ids: list[int]
    loss_mask: list[int]
    finish_reason: FinishReason
    flags: list[str] = []


R = TypeVar("R", bound=Record)


class RecordFileError(ValueError):
    """A record file line that cannot be read; the message names the file and the line."""


def read_jsonl(path: Path, model: type[R]) -> Iterator[R]:
    """Yield records from a JSONL file, failing with file:line and sample id on a bad line."""
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecordFileError(f"{path}:{line_number}: not valid JSON ({exc.msg})") from None
            try:
                yield model.model_validate(data)
            except ValidationError as exc:
                sample_id = data.get("sample_id", "?") if isinstance(data, dict) else "?"
                raise RecordFileError(
                    f"{path}:{line_number}: sample {sample_id} is not a valid "
                    f"{model.__name__} record: {exc.errors()[0]['msg']} at "
                    f"{'.'.join(str(p) for p in exc.errors()[0]['loc'])}"
                ) from None


def record_line(record: Record) -> str:
    return record.model_dump_json() + "\n"


def write_jsonl(path: Path, records: Iterable[Record]) -> int:
    """Write records to `path` (replacing it) and return how many were written."""
    count = 0
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(record_line(record))
            count += 1
        handle.flush()
        os.fsync(handle.fileno())
    return count


def count_lines(path: Path) -> int:
    with open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def repair_and_read_ids(path: Path) -> set[str]:
    """Ids already written to an append-only JSONL file; a torn last line is cut off.

    A process killed mid-write leaves at most one partial line at the end. It is removed so
    the next append starts on a clean line, and its sample is generated again.
    """
    if not path.exists():
        return set()
    ids: set[str] = set()
    good_bytes = 0
    with open(path, "rb") as handle:
        for line in handle:
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("torn line")
                ids.add(json.loads(line)["sample_id"])
            except (ValueError, KeyError):
                break
            good_bytes += len(line)
    if good_bytes != path.stat().st_size:
        with open(path, "r+b") as handle:
            handle.truncate(good_bytes)
    return ids
