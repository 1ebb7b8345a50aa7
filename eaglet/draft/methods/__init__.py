"""Draft methods: which kind of draft a run trains (`train.method`), one module per method.

The table of names is `eaglet.draft.methods.registry` (re-exported here); each module defines
its `METHOD`, an `eaglet.draft.methods.base.DraftMethod`. The config's choices, the trainer,
the evaluator, the exports and the served check all go through it, so the rest of the code
never asks which method this is.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from eaglet.draft.methods.registry import DEFAULT_METHOD, METHODS, MethodName

if TYPE_CHECKING:
    from eaglet.draft.methods.base import DraftMethod

__all__ = ["DEFAULT_METHOD", "METHODS", "MethodName", "draft_method", "method_of_draft"]


def draft_method(name: str) -> DraftMethod:
    """The method called `name` (a `train.method` value)."""
    if name not in METHODS:
        raise ValueError(f"unknown draft method {name!r}; one of {', '.join(METHODS)}")
    method: DraftMethod = importlib.import_module(METHODS[name]).METHOD
    return method


def method_of_draft(config_json: Mapping[str, object]) -> DraftMethod:
    """The method of a saved draft, from its config.json: eaglet's own label, else the first
    method whose format it is (`DraftMethod.reads`), else the default's (EAGLE-3's formats)."""
    label = config_json.get("eaglet")
    name = label.get("method") if isinstance(label, dict) else None
    if isinstance(name, str):
        return draft_method(name)
    for candidate in METHODS:
        if candidate != DEFAULT_METHOD and draft_method(candidate).reads(config_json):
            return draft_method(candidate)
    return draft_method(DEFAULT_METHOD)
