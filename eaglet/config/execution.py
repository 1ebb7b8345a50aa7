"""`execution`: where the stages run: the task runner and its Dask cluster
(`ExecutionConfig`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from eaglet.config_fields import Strict


class ExecutionConfig(Strict):
    model_config = ConfigDict(title="Execution")  # the UI form's heading

    task_runner: Literal["default", "dask"] = Field(
        "default",
        description="How the hidden_states stage's shard tasks run: default = one after "
        "another in the flow's process; dask = mapped over a Dask cluster (prefect-dask).",
    )
    dask_address: str | None = Field(
        None,
        description="Address of an existing Dask scheduler (tcp://host:8786); blank (null) with "
        "task_runner=dask starts a local cluster of dask_workers processes.",
    )
    dask_workers: int = Field(
        2, ge=1, le=1024, description="Worker processes of the local Dask cluster."
    )
