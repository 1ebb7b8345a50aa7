"""Reading datasets and normalising every row to a `Sample` with a stable `sample_id`.

Two row shapes are understood: OpenAI `messages` (roles system/user/assistant/tool, optional
`tools`) and ShareGPT `conversations` (`from`/`value`). Local .json/.jsonl files are read line
by line so an error names the line; .parquet files and hub ids go through `datasets`.

What is wrong with a whole file (not found, unsupported type, empty, invalid UTF-8 or JSON, an
unknown row shape or role) is a `DatasetError` naming the file and line. What is wrong with
one row's content is a `RowSkipped`: the row is left out, counted by kind and listed with its
reason in the download stage's `rejected.jsonl` (no user turn, only non-text content parts,
tool-call arguments that are not JSON, a duplicate of an earlier row). Text parts of a
list-of-parts content are kept (joined by newlines, as vLLM joins them); a number as content
becomes its JSON text and is counted.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglet.config.datasets import DatasetSpec
from eaglet.errors import PermanentError
from eaglet.local_paths import UNSUPPORTED_DATASET_SUFFIXES, is_hub_dataset
from eaglet.records.io import record_line
from eaglet.records.samples import Sample
from eaglet.storage import canonical_json, finished_folder

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bing": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_response": "tool",
}
OPENAI_ROLES = {"system", "developer", "user", "assistant", "tool"}


class DatasetError(PermanentError, ValueError):
    """A dataset eaglet cannot use; the message names the file and row."""


class RowSkipped(DatasetError):
    """One row whose content eaglet cannot use: left out, counted under `kind`, reported."""

    def __init__(self, where: str, kind: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where, self.kind, self.why = where, kind, why


@dataclass
class ReadReport:
    """What reading datasets left out or changed, for the manifest and `rejected.jsonl`."""

    skipped: Counter = field(default_factory=Counter)
    notes: Counter = field(default_factory=Counter)
    on_skip: Callable[[dict[str, Any]], None] | None = None
    where: str = ""  # the row the last sample yielded came from (file:line or file row N)

    def skip(self, source: str, error: RowSkipped) -> None:
        self.skipped[error.kind] += 1
        if self.on_skip is not None:
            self.on_skip(
                {"source": source, "where": error.where, "kind": error.kind, "why": error.why}
            )


def sample_id_for(source: str, row: dict[str, Any]) -> str:
    """Stable id: the same source row always gets the same id, whatever its position."""
    return hashlib.sha256(f"{source}\n{canonical_json(row)}".encode()).hexdigest()[:16]


def _drop_nulls(value: Any) -> Any:
    # Arrow-backed readers unify struct fields across rows and fill the gaps with None;
    # those Nones were never in the data.
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def content_text(content: Any, where: str, notes: Counter | None = None) -> str:
    """A message's content as text. None -> ""; a list of parts -> its text parts joined by
    newlines (other parts dropped and counted); only non-text parts -> `RowSkipped` (the
    turn means something a text target cannot see); a number -> its JSON text (counted)."""
    notes = notes if notes is not None else Counter()
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, bool) or not isinstance(content, int | float | list):
        raise RowSkipped(
            where, "content_type", f"content is a {type(content).__name__}, not text or parts"
        )
    if isinstance(content, int | float):
        notes["number_content"] += 1
        return json.dumps(content)
    texts: list[str] = []
    others: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text":
            if not isinstance(part.get("text"), str):
                raise RowSkipped(where, "content_type", "a text part without a 'text' string")
            texts.append(part["text"])
        else:
            others.append(str(part.get("type")) if isinstance(part, dict) else type(part).__name__)
    if others and not texts:
        raise RowSkipped(
            where,
            "non_text_content",
            f"content has only non-text parts ({', '.join(sorted(set(others)))}); a text "
            "target cannot take them and the turn means nothing without them",
        )
    if others:
        notes["non_text_parts_dropped"] += len(others)
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise RowSkipped(where, "tool_calls", "'tool_calls' is not a list of objects")
    for index, call in enumerate(calls):
        function = call.get("function", {})
        if not isinstance(function, dict):
            raise RowSkipped(where, "tool_calls", f"tool call {index}: 'function' is not an object")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise RowSkipped(
                    where,
                    "tool_arguments",
                    f"tool call {index} ({function.get('name')!r}): arguments are not valid "
                    f"JSON ({exc.msg}): {arguments[:80]!r}",
                ) from None
    return calls


def _normalise_message(message: Any, where: str, notes: Counter | None = None) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise DatasetError(f"{where}: a message must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in OPENAI_ROLES:
        raise DatasetError(
            f"{where}: unknown message role {role!r} (expected one of {sorted(OPENAI_ROLES)})"
        )
    out = {
        "role": "system" if role == "developer" else role,
        "content": content_text(message.get("content"), where, notes),
    }
    for key in ("reasoning_content", "tool_calls", "tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    if "reasoning" in message and "reasoning_content" not in out and message["reasoning"]:
        out["reasoning_content"] = message["reasoning"]
    if "tool_calls" in out:
        out["tool_calls"] = _tool_calls(out["tool_calls"], where)
    return out


def normalise_row(
    row: dict[str, Any], where: str, notes: Counter | None = None
) -> tuple[list[dict[str, Any]], Any]:
    """Turn one dataset row into (messages, tools); `where` names the row in errors.

    Raises `DatasetError` when the row's shape is not one eaglet reads, `RowSkipped` when
    its content cannot be used (the caller counts and reports it)."""
    if "messages" in row or "messages_json" in row:
        messages = row.get("messages")
        if messages is None:
            messages = _maybe_json(row["messages_json"])
        if not isinstance(messages, list):
            raise DatasetError(f"{where}: 'messages' is not a list")
        normalised = [
            _normalise_message(m, f"{where} message {i}", notes) for i, m in enumerate(messages)
        ]
    elif "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list):
            raise DatasetError(f"{where}: 'conversations' is not a list")
        normalised = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise DatasetError(f"{where} turn {i}: a turn must be an object")
            speaker = str(turn.get("from", "")).lower()
            if speaker not in SHAREGPT_ROLES:
                raise DatasetError(
                    f"{where} turn {i}: unknown ShareGPT speaker {speaker!r} "
                    f"(expected one of {sorted(SHAREGPT_ROLES)})"
                )
            content = content_text(turn.get("value"), f"{where} turn {i}", notes)
            normalised.append({"role": SHAREGPT_ROLES[speaker], "content": content})
    else:
        raise DatasetError(
            f"{where}: row has neither 'messages' (OpenAI) nor 'conversations' (ShareGPT); "
            f"its keys are {sorted(row)}"
        )
    if not any(m["role"] == "user" for m in normalised):
        raise RowSkipped(where, "no_user_turn", "conversation has no user message")
    tools = _maybe_json(row.get("tools"))
    if tools in ("", []):
        tools = None
    if tools is not None and not isinstance(tools, list):
        raise DatasetError(f"{where}: 'tools' must be a list of function schemas")
    for i, message in enumerate(normalised):
        _encodable(message, f"{where} message {i}")
    _encodable(tools, f"{where} tools")
    return normalised, tools


def _encodable(value: Any, where: str) -> None:
    """`RowSkipped` when `value` holds text UTF-8 cannot encode: a lone UTF-16 surrogate,
    which JSON can spell (a `\\ud800` escape) but no tokenizer or file of eaglet's can take."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start]
        raise RowSkipped(
            where,
            "lone_surrogate",
            f"the text holds a lone UTF-16 surrogate U+{ord(bad):04X} (a broken \\u escape "
            "in the file), which is not text",
        ) from None


def _decode(raw: bytes, path: Path, line: int | None = None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if line is None:
            line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - raw.rfind(b"\n", 0, exc.start)
        raise DatasetError(
            f"{path}:{line}: not valid UTF-8 (byte {raw[exc.start]:#04x} at column {column}); "
            "save the file as UTF-8"
        ) from None


def _local_rows(path: Path) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, "rb") as handle:
            for line_number, raw in enumerate(handle, start=1):
                line = _decode(raw, path, line_number)
                if not line.strip():
                    continue
                where = f"{path}:{line_number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(
                        f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
                    ) from None
    elif suffix == ".json":
        text = _decode(path.read_bytes(), path)
        if not text.strip():
            return
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(rows, list):
            raise DatasetError(f"{path}: a .json dataset must hold a list of rows")
        for index, row in enumerate(rows):
            yield f"{path} row {index}", row
    elif suffix == ".parquet":
        from datasets import load_dataset

        try:
            table = load_dataset("parquet", data_files=str(path), split="train")
        except Exception as exc:  # pyarrow's errors name neither the file nor what to do
            raise DatasetError(
                f"{path}: cannot read as Parquet ({type(exc).__name__}: {exc})"
            ) from None
        expected = {"messages", "messages_json", "conversations"}
        if not expected & set(table.column_names):
            raise DatasetError(
                f"{path}: Parquet columns {sorted(table.column_names)} hold no conversation; "
                "expected 'messages' (OpenAI), 'messages_json' or 'conversations' (ShareGPT)"
            )
        for index, row in enumerate(table):
            yield f"{path} row {index}", _drop_nulls(row)
    else:
        raise DatasetError(
            f"{path}: unsupported file type {suffix!r} (use .json, .jsonl, .parquet)"
        )


def _hub_rows(spec: DatasetSpec) -> Iterator[tuple[str, dict[str, Any]]]:
    from datasets import load_dataset

    table = load_dataset(spec.path, spec.name, split=spec.split, revision=spec.revision)
    for index, row in enumerate(table):
        yield f"{spec.path}[{spec.split}] row {index}", _drop_nulls(row)


def read_samples(spec: DatasetSpec, report: ReadReport | None = None) -> Iterator[Sample]:
    """Yield the dataset's rows as samples, up to `spec.limit` rows, in file order.

    Rows whose content cannot be used are skipped and counted in `report` (with their
    reasons, through `report.on_skip`); a file with no rows, or whose every row was skipped,
    is a `DatasetError` naming it."""
    report = report if report is not None else ReadReport()
    path = Path(spec.path)
    local = not is_hub_dataset(spec.path)
    if local and path.suffix.lower() in UNSUPPORTED_DATASET_SUFFIXES:
        raise DatasetError(
            f"{path}: unsupported file type {path.suffix!r} (source {spec.source!r}; "
            "use .json, .jsonl or .parquet)"
        )
    if local and not path.exists():
        raise DatasetError(f"dataset file not found: {path} (source {spec.source!r})")
    if local and path.is_dir():
        raise DatasetError(f"{path} is a folder; a dataset path names a .json/.jsonl/.parquet file")
    rows = _local_rows(path) if local else _hub_rows(spec)
    read = skipped = 0
    first_skip: RowSkipped | None = None
    for where, row in rows:
        if spec.limit is not None and read >= spec.limit:
            break
        read += 1
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        try:
            messages, tools = normalise_row(row, where, report.notes)
        except RowSkipped as exc:
            skipped += 1
            first_skip = first_skip or exc
            report.skip(spec.source, exc)
            continue
        content = {"messages": messages, "tools": tools}
        report.where = where
        yield Sample(
            sample_id=sample_id_for(spec.source, content),
            source=spec.source,
            messages=messages,
            tools=tools,
        )
    if read == 0:
        raise DatasetError(f"{path}: the dataset has no rows (source {spec.source!r})")
    if skipped == read and first_skip is not None:
        raise DatasetError(
            f"{path}: every one of its {read} rows was skipped (source {spec.source!r}); "
            f"the first: {first_skip}"
        )


def write_samples(
    datasets: Iterable[DatasetSpec],
    samples_path: Path,
    rejected_path: Path,
    log: Callable[[str], None] = lambda message: None,
) -> tuple[dict[str, int], dict[str, Any]]:
    """The download stage's body: every dataset's samples, each id once, to `samples_path`;
    each skipped or duplicate row, with where it is and why, to `rejected_path`.
    Returns (counts, info) for the manifest."""
    seen: dict[str, str] = {}
    per_source: dict[str, int] = {}
    duplicates = 0
    with (
        open(samples_path, "w", encoding="utf-8") as out,
        open(rejected_path, "w", encoding="utf-8") as rejects,
    ):

        def reject(entry: dict[str, Any]) -> None:
            rejects.write(json.dumps(entry, ensure_ascii=False) + "\n")

        report = ReadReport(on_skip=reject)
        for spec in datasets:
            for sample in read_samples(spec, report):
                if sample.sample_id in seen:
                    duplicates += 1
                    reject(
                        {
                            "source": spec.source,
                            "where": report.where,
                            "sample_id": sample.sample_id,
                            "kind": "duplicate",
                            "why": f"the same conversation as an earlier row "
                            f"({seen[sample.sample_id]})",
                        }
                    )
                    continue
                seen[sample.sample_id] = spec.source
                per_source[sample.source] = per_source.get(sample.source, 0) + 1
                out.write(record_line(sample))
            log(f"read {per_source.get(spec.source, 0)} samples from {spec.path} ({spec.source})")
    skipped = sum(report.skipped.values())
    if skipped or duplicates:
        log(
            f"left out {skipped} rows ({dict(report.skipped)}) and {duplicates} duplicates; "
            f"each with where it is and why in "
            f"{finished_folder(rejected_path.parent) / rejected_path.name}"
        )
    counts = {"records": len(seen), "duplicates": duplicates, "skipped": skipped}
    counts.update({f"skipped_{kind}": n for kind, n in report.skipped.items()})
    counts.update(report.notes)
    return counts, {"per_source": per_source}
