"""`PipelineConfig`: the whole configuration of one run, every section in its field, and the
rules that span sections (the demo's evaluation sets go with the demo's datasets; no two
datasets read the same data). Each section's fields live in the module named as its key.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator, model_validator

from eaglet.config.datasets import DatasetSpec
from eaglet.config.evaluate import DEMO_EVAL_SETS, EvaluateConfig
from eaglet.config.execution import ExecutionConfig
from eaglet.config.generation import GenerationConfig
from eaglet.config.hidden_states import HiddenStatesConfig
from eaglet.config.reasoning import ReasoningConfig
from eaglet.config.refresh import RefreshConfig
from eaglet.config.target import TargetConfig
from eaglet.config.tokenize import TokenizeConfig
from eaglet.config.train import TrainConfig
from eaglet.config_fields import Strict


class PipelineConfig(Strict):
    """Everything one eaglet run needs. Each stage reads only its own sub-model."""

    model_config = ConfigDict(title="eaglet config")  # the UI form's heading

    name: str = Field("demo", description="Run name, shown in Prefect and in reports.")
    work_dir: str = Field("runs/demo", description="Folder for every stage's outputs.")
    target: TargetConfig = Field(
        default_factory=TargetConfig, description="The model the draft is trained for."
    )
    datasets: list[DatasetSpec] = Field(
        default_factory=lambda: [
            DatasetSpec(source="arith", path="runs/demo/data/arith.jsonl"),
            DatasetSpec(source="tools", path="runs/demo/data/tools.jsonl"),
            DatasetSpec(source="mixed", path="runs/demo/data/mixed.parquet"),
        ],
        description="Datasets to regenerate answers for.",
    )

    @model_validator(mode="before")
    @classmethod
    def _demo_sets_with_the_demo_data(cls, data: Any) -> Any:
        """The demo is the defaults: with the demo's datasets (left unset), evaluate.sets
        defaults to the demo's evaluation sets; with any datasets of your own, to none."""
        if not isinstance(data, dict) or "datasets" in data:
            return data
        evaluate = data.get("evaluate")
        if evaluate is None or (isinstance(evaluate, dict) and "sets" not in evaluate):
            data = {**data, "evaluate": {**(evaluate or {}), "sets": DEMO_EVAL_SETS}}
        return data

    tokenize: TokenizeConfig = Field(
        default_factory=TokenizeConfig, description="Chat-template rendering of the prompts."
    )
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig,
        description="How the target answers: the engine, its servers, sampling and limits.",
    )
    reasoning: ReasoningConfig = Field(
        default_factory=ReasoningConfig,
        description="How reasoning is split from the answer, and the quality gate.",
    )
    hidden_states: HiddenStatesConfig = Field(
        default_factory=HiddenStatesConfig,
        description="The target's features the draft learns from: layers, backend, storage.",
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="Draft training.")
    evaluate: EvaluateConfig = Field(
        default_factory=EvaluateConfig,
        description="Acceptance length of the trained draft on held-out prompts.",
    )
    execution: ExecutionConfig = Field(
        default_factory=ExecutionConfig,
        description="Where the stages run: task runner, Dask cluster.",
    )
    refresh: RefreshConfig = Field(
        default_factory=RefreshConfig,
        description="When the target changes: how far τ may fall before the draft is trained "
        "again, and on how many samples.",
    )

    @field_validator("datasets")
    @classmethod
    def _unique_sources(cls, datasets: list[DatasetSpec]) -> list[DatasetSpec]:
        tags = [d.source for d in datasets]
        duplicated = sorted({t for t in tags if tags.count(t) > 1})
        if duplicated:
            raise ValueError(f"dataset source tags must be unique; repeated: {duplicated}")
        seen: dict[tuple, int] = {}
        for i, spec in enumerate(datasets):
            what = (spec.path, spec.name, spec.split, spec.revision)
            if what in seen:
                raise ValueError(
                    f"datasets {seen[what]} and {i} read the same data ({spec.path}) under two "
                    "source tags: every row would be trained on twice; keep one"
                )
            seen[what] = i
        return datasets
