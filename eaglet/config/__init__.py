"""The pipeline's configuration: one pydantic model, `PipelineConfig`, and how to load it.

`PipelineConfig` is the flow's parameter (the Prefect UI renders it as a form) and loads from
YAML with `--set a.b=value` overrides. Every model forbids unknown keys, so a typo is an error
that names the key instead of a silently ignored setting.

One module per section, named as its key, holds the section's fields and its own rules:
`datasets`, `target`, `tokenize`, `generation`, `reasoning`, `hidden_states`, `train`,
`evaluate`, `execution`; `pipeline` puts them together (`PipelineConfig`), `loading` reads a
file and overrides into one (`load_config`, `ConfigError`), `spellings` holds the older
spellings of keys that still load. What every section is made of (the strict base model, URL
fields, the `CACHE_NEUTRAL` mark, a started vLLM server's settings) is `eaglet.config_fields`,
apart from this package so that a section declared elsewhere (a hidden-state backend's) is
built from the same parts without loading the whole configuration. A module that reads one or
two sections may import them from their modules; every name is also importable from
`eaglet.config`.
"""

from __future__ import annotations

from eaglet.config.datasets import DatasetSpec
from eaglet.config.evaluate import DEMO_EVAL_SETS, EvalSet, EvaluateConfig
from eaglet.config.execution import ExecutionConfig
from eaglet.config.generation import GenerationConfig, SamplingChoice
from eaglet.config.hidden_states import HiddenStatesConfig
from eaglet.config.loading import (
    ConfigError,
    apply_overrides,
    load_config,
    parse_override,
    resolve_paths,
)
from eaglet.config.pipeline import PipelineConfig
from eaglet.config.reasoning import ReasoningConfig
from eaglet.config.refresh import RefreshConfig
from eaglet.config.spellings import FLAT_BACKEND_KEYS, OLDER_SPELLINGS, DeprecatedSpelling
from eaglet.config.target import TargetConfig
from eaglet.config.tokenize import TokenizeConfig
from eaglet.config.train import DFlashSettings, DSparkSettings, TrainConfig
from eaglet.config_fields import bounds_text, is_cache_neutral  # re-exported (docs, tests)

__all__ = [
    "DEMO_EVAL_SETS",
    "FLAT_BACKEND_KEYS",
    "OLDER_SPELLINGS",
    "DeprecatedSpelling",
    "ConfigError",
    "DFlashSettings",
    "DSparkSettings",
    "DatasetSpec",
    "EvalSet",
    "EvaluateConfig",
    "ExecutionConfig",
    "GenerationConfig",
    "HiddenStatesConfig",
    "PipelineConfig",
    "ReasoningConfig",
    "RefreshConfig",
    "SamplingChoice",
    "TargetConfig",
    "TokenizeConfig",
    "TrainConfig",
    "apply_overrides",
    "bounds_text",
    "is_cache_neutral",
    "load_config",
    "parse_override",
    "resolve_paths",
]
