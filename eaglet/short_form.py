"""The short form of a run: the few settings most runs change (target, datasets, engine and
endpoints, epochs, work dir), as `a.b=value` overrides of a base config (a YAML file, or the
demo's defaults). A blank or zero value keeps the base config's setting, so the short form never
needs an "unset" toggle; everything else stays in the full config."""

from __future__ import annotations

import json
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from eaglet.config.generation import GenerationConfig

# The engines of the config, and "" for "the base config's".
EngineChoice = Literal[("",) + get_args(GenerationConfig.model_fields["engine"].annotation)]  # type: ignore[valid-type]


class ShortFormDataset(BaseModel):
    """One dataset of the short form (the full config's `datasets` entries have more fields)."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="A short tag for the dataset, kept in every record.")
    path: str = Field(
        description="A local JSONL/Parquet file or folder, or a Hugging Face dataset id."
    )
    limit: int = Field(
        0, ge=0, description="Read at most this many rows; 0 reads them all. Range: at least 0."
    )


# The config key each field of the short form sets (the failure advice names the field).
SHORT_FORM_FIELDS = {
    "target.model": "target_model",
    "generation.engine": "engine",
    "generation.endpoints": "endpoints",
    "generation.served_model": "served_model",
    "train.epochs": "epochs",
    "work_dir": "work_dir",
    "datasets": "datasets",
}


def short_form_overrides(
    target_model: str = "",
    datasets: list[ShortFormDataset] | None = None,
    engine: str = "",
    endpoints: list[str] | None = None,
    served_model: str = "",
    epochs: int = 0,
    work_dir: str = "",
) -> list[str]:
    """The `a.b=value` overrides (values as JSON, which YAML reads) of the settings given; a
    blank, empty or zero one is left out, keeping the base config's."""
    settings: dict[str, object] = {
        "target.model": target_model.strip(),
        "generation.engine": engine,
        "generation.endpoints": [e.strip() for e in endpoints or [] if e.strip()],
        "generation.served_model": served_model.strip(),
        "train.epochs": epochs,
        "work_dir": work_dir.strip(),
        "datasets": [
            {"source": d.source, "path": d.path} | ({"limit": d.limit} if d.limit else {})
            for d in (ShortFormDataset.model_validate(d) for d in datasets or [])
        ],
    }
    return [f"{key}={json.dumps(value)}" for key, value in settings.items() if value]
