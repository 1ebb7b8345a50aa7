"""What every generation engine is: prompts in, token-exact `Generation` records out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt

if TYPE_CHECKING:
    from eaglet.config.generation import GenerationConfig


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)

    @classmethod
    def from_generation(cls, generation: GenerationConfig) -> SamplingParams:
        """What every engine samples with, read once from `generation.*`; each engine sends
        it in its own wire format."""
        return cls(
            max_tokens=generation.max_tokens,
            temperature=generation.temperature,
            top_p=generation.top_p,
            seed=generation.seed,
            stop=list(generation.stop),
        )

    def for_prompt(self, prompt: Prompt) -> SamplingParams:
        """What `prompt` is sampled with: its sampling plan entry's temperature and top_p
        (`Prompt.sampling`, eaglet/sampling_plan.py), else these."""
        if prompt.sampling is None:
            return self
        return replace(
            self, temperature=prompt.sampling["temperature"], top_p=prompt.sampling["top_p"]
        )


class Engine(Protocol):
    name: str

    def generate(self, prompts: Iterable[Prompt]) -> Iterator[Generation]:
        """Yield one record per prompt, in any order, as soon as each is finished."""
        ...
