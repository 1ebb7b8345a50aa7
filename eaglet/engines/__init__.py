"""Generation engines: `make_engine` picks the one the config names."""

from __future__ import annotations

from eaglet.config import PipelineConfig
from eaglet.engines.base import Engine, SamplingParams


def sampling_params(config: PipelineConfig) -> SamplingParams:
    gen = config.generation
    return SamplingParams(
        max_tokens=gen.max_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        seed=gen.seed,
        stop=list(gen.stop),
    )


def make_engine(config: PipelineConfig, tokenizer=None, api_key: str | None = None) -> Engine:
    """The engine `generation.engine` names; HTTP engines need the target's tokenizer, and
    `api_key` overrides `generation.api_key_env` (a key read from a secret store)."""
    engine = config.generation.engine
    if engine == "local":
        from eaglet.engines.local import LocalEngine

        return LocalEngine(
            config.target.model,
            sampling_params(config),
            batch_size=config.generation.batch_size,
            dtype=config.target.dtype,
            trust_remote_code=config.target.trust_remote_code,
            revision=config.target.revision,
        )
    from eaglet.engines.http import make_http_engine

    return make_http_engine(config, tokenizer, api_key=api_key)
