"""`datasets`: one entry of the list of datasets whose prompts the target answers again
(`DatasetSpec`). The list itself, and its rule that no two entries read the same data, is
`PipelineConfig`'s (`eaglet.config.pipeline`).
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from eaglet.config_fields import Strict


class DatasetSpec(Strict):
    model_config = ConfigDict(title="Dataset")  # the UI form's heading

    source: str = Field(
        description="Tag carried into every record (e.g. 'arith', 'glaive'): letters, digits, "
        "'.', '_' and '-', not starting with '.' (it may name files, so never a path).",
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]*$",
    )
    path: str = Field(
        description="Hugging Face hub dataset id, or a local .json/.jsonl/.parquet file.",
    )
    split: str = Field("train", description="Dataset split to read.")
    limit: int | None = Field(None, ge=1, description="Read at most this many rows (blank: all).")
    revision: str | None = Field(None, description="Hub revision (commit or tag) to pin.")
    name: str | None = Field(None, description="Hub dataset config name, if any.")
