"""JSONL record files: the record base class, reading with file:line errors, writing, and the
repair of an append-only file after a crash.

Records are pydantic models so a malformed line is an error that names the file, the line and
the sample id instead of a KeyError three stages later.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from eaglet.errors import PermanentError


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


R = TypeVar("R", bound=Record)


class RecordFileError(PermanentError, ValueError):
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


REJECTED_LINES_SUFFIX = ".rejected-lines.jsonl"
SORTING_SUFFIX = ".sorting"


def sort_jsonl(path: Path, rank: Callable[[str], tuple]) -> bool:
    """Rewrite a record file with its lines in the order `rank(sample_id)` gives (ties in file
    order), each line's bytes as they were; a file already in that order is left untouched.
    Streams: only each line's offset is held. Returns whether it rewrote the file.

    A stage's record file is written in the order records arrive (reused ones first,
    concurrent requests as they finish); sorted once before it is sealed, its bytes are the
    same whatever was reused or how requests interleaved, so an incremental run's folder
    equals a fresh run's."""
    path = Path(path)
    for leftover in path.parent.glob(f".{path.name}.*{SORTING_SUFFIX}"):
        leftover.unlink()  # a sort cut short by a kill: its copy, never the file itself
    if not path.exists():
        return False
    lines: list[tuple[tuple, int, int, int]] = []  # (rank, line number, offset, length)
    offset = 0
    with open(path, "rb") as handle:
        for number, line in enumerate(handle):
            if line.strip():
                sample_id = json.loads(line)["sample_id"]
                lines.append((rank(sample_id), number, offset, len(line)))
            offset += len(line)
    ordered = sorted(lines)
    if ordered == lines:
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}{SORTING_SUFFIX}")
    try:
        with open(path, "rb") as source, open(tmp, "wb") as out:
            for _, _, start, length in ordered:
                source.seek(start)
                out.write(source.read(length))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


log = logging.getLogger("eaglet.records")


@dataclass
class Repair:
    """What `repair_jsonl` found: the ids of readable records, the bytes of a torn last line
    that were cut, and the unreadable lines set aside (their 1-based line numbers)."""

    ids: set[str] = field(default_factory=set)
    cut_bytes: int = 0
    set_aside: list[int] = field(default_factory=list)
    rejected_path: Path | None = None


def rejected_lines_path(path: Path) -> Path:
    """`generations.jsonl` -> `generations.rejected-lines.jsonl`, beside it."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".jsonl") + REJECTED_LINES_SUFFIX)


def _line_problem(line: bytes) -> tuple[str | None, str | None]:
    """(sample_id, None) for a readable record line, (None, why) otherwise."""
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"not valid JSON ({exc})"
    if not isinstance(data, dict) or not isinstance(data.get("sample_id"), str):
        return None, "no string sample_id"
    return data["sample_id"], None


def repair_jsonl(path: Path) -> Repair:
    """Make an append-only JSONL file safe to append to after a crash, losing nothing.

    A process killed mid-write leaves at most one partial line at the end (no trailing
    newline): that line is cut so the next append starts on a clean line, and its sample is
    generated again. Any other unreadable line (bad JSON, bad UTF-8, no `sample_id`) is not
    a crash's trace: it is moved, with its line number and the reason, to
    `<name>.rejected-lines.jsonl` beside the file, logged, and every record after it is kept.
    """
    path = Path(path)
    repair = Repair()
    if not path.exists():
        return repair
    size = path.stat().st_size
    good_bytes, bad = _scan_lines(path, repair)
    if bad:
        _set_aside_lines(path, bad, repair)
    elif good_bytes != size:
        with open(path, "r+b") as handle:
            handle.truncate(good_bytes)
    if repair.cut_bytes:
        log.info("%s: cut a torn last line of %d bytes (a write cut short)", path, repair.cut_bytes)
    return repair


def _scan_lines(path: Path, repair: Repair) -> tuple[int, dict[int, str]]:
    """Read `path` into `repair` (ids, a torn last line's bytes); return the bytes of whole
    lines and the lines to set aside (line number -> why): unreadable ones, and a second line
    of a sample id already written (the first is kept)."""
    good_bytes = 0
    bad: dict[int, str] = {}
    first_line: dict[str, int] = {}
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.endswith(b"\n"):  # only ever the last line
                repair.cut_bytes = len(line)
                break
            good_bytes += len(line)
            if not line.strip():
                continue
            sample_id, why = _line_problem(line)
            if sample_id is None:
                bad[line_number] = why or "unreadable"
            elif sample_id in first_line:
                bad[line_number] = (
                    f"sample {sample_id} again (first on line {first_line[sample_id]})"
                )
            else:
                first_line[sample_id] = line_number
                repair.ids.add(sample_id)
    return good_bytes, bad


def _set_aside_lines(path: Path, bad: dict[int, str], repair: Repair) -> None:
    """Move the `bad` lines to the rejected-lines file and rewrite `path` without them (and
    without a torn last line), atomically; log what was set aside."""
    repair.rejected_path = rejected_lines_path(path)
    repair.set_aside = sorted(bad)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.repair")
    with (
        open(path, "rb") as source,
        open(tmp, "wb") as kept,
        open(repair.rejected_path, "a", encoding="utf-8") as rejected,
    ):
        for line_number, line in enumerate(source, start=1):
            if not line.endswith(b"\n"):
                break
            if line_number in bad:
                text = line[:-1].decode("utf-8", errors="surrogateescape")
                entry = {"file": path.name, "line": line_number, "why": bad[line_number]}
                rejected.write(json.dumps({**entry, "text": text}) + "\n")
            else:
                kept.write(line)
        rejected.flush()
        os.fsync(rejected.fileno())
        kept.flush()
        os.fsync(kept.fileno())
    os.replace(tmp, path)
    log.warning(
        "%s: %d unreadable or repeated line(s) (line %s) set aside in %s; the %d records "
        "around them are kept and samples with no record left will be generated again",
        path,
        len(bad),
        ", ".join(str(n) for n in repair.set_aside[:10]),
        repair.rejected_path,
        len(repair.ids),
    )


def repair_and_read_ids(path: Path) -> set[str]:
    """Ids already written to an append-only JSONL file, after `repair_jsonl`: a torn last
    line is cut, any other unreadable line is set aside in `<name>.rejected-lines.jsonl`."""
    return repair_jsonl(path).ids


def record_file_problems(path: Path, expected_records: int | None) -> list[str]:
    """What makes a record file untrue to seal or to trust, one line each: a line that is not
    a record, a sample id on a second line (both line numbers), a line count other than
    `expected_records` (the manifest's `records`). Empty when every line is one record of its
    own sample id."""
    problems: list[str] = []
    first_line: dict[str, int] = {}
    lines = 0
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            lines += 1
            sample_id, why = _line_problem(line)
            if sample_id is None:
                problems.append(f"{path}:{line_number}: {why}")
            elif sample_id in first_line:
                problems.append(
                    f"{path}:{line_number}: sample {sample_id} again (first on line "
                    f"{first_line[sample_id]})"
                )
            else:
                first_line[sample_id] = line_number
    if expected_records is not None and lines != expected_records:
        problems.append(f"{path}: {lines} records, the manifest counts {expected_records}")
    return problems
