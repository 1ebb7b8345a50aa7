"""Varied sampling in regeneration: which `generation.sampling_plan` entry each row gets.

A draft trained only on greedy answers meets sampled ones when served. With a plan, each sample
is generated with one entry (temperature, top_p and, for templates that read it, reasoning
effort), chosen when the sample is tokenized, since the reasoning effort is part of the prompt:
`cycle` takes the entries in turn in the order of the samples; `weighted` draws one per sample
id (a hash of the id and `generation.seed`, so the choice does not depend on which rows were
kept). The choice is written into the prompt record (`Prompt.sampling`), so a resumed generate
stage sends what the first run sent; engines read it there, the generation record repeats it,
and the quality report counts rows per entry (`sampling_label`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from eaglet.config.generation import GenerationConfig, SamplingChoice


def choose(generation: GenerationConfig, sample_id: str, position: int) -> dict[str, Any] | None:
    """The row's sampling, from the plan (None without one): {"plan_entry", "temperature",
    "top_p"} and "reasoning_effort" when the entry sets one. `position`: the sample's index in
    the samples file (cycle)."""
    plan = generation.sampling_plan
    if not plan:
        return None
    if generation.sampling_plan_mode == "cycle":
        index = position % len(plan)
    else:
        index = _weighted_index(plan, f"{generation.seed}:{sample_id}")
    entry = plan[index]
    sampling: dict[str, Any] = {
        "plan_entry": index,
        "temperature": entry.temperature,
        "top_p": entry.top_p,
    }
    if entry.reasoning_effort:
        sampling["reasoning_effort"] = entry.reasoning_effort
    return sampling


def _weighted_index(plan: list[SamplingChoice], key: str) -> int:
    """An entry drawn in proportion to the weights by a uniform number made from `key`."""
    digest = hashlib.sha256(key.encode()).digest()
    point = int.from_bytes(digest[:8], "big") / 2**64 * sum(e.weight for e in plan)
    for index, entry in enumerate(plan):
        point -= entry.weight
        if point < 0:
            return index
    return len(plan) - 1


def template_kwargs(base: dict[str, Any], sampling: dict[str, Any] | None) -> dict[str, Any]:
    """The chat template arguments of a row: `tokenize.chat_template_kwargs` with the row's
    reasoning effort, when its plan entry sets one."""
    if sampling is None or "reasoning_effort" not in sampling:
        return base
    return {**base, "reasoning_effort": sampling["reasoning_effort"]}


def sampling_label(sampling: dict[str, Any] | None) -> str:
    """How the quality report names a row's setting: 'T=0.6 top_p=0.95 effort=high', or
    'generation settings' for rows generated without a plan."""
    if sampling is None:
        return "generation settings"
    label = f"T={sampling['temperature']:g} top_p={sampling['top_p']:g}"
    if "reasoning_effort" in sampling:
        label += f" effort={sampling['reasoning_effort']}"
    return label
