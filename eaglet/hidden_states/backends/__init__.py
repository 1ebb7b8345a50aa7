"""Hidden-state backends: what computes the target's features (`hidden_states.backend`), one
module per backend.

`BACKENDS` is the one list: a backend's name and the module that defines its `BACKEND` (an
`eaglet.hidden_states.backends.base.HiddenStatesBackend`). Adding a backend is its module and
one line here: its config section (`hidden_states.<name>`, the module's `settings`), the
hidden_states stage, online training, the servers a stage starts and the preflight all go
through it, so the rest of the code never asks which backend this is. Modules are named by
path, as engines (`eaglet.engines.registry`) and draft methods (`eaglet.draft.methods`) are, so
a stage's code key holds the chosen backend's module only: a fix to the vLLM client never
re-keys what the hf backend extracted.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from eaglet.hidden_states.backends.base import HiddenStatesBackend

BACKENDS: dict[str, str] = {
    "hf": "eaglet.hidden_states.backends.hf",
    "vllm": "eaglet.hidden_states.backends.vllm",
}
if TYPE_CHECKING:
    BackendName = str
else:
    BackendName = Literal[tuple(BACKENDS)]  # the config's choices (the form's enum)


def hidden_states_backend(name: str) -> HiddenStatesBackend:
    """The backend called `name` (a `hidden_states.backend` value)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown hidden-state backend {name!r}; one of {', '.join(BACKENDS)}")
    return importlib.import_module(BACKENDS[name]).BACKEND
