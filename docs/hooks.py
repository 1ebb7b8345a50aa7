"""The documentation site's build hooks (mkdocs.yml `hooks:`), so the pages cannot go stale:

- The config reference: `docs/config.md` holds a marker that each build replaces with tables
  generated from `eaglet.config.PipelineConfig` (every field: name, type, default, bounds,
  description, nested sections), the model the YAML, `--set` and the UI form read.
- Config keys: every key a page or README.md names in backticks (`generation.max_tokens`,
  `train.hidden_states: online`, `train.dflash.{block_size, anchors}`) whose first part is a
  PipelineConfig section, and every key of a YAML block that is a config, must exist in
  PipelineConfig. An older spelling a config still loads (`hidden_states.endpoints` for
  `hidden_states.vllm.endpoints`: `eaglet.config.OLDER_SPELLINGS`) passes too.
- Links: benchmarks/README.md and tests/reliability/README.md are pages of the site too. A
  link written for GitHub (relative to the file in the repository) is rewritten to the site's
  page; one to another repository file becomes its path in code; one to nothing fails. README's
  links into docs/ must name an existing page and heading.

Any problem fails the build (`mkdocs build`, strict or not) with one line per problem.
"""

from __future__ import annotations

import json
import posixpath
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

# Repository files shown as pages of the site: repository path -> page in the site.
EXTERNAL_PAGES = {
    "benchmarks/README.md": "benchmarks.md",
    "tests/reliability/README.md": "reliability.md",
}
MARKER = "<!-- eaglet: config reference -->"
FILE_SUFFIXES = {
    "py", "json", "jsonl", "yaml", "yml", "md", "png", "svg", "txt", "log", "toml", "safetensors",
    "parquet", "lock", "partial",
}  # fmt: skip

_state: dict[str, Any] = {}


def _problem(text: str) -> None:
    _state["problems"].append(text)


# --- the config model -------------------------------------------------------------------------


def _pipeline_config() -> type:
    root = _state["root"]
    if (root / "eaglet" / "config" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))  # this checkout's model, installed or not
    from eaglet.config import PipelineConfig

    return PipelineConfig


def _older_spellings() -> set[str]:
    """The dotted keys of an older spelling a config still loads (`eaglet.config.spellings`)."""
    import eaglet.config

    return set(getattr(eaglet.config, "OLDER_SPELLINGS", {}))


def _is_model(annotation: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _unwrap(annotation: Any) -> list[Any]:
    """The alternatives of an annotation: `X | None` -> [X, None], Annotated[X, ...] -> [X]."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [alt for arg in typing.get_args(annotation) for alt in _unwrap(arg)]
    return [annotation]


def _field_names(model: type) -> dict[str, Any]:
    """A model's keys (names and the aliases it also accepts) -> their fields."""
    names = {}
    for name, field in model.model_fields.items():
        names[name] = field
        for alias in (field.alias, field.validation_alias):
            choices = getattr(alias, "choices", [alias])
            for choice in choices:
                if isinstance(choice, str):
                    names[choice] = field
    return names


def _resolves(annotation: Any, parts: list[str]) -> bool:
    """Whether the dotted `parts` name something under a field of this type."""
    if not parts:
        return True
    for alt in _unwrap(annotation):
        origin = typing.get_origin(alt)
        if origin in (list, tuple, set, frozenset):
            (item, *_) = typing.get_args(alt) or (Any,)
            rest = parts[1:] if parts[0].isdigit() else parts
            if _resolves(item, rest):
                return True
        elif alt is dict or origin is dict or alt is Any:
            return True  # a mapping takes any key (tokenize.chat_template_kwargs)
        elif _is_model(alt):
            field = _field_names(alt).get(parts[0])
            if field is not None and _resolves(field.annotation, parts[1:]):
                return True
    return False


def _key_exists(parts: list[str]) -> bool:
    return _resolves(_state["config"], parts) or _older_spelling(parts)


def _older_spelling(parts: list[str]) -> bool:
    """A key in an older spelling a config still loads (`hidden_states.endpoints`), or a key
    inside one."""
    return any(".".join(parts[:n]) in _state["older_spellings"] for n in range(1, len(parts) + 1))


def _sections() -> set[str]:
    """PipelineConfig's fields that hold a model or a list of them (`train`, `datasets`)."""
    config = _state["config"]
    return {name for name, field in config.model_fields.items() if _nested_models(field.annotation)}


# --- config keys in pages ---------------------------------------------------------------------

FENCE = re.compile(r"^(```+|~~~+)([^\n]*)\n(.*?)^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
KEY = re.compile(r"^(?:--set\s+)?([a-z_][a-z0-9_]*(?:\.(?:[A-Za-z0-9_]+|\{[^}]*\}))+)(.*)$")


def _expand(key: str) -> list[list[str]]:
    """`train.dflash.{block_size, anchors}` -> [[train, dflash, block_size], [...anchors]]."""
    paths: list[list[str]] = [[]]
    for part in re.findall(r"\{[^}]*\}|[^.]+", key):
        options = [o.strip() for o in part.strip("{}").split(",")] if part[0] == "{" else [part]
        paths = [path + [option] for path in paths for option in options if option]
    return paths


def _check_inline_keys(text: str, where: str) -> None:
    sections = _state["sections"]
    for span in INLINE_CODE.findall(FENCE.sub("", text)):
        match = KEY.match(span.strip())
        if not match:
            continue
        key, rest = match.groups()
        if rest and rest[0] not in ":= ,)":
            continue  # a path (`train/<key>/`) or an expression, not a key
        for parts in _expand(key):
            if parts[0] not in sections or parts[-1] in FILE_SUFFIXES:
                continue
            if not _key_exists(parts):
                _problem(f"{where}: `{'.'.join(parts)}` is not a key of PipelineConfig")


def _yaml_paths(value: Any, prefix: list[str]) -> typing.Iterator[list[str]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield [*prefix, str(key)]
            yield from _yaml_paths(item, [*prefix, str(key)])
    elif isinstance(value, list):
        for item in value:
            yield from _yaml_paths(item, [*prefix, "0"])


def _check_yaml_blocks(text: str, where: str) -> None:
    config = _state["config"]
    for match in FENCE.finditer(text):
        if match.group(2).strip() not in ("yaml", "yml"):
            continue
        try:
            data = yaml.safe_load(match.group(3))
        except yaml.YAMLError as error:
            _problem(f"{where}: a YAML block does not parse: {error}")
            continue
        if not isinstance(data, dict) or not set(data) & set(config.model_fields):
            continue  # not a config file
        for parts in _yaml_paths(data, []):
            if not _resolves(config, parts) and not _older_spelling(parts):
                _problem(f"{where}: YAML key {'.'.join(parts)} is not a key of PipelineConfig")


# --- the config reference ---------------------------------------------------------------------


def _escape(text: str) -> str:
    text = " ".join(text.split())
    for char, escaped in (("\\", "\\\\"), ("|", "\\|"), ("*", "\\*"), ("[", "\\["), ("]", "\\]")):
        text = text.replace(char, escaped)
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def _type_text(annotation: Any, anchors: dict[type, str]) -> str:
    alts = _unwrap(annotation)
    optional = type(None) in alts
    words = []
    for alt in [a for a in alts if a is not type(None)]:
        origin = typing.get_origin(alt)
        if origin is typing.Literal:
            words.append("one of " + ", ".join(_value(v) for v in typing.get_args(alt)))
        elif origin in (list, tuple, set):
            (item, *_) = typing.get_args(alt) or (Any,)
            words.append("list of " + _type_text(item, anchors))
        elif alt is dict or origin is dict:
            words.append("mapping")
        elif _is_model(alt):
            words.append(f"[section](#{anchors[alt]})" if alt in anchors else alt.__name__)
        else:
            words.append(getattr(alt, "__name__", str(alt)))
    text = " or ".join(words)
    return f"{text}, or blank (null)" if optional else text


def _default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    try:
        value = field.get_default(call_default_factory=True, validated_data={})
    except TypeError:
        return "computed"
    if _is_model(type(value)):
        return "its table below"
    if value is None:
        return "blank (null)"
    if isinstance(value, list):
        value = [
            item.model_dump(mode="json", exclude_defaults=True) if _is_model(type(item)) else item
            for item in value
        ]
    return _value(value)


def _value(value: Any) -> str:
    """A value as YAML holds it: strings bare (quoted only when empty), the rest as JSON."""
    return _code(value if isinstance(value, str) and value else json.dumps(value))


def _bounds(field: Any) -> str:
    from eaglet.config import bounds_text

    schema_words = {
        "ge": "minimum",
        "gt": "exclusiveMinimum",
        "le": "maximum",
        "lt": "exclusiveMaximum",
    }
    prop = {}
    for meta in field.metadata:
        for attr, key in schema_words.items():
            if getattr(meta, attr, None) is not None:
                prop[key] = getattr(meta, attr)
    # bounds_text reads the JSON schema's key order: minimum first
    ordered = {key: prop[key] for key in schema_words.values() if key in prop}
    return bounds_text(ordered)


def _nested_models(annotation: Any) -> list[type]:
    found = []
    for alt in _unwrap(annotation):
        for arg in [alt, *typing.get_args(alt)]:
            if _is_model(arg) and arg not in found:
                found.append(arg)
    return found


def _slug(path: str) -> str:
    return "config-" + path.replace(".", "-").replace("_", "-")


def reference() -> str:
    """The config reference's markdown: one table per section, each nested section after it."""
    out: list[str] = []
    _section_tables("", _state["config"], _state["config"].__doc__ or "", False, out, set())
    return "\n".join(out)


def _section_tables(
    path: str, model: type, about: str, is_list: bool, out: list[str], seen: set[type]
) -> None:
    from eaglet.config import is_cache_neutral

    seen.add(model)
    title = _code(path) if path else "Top level"
    out += [f"{'#' * min(2 + path.count('.'), 6)} {title} {{#{_slug(path or 'top')}}}", ""]
    if about:
        out += [_escape(about), ""]
    if is_list:
        out += ["A list; each entry holds:", ""]
    out += ["| key | type | default | description |", "|---|---|---|---|"]
    nested: list[tuple[str, type, str, bool]] = []
    anchors: dict[type, str] = {}
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        for sub in _nested_models(field.annotation):
            if sub not in seen:
                anchors[sub] = _slug(key)
                listed = any(
                    typing.get_origin(a) in (list, tuple) for a in _unwrap(field.annotation)
                )
                nested.append((key, sub, field.description or "", listed))
        description = _escape(field.description or "")
        bounds = _bounds(field)
        if bounds:
            description += f" Range: {bounds}."
        if is_cache_neutral(field):
            description += " Not in any stage key: changing it re-runs nothing."
        out.append(
            f"| {_code(name)} | {_type_text(field.annotation, anchors)} | "
            f"{_default_text(field)} | {description.strip()} |"
        )
    out.append("")
    for key, sub, sub_about, listed in nested:
        if sub not in seen:
            _section_tables(key, sub, sub_about, listed, out, seen)


# --- links ------------------------------------------------------------------------------------

LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")


def _repo_path(src_uri: str) -> str:
    reverse = {page: repo for repo, page in EXTERNAL_PAGES.items()}
    return reverse.get(src_uri, f"docs/{src_uri}")


def _rewrite_links(markdown: str, src_uri: str, files: Files) -> str:
    here = posixpath.dirname(_repo_path(src_uri))
    site_dir = posixpath.dirname(src_uri)
    root: Path = _state["root"]

    def rewrite(match: re.Match) -> str:
        bang, text, target = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repo_target = posixpath.normpath(posixpath.join(here, path))
        site_target = None
        if repo_target.startswith("docs/") and files.get_file_from_path(repo_target[5:]):
            site_target = repo_target[5:]
        elif repo_target in EXTERNAL_PAGES:
            site_target = EXTERNAL_PAGES[repo_target]
        if site_target is not None:
            link = posixpath.relpath(site_target, site_dir or ".") + (
                f"#{anchor}" if anchor else ""
            )
            return f"{bang}[{text}]({link})"
        if (root / repo_target).exists() and not repo_target.startswith(("docs/", "../")):
            shown = f"`{repo_target}`"
            return shown if text.strip("`") in (path, repo_target) else f"{text} ({shown})"
        _problem(f"{_repo_path(src_uri)}: the link {target} names nothing in the repository")
        return match.group(0)

    return _rewrite_outside_fences(markdown, rewrite)


def _rewrite_outside_fences(markdown: str, rewrite: Any) -> str:
    out, last = [], 0
    for match in FENCE.finditer(markdown):
        out.append(LINK.sub(rewrite, markdown[last : match.start()]))
        out.append(match.group(0))
        last = match.end()
    out.append(LINK.sub(rewrite, markdown[last:]))
    return "".join(out)


# --- hooks ------------------------------------------------------------------------------------


def on_config(config: Any) -> Any:
    _state.clear()
    _state["root"] = Path(config.config_file_path).resolve().parent
    _state["problems"] = []
    _state["anchors"] = {}
    _state["config"] = _pipeline_config()
    _state["older_spellings"] = _older_spellings()
    _state["sections"] = _sections()
    return config


def on_files(files: Files, config: Any) -> Files:
    for repo_path, page in EXTERNAL_PAGES.items():
        source = _state["root"] / repo_path
        if not source.is_file():
            _problem(f"{repo_path} (a page of the site as {page}) does not exist")
            continue
        files.append(File.generated(config, page, abs_src_path=str(source)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    where = _repo_path(page.file.src_uri)
    if page.file.src_uri == "config.md":
        if MARKER not in markdown:
            _problem(f"{where}: the marker {MARKER} the config reference replaces is missing")
        markdown = markdown.replace(MARKER, reference())
    _check_inline_keys(markdown, where)
    _check_yaml_blocks(markdown, where)
    return _rewrite_links(markdown, page.file.src_uri, files)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    _state["anchors"][page.file.src_uri] = set(re.findall(r'\bid="([^"]+)"', html))
    return html


def on_post_build(config: Any) -> None:
    root: Path = _state["root"]
    readme = (root / "README.md").read_text()
    _check_inline_keys(readme, "README.md")
    _check_yaml_blocks(readme, "README.md")
    outside = FENCE.sub("", readme)
    for _, _, target in LINK.findall(outside):
        if re.match(r"^[a-z][a-z0-9+.-]*:|^#", target):
            continue
        path, _, anchor = target.partition("#")
        if not (root / path).exists():
            _problem(f"README.md: the link {target} names nothing in the repository")
        elif anchor and path.startswith("docs/") and path.endswith(".md"):
            if anchor not in _state["anchors"].get(path[5:], set()):
                _problem(f"README.md: the link {target}: {path} has no heading or anchor #{anchor}")
    problems = _state["problems"]
    if problems:
        raise PluginError(
            f"{len(problems)} problem(s) in the documentation:\n" + "\n".join(problems)
        )
