"""JSONL record files: the record base class, reading with file:line errors, writing, and the
repair of an append-only file after a crash.

Records are pydantic models so a malformed line is an error that names the file, the line and
the sample id instead of a KeyError three stages later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


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
