"""Loading a config: the YAML file (a key written twice is refused), `--set a.b=value`
overrides (an older spelling respelt, `eaglet.config.spellings`), relative paths made
absolute (`resolve_paths`), and validation errors said as one `ConfigError` naming each key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from eaglet.config.pipeline import PipelineConfig
from eaglet.config.spellings import current_path
from eaglet.config_fields import is_local_path
from eaglet.errors import PermanentError
from eaglet.hidden_states.backends import BACKENDS
from eaglet.local_paths import absolute, is_hub_dataset, is_hub_id


class ConfigError(PermanentError, ValueError):
    """A configuration file or override that cannot be used; the message says where and why."""


def _format_validation_error(error: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration in {origin}:"]
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"  unknown key '{where}'")
        else:
            lines.append(f"  {where}: {item['msg']}")
    return "\n".join(lines)


def parse_override(override: str) -> tuple[list[str], Any]:
    """Split 'a.b=value' into (['a', 'b'], value), the value parsed as YAML (so 3, true, [..])."""
    if "=" not in override:
        raise ConfigError(f"override '{override}' is not of the form key.path=value")
    dotted, raw = override.split("=", 1)
    path = [part for part in dotted.strip().split(".") if part]
    if not path:
        raise ConfigError(f"override '{override}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        raise ConfigError(
            f"override '{override}': the value is not valid YAML ({problem}); quote it, e.g. "
            f"{dotted}='\"...\"'"
        ) from None
    return path, value


def _list_index(override: str, path: list[str], depth: int, items: list) -> int:
    """The list index `path[depth]` names, or a ConfigError naming the override."""
    where = ".".join(path[:depth]) or "(top level)"
    part = path[depth]
    try:
        index = int(part)
    except ValueError:
        raise ConfigError(
            f"override '{override}': '{where}' is a list; '{part}' is not an index (use "
            f"{where}.0, {where}.1, ...)"
        ) from None
    if not -len(items) <= index < len(items):
        raise ConfigError(
            f"override '{override}': '{where}' has {len(items)} item(s); index {index} is out "
            f"of range (valid: 0..{len(items) - 1}; to add an item, set the whole list: "
            f"{where}=[...])"
        )
    return index


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for override in overrides:
        path, value = parse_override(override)
        path = current_path(path)
        node: Any = data
        for depth, part in enumerate(path[:-1]):
            if isinstance(node, list):
                node = node[_list_index(override, path, depth, node)]
            else:
                if part not in node or node[part] is None:
                    node[part] = {}
                node = node[part]
            if not isinstance(node, dict | list):
                raise ConfigError(
                    f"override '{override}': '{'.'.join(path[: depth + 1])}' is not a section"
                )
        if isinstance(node, list):
            node[_list_index(override, path, len(path) - 1, node)] = value
        else:
            node[path[-1]] = value
    return data


def resolve_paths(config: PipelineConfig, base: str | Path) -> PipelineConfig:
    """The config with its relative local paths made absolute against `base` (the folder of
    the config file they were written in): `work_dir`, a hidden-state backend's local paths
    (`hidden_states.vllm.connector_path`: its section's fields marked `LOCAL_PATH`), and a
    `target.model` or dataset `path` unless it is a hub id (eaglet/local_paths.py: the one
    rule; a local folder that does not exist yet is still local)."""
    base = Path(base).expanduser().absolute()

    def located(path: str) -> str:  # a dataset or evaluation-set file, or a hub dataset id
        return absolute(path, base, hub_id=is_hub_dataset(path, base))

    updates: dict[str, Any] = {"work_dir": absolute(config.work_dir, base, hub_id=False)}
    target = config.target
    model = absolute(target.model, base, hub_id=is_hub_id(target.model, base))
    updates["target"] = target.model_copy(update={"model": model})
    updates["datasets"] = [d.model_copy(update={"path": located(d.path)}) for d in config.datasets]
    sections = {}
    for name in BACKENDS:
        section = getattr(config.hidden_states, name)
        paths = {
            key: absolute(value, base, hub_id=False)
            for key, field in type(section).model_fields.items()
            if is_local_path(field) and (value := getattr(section, key))
        }
        if paths:
            sections[name] = section.model_copy(update=paths)
    if sections:
        updates["hidden_states"] = config.hidden_states.model_copy(update=sections)
    sets = [s.model_copy(update={"path": located(s.path)}) for s in config.evaluate.sets]
    updates["evaluate"] = config.evaluate.model_copy(update={"sets": sets})
    return config.model_copy(update=updates)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (plain YAML keeps the
    last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice (lines {seen[key]} and {line}); keep one",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> PipelineConfig:
    """Read a YAML file (or the defaults when `path` is None) and apply `a.b=value` overrides.

    Relative paths written in the file resolve against the file's folder; those given in
    overrides (or left at their defaults) against the current directory. The config returned
    holds absolute paths, so the copy a run saves (`WORK_DIR/config.yaml`) works from
    anywhere."""
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        try:
            loaded = yaml.load(Path(path).read_text(encoding="utf-8"), _UniqueKeyLoader)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except IsADirectoryError:
            raise ConfigError(f"{path} is a folder; give the path of a YAML config file") from None
        except UnicodeDecodeError as exc:
            problem = f"{exc.reason} at byte {exc.start}"
            raise ConfigError(f"{path}: not UTF-8 text ({problem})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is None and not overrides:
            raise ConfigError(
                f"{path}: the file is empty; write at least `name:` and the keys that differ "
                "from the defaults (`eaglet demo` runs the defaults)"
            )
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys")
        data = loaded or {}  # empty with --set overrides: every value is in the overrides
    try:
        config = PipelineConfig.model_validate(data)
        if path is not None:
            config = resolve_paths(config, Path(path).parent)
        if overrides:
            origin += " with overrides " + " ".join(overrides)
            said = [parse_override(o)[0] for o in overrides]
            sets_said = "sets" in (data.get("evaluate") or {}) or any(
                p[:2] == ["evaluate", "sets"] or p == ["evaluate"] for p in said
            )
            data = apply_overrides(config.model_dump(), overrides)
            if any(p[0] == "datasets" for p in said) and not sets_said:
                data["evaluate"]["sets"] = []  # the demo's sets go with the demo's datasets
            config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, origin)) from None
    return resolve_paths(config, Path.cwd())
