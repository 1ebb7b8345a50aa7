"""What a hidden-state backend provides (`HiddenStatesBackend`): its config section, the
target's features of token sequences (`open` -> `FeatureSource`), the servers it starts for a
stage, and its preflight checks; nothing about shards, files or training.

The hidden_states stage stores what `FeatureSource.features` returns (`eaglet.hidden_states.
stage`); online training trains on it as it comes (`eaglet.draft.online`). Both open the
backend the same way: `open(target, settings, aux_layer_ids)` inside `serving(config, ...)`.

A backend's module is imported with the configuration (its section is a field of
`hidden_states`, `eaglet.config`): it imports torch, httpx and the target's code only inside
the functions that use them, so loading a config stays fast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from eaglet.config_fields import Strict


class Sample(Protocol):
    """What features are computed of: token ids, and the name errors call them by (an
    `eaglet.records.examples.Example`, or a `Window` of one)."""

    sample_id: str
    input_ids: list[int]


@dataclass(frozen=True)
class Window:
    """The token ids online training needs features of: a sample's prefix up to the end of
    one training window, named `<sample_id>[:<end>]`."""

    sample_id: str
    input_ids: list[int]


class FeatureSource(Protocol):
    def features(
        self, samples: Sequence[Sample], on_tokens: Callable[[int], None] | None = None
    ) -> list[dict[str, Any]]:
        """Per sample, in the order given: `aux_hidden_states` [n, k·H] (the k layers asked
        for, concatenated in order) and `final_hidden_states` [n, H] (after the target's final
        norm), float32 tensors on the CPU; `on_tokens(n)` as each n tokens are done."""

    def close(self) -> None:
        """Release what `open` took (clients; a loaded model stays cached in the process)."""


class BackendSettings(Strict):
    """A backend's config section, `hidden_states.<name>`; its docstring is the section's
    description in the form."""

    def problem_when_chosen(self) -> str | None:
        """Why these settings cannot run as the chosen backend (a config error), or None."""
        return None


class HiddenStatesBackend(Protocol):
    name: str
    settings: type[BackendSettings]  # its config section, `hidden_states.<name>`
    served: bool  # features come from servers: online training fetches them ahead of the trainer

    def open(self, target: Any, settings: Any, aux_layer_ids: list[int]) -> FeatureSource:
        """A source of the target's features at `aux_layer_ids` (eaglet's convention) for
        `target` (`TargetConfig`) and `settings` (`HiddenStatesConfig`: its own section is
        `settings.<name>`)."""

    def serving(
        self, config: Any, folder: Path, report: Callable[[str], None]
    ) -> AbstractContextManager[Any]:
        """`config` (`PipelineConfig`) as a stage runs it while the servers this backend starts
        for it are up (their logs and files in `folder`, stopped when the context closes);
        `config` itself when it starts none."""

    def preflight(self, config: Any, report: Any) -> None:
        """Its checks before any stage, each line naming its `hidden_states.<name>.<key>`:
        appended to `report.problems`, `.warnings` or `.passed` (`eaglet.preflight`)."""
