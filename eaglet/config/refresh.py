"""`refresh`: how a draft follows its target when the target changes (`eaglet.refresh`): how
far its τ may fall before it is trained again, and on how many new samples (`RefreshConfig`).
No stage reads it: a refresh decides whether to run the pipeline, never what a stage writes.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from eaglet.config_fields import Strict


class RefreshConfig(Strict):
    model_config = ConfigDict(title="Refresh when the target changes")  # the UI form's heading

    max_drop: float = Field(
        0.03,
        ge=0.0,
        le=1.0,
        description="The largest fall of the draft's τ on a named evaluation set, as a fraction "
        "of its τ at training, that keeps it serving a changed target without training again.",
    )
    epochs_fraction: float = Field(
        1 / 3,
        gt=0.0,
        le=1.0,
        description="The share of train.epochs (rounded up) a draft trained again from the "
        "current one trains for: it starts near the new target (benchmarks/refresh.py: a "
        "third of the steps came within 3% of a draft trained from scratch on the fixture).",
    )
    samples: int | None = Field(
        None,
        ge=1,
        description="Samples the new target answers when the draft is trained again (from "
        "the draft it starts from, train.init_from), split evenly over the datasets; blank: "
        "all of them (per-sample reuse keeps whatever did not change).",
    )
