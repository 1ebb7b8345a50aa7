"""What a failed or refused run tells a person to do, in the terms of the place the setting came
from: the Prefect UI's short form (its own fields), the full form (Config → section → field),
the YAML file `config_path` names (file and key), or a shell (`eaglet run`, `--set`).

One fact decides the advice for a failure: whether the same parameters can succeed
(`eaglet.errors.is_transient`, the same test that decides Prefect's automatic retries). The
log, the `<stage>-failure` artifact, the flow run's state message and the notification all
say what `what_to_do` and `failure_headline` derive from it: Retry where it can succeed,
otherwise the setting to change and that Retry would fail the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RunOrigin:
    """Where a run's settings came from: the page or shell that started it, the YAML file they
    were read from (None: the form's own values or the demo's defaults), and the keys the
    short form's fields set on top of that file."""

    started_from: StartedFrom
    config_file: str | None = None
    set_keys: frozenset[str] = frozenset()

    @classmethod
    def of_run(cls, record: Mapping[str, Any] | None) -> RunOrigin:
        """The origin a run record (`run.json`) holds."""
        run = record or {}
        return cls(
            run.get("started_from", "shell"),
            run.get("config_path") or None,
            frozenset(run.get("set_keys") or ()),
        )


def field_for(key: str, origin: RunOrigin) -> str:
    """Where a config key is set for a run of `origin`: the short form's field, the full
    form's field, the YAML file and key, or `--set`."""
    plain = re.sub(r"\[\d+\]", "", key)
    section = plain.split(".")[0]
    in_file = f"`{key}` in `{origin.config_file}`" if origin.config_file else None
    if origin.started_from == "short form":
        field = SHORT_FORM_FIELDS.get(plain) or SHORT_FORM_FIELDS.get(section)
        if field and (plain in origin.set_keys or section in origin.set_keys or not in_file):
            return f"`{field}` (a field of this form)"
        if field:
            return f"{in_file} (the base config `config_path` names), or this form's `{field}`"
        if in_file:
            return f"{in_file} (the base config `config_path` names; not a field of this form)"
        return (
            f"`{key}` (not a field of the short form: set it in a base config file named by "
            "`config_path`, or run the `pipeline` deployment, whose form has every setting)"
        )
    if origin.started_from == "full form":
        if in_file:
            return f"{in_file} (the file `config_path` names; the form's `config` is not used)"
        return f"`{key}` ({form_path(plain)})"
    if in_file:
        return f"{in_file} (or `--set {plain}=...`)"
    return f"`{key}` in the config file (or `--set {plain}=...`)"


def fails_again(started_from: StartedFrom) -> str:
    """What repeating a failed run with the same parameters does, in the words of where it
    started (a failure `eaglet.errors.is_transient` finds deterministic)."""
    if started_from == "shell":
        return "the same command would fail the same way"
    return "Retry would send the same parameters and fail the same way"


def what_to_do(
    stage: str, entry: Mapping[str, Any], resume_command: str, origin: RunOrigin
) -> list[str]:
    """The markdown lines that say how to go on after `stage` failed with `entry['error']`."""
    keys = settings_to_change(stage, entry)
    fields = ", ".join(field_for(k, origin) for k in keys)
    ui = origin.started_from != "shell"
    again = (
        "the **Retry** button on this flow run's page runs it again with the same parameters"
        if ui
        else f"`{resume_command}` runs it again"
    )
    new_run = (
        "start a new run (*Run* → *Custom run* on this deployment): "
        + fails_again(origin.started_from)
        if ui
        else f"run `{resume_command}` again"
    )
    if entry.get("retry_can_succeed"):
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


def settings_to_change(stage: str, entry: Mapping[str, Any]) -> list[str]:
    """The config keys a failure's error names, else the stage's `retry_setting` (the server
    it talks to)."""
    keys = config_keys_named(entry.get("error", ""))
    spec = STAGE.get(stage)
    if not keys and spec is not None and spec.retry_setting:
        keys = [spec.retry_setting]
    return keys


def key_line(error: str) -> str:
    """The line of an error message that says what went wrong: its first, or the first one
    below a heading that ends with a colon (`preflight canary failed:`)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def failure_headline(stage: str, entry: Mapping[str, Any], origin: RunOrigin) -> str:
    """One line for a failed run (its flow run's state message, the notification's first
    line): the stage, the error's key line, and whether Retry can succeed or what to change."""
    can_retry = bool(entry.get("retry_can_succeed"))
    line = f"{stage} failed: {key_line(entry.get('error', ''))}"
    if can_retry:
        return f"{line}. Retry can succeed once the passing fault is gone"
    verdict = fails_again(origin.started_from)
    verdict = verdict[0].upper() + verdict[1:]
    keys = settings_to_change(stage, entry)
    if keys:
        return f"{line}. {verdict}: change {', '.join(field_for(k, origin) for k in keys)}"
    return f"{line}. {verdict}"
