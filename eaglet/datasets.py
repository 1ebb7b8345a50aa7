"""Reading datasets and normalising every row to a `Sample` with a stable `sample_id`.

Two row shapes are understood: OpenAI `messages` (roles system/user/assistant/tool, optional
`tools`) and ShareGPT `conversations` (`from`/`value`). Local .json/.jsonl files are read line
by line so an error names the line; .parquet files and hub ids go through `datasets`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eaglet.config import DatasetSpec
from eaglet.records.samples import Sample
from eaglet.storage import canonical_json

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


class DatasetError(ValueError):
    """A dataset row eaglet cannot use; the message names the file and row."""


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


def _normalise_message(message: dict[str, Any], where: str) -> dict[str, Any]:
    role = message.get("role")
    if role not in OPENAI_ROLES:
        raise DatasetError(f"{where}: unknown message role {role!r}")
    out = {"role": "system" if role == "developer" else role, "content": message.get("content")}
    if out["content"] is None:
        out["content"] = ""
    for field in ("reasoning_content", "tool_calls", "tool_call_id", "name"):
        if message.get(field) is not None:
            out[field] = message[field]
    if "reasoning" in message and "reasoning_content" not in out and message["reasoning"]:
        out["reasoning_content"] = message["reasoning"]
    for call in out.get("tool_calls", []):
        function = call.get("function", {})
        if "arguments" in function:
            function["arguments"] = _maybe_json(function["arguments"])
    return out


def normalise_row(row: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], Any]:
    """Turn one dataset row into (messages, tools); `where` names the row in errors."""
    if "messages" in row or "messages_json" in row:
        messages = row.get("messages")
        if messages is None:
            messages = _maybe_json(row["messages_json"])
        if not isinstance(messages, list):
            raise DatasetError(f"{where}: 'messages' is not a list")
        normalised = [_normalise_message(m, f"{where} message {i}") for i, m in enumerate(messages)]
    elif "conversations" in row:
        turns = row["conversations"]
        if not isinstance(turns, list):
            raise DatasetError(f"{where}: 'conversations' is not a list")
        normalised = []
        for i, turn in enumerate(turns):
            speaker = str(turn.get("from", "")).lower()
            if speaker not in SHAREGPT_ROLES:
                raise DatasetError(f"{where} turn {i}: unknown ShareGPT speaker {speaker!r}")
            normalised.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value") or ""})
    else:
        raise DatasetError(
            f"{where}: row has neither 'messages' (OpenAI) nor 'conversations' (ShareGPT); "
            f"its keys are {sorted(row)}"
        )
    if not any(m["role"] == "user" for m in normalised):
        raise DatasetError(f"{where}: conversation has no user message")
    tools = _maybe_json(row.get("tools"))
    if tools in ("", []):
        tools = None
    if tools is not None and not isinstance(tools, list):
        raise DatasetError(f"{where}: 'tools' must be a list of function schemas")
    return normalised, tools


def _local_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{line_number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{where}: not valid JSON ({exc.msg})") from None
    elif suffix == ".json":
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(rows, list):
            raise DatasetError(f"{path}: a .json dataset must hold a list of rows")
        for index, row in enumerate(rows):
            yield f"{path} row {index}", row
    elif suffix == ".parquet":
        from datasets import load_dataset

        table = load_dataset("parquet", data_files=str(path), split="train")
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


def read_samples(spec: DatasetSpec) -> Iterator[Sample]:
    """Yield the dataset's rows as samples, up to `spec.limit`, in file order."""
    path = Path(spec.path)
    looks_local = path.suffix.lower() in {".json", ".jsonl", ".parquet"} or path.exists()
    if looks_local and not path.exists():
        raise DatasetError(f"dataset file not found: {path} (source {spec.source!r})")
    rows = _local_rows(path) if looks_local else _hub_rows(spec)
    for count, (where, row) in enumerate(rows):
        if spec.limit is not None and count >= spec.limit:
            break
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: a row must be a JSON object")
        messages, tools = normalise_row(row, where)
        content = {"messages": messages, "tools": tools}
        yield Sample(
            sample_id=sample_id_for(spec.source, content),
            source=spec.source,
            messages=messages,
            tools=tools,
        )
