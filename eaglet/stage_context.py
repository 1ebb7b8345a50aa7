"""What a stage body may ask of whatever runs it: log lines, progress, artifacts a person looks
at, secrets. Prefect's task context implements it in `tasks/context.py`; `PlainContext` here
runs a stage without Prefect (tests, scripts): lines go to a `log` function, artifacts are kept
in a list, secrets come from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from eaglet.progress import say


class StageContext(Protocol):
    """The services a stage body uses. Keys name artifacts (lowercase, dashes); descriptions
    say what the artifact shows."""

    def info(self, line: str) -> None: ...

    def warning(self, line: str) -> None: ...

    def progress(self, key: str, description: str) -> Callable[[float, str | None], None]:
        """A progress bar; the function returned sets it to a fraction in [0, 1] (and,
        optionally, a new description)."""
        ...

    def markdown(self, key: str, text: str, description: str) -> None: ...

    def table(self, key: str, rows: list[dict[str, Any]], description: str) -> None: ...

    def image(self, key: str, path: Path, description: str) -> None:
        """A PNG the stage wrote (in its `.partial` folder)."""
        ...

    def secret(self, name: str) -> str:
        """The value of the secret `name` (ValueError naming it when there is none)."""
        ...


def readable(value: Any) -> Any:
    """A figure as a person reads it in an artifact: floats rounded (3 decimals, 1 from 100
    up), None as a dash, lists and dicts of figures likewise."""
    if isinstance(value, bool) or value is None:
        return "—" if value is None else value
    if isinstance(value, float):
        return round(value, 1 if abs(value) >= 100 else 3)
    if isinstance(value, list):
        return [readable(item) for item in value]
    if isinstance(value, dict):
        return {key: readable(item) for key, item in value.items()}
    return value


def figures_markdown(title: str, figures: dict[str, Any]) -> str:
    """`# title` and a two-column table of `figures` (readable values, keys in words)."""
    rows = [f"| {key.replace('_', ' ')} | {readable(value)} |" for key, value in figures.items()]
    return f"# {title}\n\n| figure | value |\n|---|---|\n" + "\n".join(rows) + "\n"


@dataclass
class PlainContext:
    """A `StageContext` without Prefect: lines to `log`, artifacts kept in `artifacts` (kind,
    key, description, content), secrets from the environment variable of the same name."""

    log: Callable[[str], None] = say
    artifacts: list[dict[str, Any]] = field(default_factory=list)

    def info(self, line: str) -> None:
        self.log(line)

    def warning(self, line: str) -> None:
        self.log(f"warning: {line}")

    def progress(self, key: str, description: str) -> Callable[[float, str | None], None]:
        entry = self._keep("progress", key, description, 0.0)

        def update(fraction: float, text: str | None = None) -> None:
            entry["content"] = fraction
            if text is not None:
                entry["description"] = text

        return update

    def markdown(self, key: str, text: str, description: str) -> None:
        self._keep("markdown", key, description, text)

    def table(self, key: str, rows: list[dict[str, Any]], description: str) -> None:
        self._keep("table", key, description, rows)

    def image(self, key: str, path: Path, description: str) -> None:
        self._keep("image", key, description, str(path))

    def secret(self, name: str) -> str:
        value = os.environ.get(name)
        if not value:
            raise ValueError(f"secret {name!r}: no environment variable of that name is set")
        return value

    def _keep(self, kind: str, key: str, description: str, content: Any) -> dict[str, Any]:
        entry = {"kind": kind, "key": key, "description": description, "content": content}
        self.artifacts.append(entry)
        return entry


def generation_api_key(secret: str | None, read: Callable[[str], str]) -> str | None:
    """The API key held by the secret named in `generation.api_key_secret` (`secret`), if one
    is named, read by `read` (a context's `secret`; the engines read `generation.api_key_env`
    themselves)."""
    if not secret:
        return None
    try:
        return read(secret)
    except ValueError as exc:
        raise ValueError(f"generation.api_key_secret={secret!r}: {exc}") from exc
