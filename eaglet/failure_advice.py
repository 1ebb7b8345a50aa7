"""What a failed stage tells a person to do, in the terms of the place they started the run: the
Prefect UI's short form (its own fields), the full form (Config → section → field), or a shell
(`eaglet run`). Retry is offered only when the same parameters can succeed (a passing fault:
a connection, a timeout, a busy server); otherwise the advice names the setting to change and
says that Retry would fail the same way.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import BaseModel

from eaglet.config import PipelineConfig
from eaglet.short_form import SHORT_FORM_FIELDS
from eaglet.stages import STAGE

StartedFrom = Literal["short form", "full form", "shell"]

# Dotted config keys an error message names (`generation.max_tokens`, `train.device`,
# `datasets[0].path`): a section of the config, then its fields.
KEY = re.compile(rf"\b((?:{'|'.join(PipelineConfig.model_fields)})(?:\[\d+\])?(?:\.[a-z_]+)+)")


def config_keys_named(text: str) -> list[str]:
    """The config keys `text` names, in order, each once (`datasets[0].path` as written)."""
    return list(dict.fromkeys(KEY.findall(text)))


def form_path(key: str) -> str:
    """Where the full form shows a config key: `config → Generation → Max Tokens` (a section by
    its title, a field as Prefect titles it)."""
    labels, model = ["config"], PipelineConfig
    for part in key.split("."):
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            labels.append(part.replace("_", " ").title())
            model = None
            continue
        inner = _model_in(field.annotation)
        # a section by its title; a list of them (datasets) by its own name
        title = inner.model_config.get("title") if inner is field.annotation else None
        labels.append(title or field.title or part.replace("_", " ").title())
        model = inner
    return " → ".join(labels)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (itself, or inside a list or an optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def field_for(key: str, started_from: StartedFrom) -> str:
    """How a config key is reached where the run was started."""
    plain = re.sub(r"\[\d+\]", "", key)
    if started_from == "short form":
        field = SHORT_FORM_FIELDS.get(plain) or SHORT_FORM_FIELDS.get(plain.split(".")[0])
        if field:
            return f"`{field}` (a field of this form)"
        return (
            f"`{key}` (not a field of the short form: set it in the base config file its "
            "`config_path` names, or run the `pipeline` deployment, whose form has every setting)"
        )
    if started_from == "full form":
        return f"`{key}` ({form_path(plain)})"
    return f"`{key}` in the config file (or `--set {plain}=...`)"


def what_to_do(
    stage: str, entry: dict[str, Any], resume_command: str, started_from: StartedFrom
) -> list[str]:
    """The markdown lines that say how to go on after `stage` failed with `entry['error']`."""
    keys = config_keys_named(entry.get("error", ""))
    can_retry = bool(entry.get("retry_can_succeed"))
    spec = STAGE.get(stage)
    if can_retry and not keys and spec is not None and spec.retry_setting:
        keys = [spec.retry_setting]  # the setting behind its passing faults, worth naming
    fields = ", ".join(field_for(k, started_from) for k in keys)
    ui = started_from != "shell"
    again = (
        "the **Retry** button on this flow run's page runs it again with the same parameters"
        if ui
        else f"`{resume_command}` runs it again"
    )
    new_run = (
        "start a new run (*Run* → *Custom run* on this deployment): Retry would send the same "
        "parameters and fail the same way"
        if ui
        else f"run `{resume_command}` again"
    )
    if can_retry:
        lines = [
            f"**Retry can succeed**: this looks like a passing fault (a connection, a timeout, a "
            f"busy server). Once the cause is gone (the server is up again), {again}."
        ]
        if fields:
            lines.append(f"If instead the setting is wrong, change {fields} and {new_run}.")
        return lines
    if fields:
        return [f"**Change** {fields}, then {new_run}."]
    return [f"**Fix the cause above**, then {new_run}."]
