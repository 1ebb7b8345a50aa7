"""What every generation engine is: prompts in, token-exact `Generation` records out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)


class Engine(Protocol):
    name: str

    def generate(self, prompts: Iterable[Prompt]) -> Iterator[Generation]:
        """Yield one record per prompt, in any order, as soon as each is finished."""
        ...
