"""Older spellings of config keys, the one place they are written: each still loads (a config
file's key, a section built in code, a `--set` override), read as the key it is now, with one
deprecation line (`DeprecatedSpelling`). Never extended but by a rename: a new key has one
spelling.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import BaseModel

# older dotted key -> the key that holds its value now
OLDER_SPELLINGS: dict[str, str] = {
    # keys hidden_states held itself before each backend had its section (issue 35)
    "hidden_states.device_map": "hidden_states.hf.device_map",
    **{
        f"hidden_states.{key}": f"hidden_states.vllm.{key}"
        for key in (
            "endpoints",
            "connector_path",
            "served_model",
            "concurrency",
            "request_timeout_s",
            "vllm_python",
            "vllm_args",
            "startup_timeout_s",
        )
    },
    # one settings model for every vLLM server eaglet starts (`VllmServerSettings`)
    "evaluate.serving_startup_timeout_s": "evaluate.startup_timeout_s",
}

# A backend's keys older configs wrote in `hidden_states` itself -> that backend: a stage key
# holds them flat, as it did then (`eaglet.cache.hidden_states_keyed`).
FLAT_BACKEND_KEYS: dict[str, str] = {
    old.split(".")[1]: new.split(".")[1]
    for old, new in OLDER_SPELLINGS.items()
    if old.startswith("hidden_states.")
}


class DeprecatedSpelling(FutureWarning):
    """A config key written in a spelling that still loads and will be removed."""


def warn_older_spelling(old: str) -> str:
    """The deprecation line of the older key `old` (dotted); the key it is read as."""
    new = OLDER_SPELLINGS[old]
    kind = "flat" if new.count(".") > old.count(".") else "older"
    warnings.warn(
        f"{old} is the older spelling of {new}: it is read as {new}; write it there (the "
        f"{kind} spelling is deprecated and will be removed)",
        DeprecatedSpelling,
        stacklevel=2,
    )
    return new


def current_path(path: list[str]) -> list[str]:
    """An override's key path as the config holds it now (`hidden_states.endpoints` ->
    `hidden_states.vllm.endpoints`), the deprecation said when it was an older one."""
    for depth in range(len(path), 0, -1):
        old = ".".join(path[:depth])
        if old in OLDER_SPELLINGS:
            return warn_older_spelling(old).split(".") + path[depth:]
    return path


def move_older_keys(section_module: str, data: Any) -> Any:
    """A section's raw data with its keys of an older spelling moved where they live now; one
    written in both places with two values is an error (which would win is anybody's guess).
    `section_module`: the section's module, named as its key (`eaglet.config.evaluate`)."""
    section = section_module.rsplit(".", 1)[-1]
    older = {o.removeprefix(f"{section}."): n for o, n in OLDER_SPELLINGS.items()
             if o.startswith(f"{section}.")}  # fmt: skip
    if not isinstance(data, dict) or not any(key in data for key in older):
        return data
    data = dict(data)
    for key in [key for key in data if key in older]:
        value, new = data.pop(key), warn_older_spelling(f"{section}.{key}")
        *sections, name = new.split(".")[1:]
        node = data
        for part in sections:  # the new key's sections, copied before they change
            inner = node.get(part)
            if isinstance(inner, BaseModel):
                inner = inner.model_dump(exclude_unset=True)
            node[part] = node = dict(inner or {})
        if name in node and node[name] != value:
            raise ValueError(
                f"{section}.{key} (the older spelling) and {new} are both set, to {value!r} "
                f"and {node[name]!r}: keep {new}"
            )
        node[name] = value
    return data
