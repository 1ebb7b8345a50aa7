"""The one list of generation engines: a name → its class and the module that decides its
output (the cache key hashes that module's import closure). Every engine is built the same
way (`cls.from_config(config, tokenizer, **kwargs)`) and samples with
`SamplingParams.from_generation(config.generation)` (eaglet/engines/base.py), which it sends
in its own wire format.

Engine classes are imported lazily, by module path, when one is made: the registry imports no
engine, and no engine imports another (the HTTP base never imports its subclasses).
Add an engine by adding one `EngineSpec` here; `generation.engine` in the config accepts the
names listed (a test keeps the two in step).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from eaglet.config import PipelineConfig
from eaglet.engines.base import Engine


@dataclass(frozen=True)
class EngineSpec:
    name: str
    module: str  # where the class lives; its import closure keys the generate stage
    class_name: str
    needs_server: bool  # HTTP engines: the canary checks the server before generating

    def engine_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.class_name)


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec("local", "eaglet.engines.local", "LocalEngine", needs_server=False),
        EngineSpec("vllm", "eaglet.engines.vllm", "VLLMEngine", needs_server=True),
        EngineSpec("sglang", "eaglet.engines.sglang", "SGLangEngine", needs_server=True),
        EngineSpec("openai", "eaglet.engines.openai_chat", "OpenAIChatEngine", needs_server=True),
    )
}


def engine_spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(
            f"generation.engine={name!r} is not an engine; choose one of {', '.join(ENGINES)}"
        ) from None


def make_engine(config: PipelineConfig, tokenizer: Any = None, **kwargs: Any) -> Engine:
    """The engine `generation.engine` names, built by its `from_config(config, tokenizer,
    **kwargs)`: HTTP engines need the target's tokenizer and take `api_key` (a key read from a
    secret store, overriding `generation.api_key_env`), `end_ids` and `http_library`."""
    cls = engine_spec(config.generation.engine).engine_class()
    return cls.from_config(config, tokenizer, **kwargs)
