"""The stage bodies' `StageContext` inside a Prefect task: lines to the task run's logger,
progress and artifacts to the Prefect API (the run page shows them), secrets from Prefect
Secret blocks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from eaglet.stage_context import readable
from eaglet_prefect.blocks import prefect_secret
from eaglet_prefect.tasks.artifacts import publish_plot


def progress_bar(fraction: float, width: int = 20) -> str:
    """`██████░░░░ 60%`: a bar a person reads at a glance in an artifact's description."""
    fraction = min(max(fraction, 0.0), 1.0)
    filled = round(fraction * width)
    return "█" * filled + "░" * (width - filled) + f" {fraction:.0%}"


class PrefectContext:
    """`eaglet.stage_context.StageContext` for the current task run (its secrets work outside
    a run too: `eaglet doctor` reads them)."""

    def info(self, line: str) -> None:
        get_run_logger().info("%s", line)

    def warning(self, line: str) -> None:
        get_run_logger().warning("%s", line)

    def progress(self, key: str, description: str) -> Callable[[float, str | None], None]:
        artifact = create_progress_artifact(0.0, key=key, description=description)

        def update(fraction: float, text: str | None = None) -> None:
            # The UI's artifact cards show a number, no bar: the description carries one.
            shown = f"{progress_bar(fraction)} {text}" if text else None
            update_progress_artifact(artifact, progress=100.0 * fraction, description=shown)

        return update

    def markdown(self, key: str, text: str, description: str) -> None:
        create_markdown_artifact(text, key=key, description=description)

    def table(self, key: str, rows: list[dict[str, Any]], description: str) -> None:
        shown = [{name: readable(value) for name, value in row.items()} for row in rows]
        create_table_artifact(shown, key=key, description=description)

    def image(self, key: str, path: Path, description: str) -> None:
        publish_plot(path, key=key, description=description)

    def secret(self, name: str) -> str:
        return prefect_secret(name)
