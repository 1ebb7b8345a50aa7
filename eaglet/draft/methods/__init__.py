"""Draft methods: which kind of draft a run trains (`train.method`), one module per method.

`METHODS` is the one list: a method's name and the module that defines its `METHOD` (a
`eaglet.draft.methods.base.DraftMethod`). Adding a method is its module and one line here; the
config's choices, the trainer, the evaluator, the exports and the served check all go through
it. Modules are named by path, as engines are (`eaglet.engines.registry`), so a stage's code
key holds the chosen method's module only: an edit to DFlash never re-keys an EAGLE-3 run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from eaglet.draft.methods.base import DraftMethod

METHODS: dict[str, str] = {
    "eagle3": "eaglet.draft.methods.eagle3",
    "dflash": "eaglet.draft.methods.dflash",
    "peagle": "eaglet.draft.methods.peagle",
}
MethodName = Literal[tuple(METHODS)]  # type: ignore[valid-type]  # the config's choices


def draft_method(name: str) -> DraftMethod:
    """The method called `name` (a `train.method` value)."""
    if name not in METHODS:
        raise ValueError(f"unknown draft method {name!r}; one of {', '.join(METHODS)}")
    return importlib.import_module(METHODS[name]).METHOD


def method_of_draft(config_json: dict) -> DraftMethod:
    """The method of a saved draft, from its config.json: eaglet's own label, else what the
    format says (a `dflash_config` is DFlash's, a `pard_token` P-EAGLE's; everything else
    EAGLE-3's formats)."""
    name = config_json.get("eaglet", {}).get("method")
    if name is None:
        formats = {"dflash_config": "dflash", "pard_token": "peagle"}
        name = next((m for key, m in formats.items() if key in config_json), "eagle3")
    return draft_method(name)
