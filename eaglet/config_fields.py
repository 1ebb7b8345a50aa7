"""What every config section is made of: the strict base model (unknown keys refused, a form
field left blank read as None, bounds said in the form), server URL fields, the mark of a
field that changes how fast or where a stage runs, never what it writes (`CACHE_NEUTRAL`), and
the settings of a vLLM server eaglet starts (`VllmServerSettings`), wherever it starts one.

Apart from `eaglet.config` so that a section declared elsewhere (a hidden-state backend's,
`eaglet.hidden_states.backends`) is built from the same parts without importing the whole
configuration, which imports it.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonDict


def base_url(url: str) -> str:
    """A server's base URL as eaglet joins paths to it: `http(s)://host:port[/prefix]`, with no
    trailing `/` and no trailing `/v1` (the base URL OpenAI clients take; eaglet adds `/v1/...`
    itself, so both spellings name the same server)."""
    url = url.strip()
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    if "?" in url or "#" in url:
        raise ValueError(
            f"{url.split('?', 1)[0].split('#', 1)[0]} has a query or fragment: eaglet joins "
            "paths such as /v1/completions to a base URL, so a query would land in the middle "
            "of every request's URL; give a token through the engine's api_key settings"
        )
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


BaseUrl = Annotated[str, AfterValidator(base_url)]

# Marks a field that changes how fast or where a stage runs, never what it writes: a stage's
# cache key leaves it out (eaglet.cache), so changing it reuses every finished stage. The UI
# form's schema carries the mark too.
CACHE_NEUTRAL: JsonDict = {"cache_neutral": True}


def is_cache_neutral(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("cache_neutral") is True


# Marks a local file or folder path in a section declared outside `eaglet.config` (a hidden-state
# backend's): relative, it resolves against the folder of the config file it was written in
# (`eaglet.config.resolve_paths`), as the config's own paths do. Combine marks with `|`.
LOCAL_PATH = {"local_path": True}


def is_local_path(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("local_path") is True


def bounds_text(prop: dict[str, Any]) -> str:
    """A number field's bounds in words (`1 to 1000`, `at least 0`, `above 0 and at most 1`),
    read from its JSON schema (an optional field's from the number branch); empty if none."""
    words = {
        "minimum": "at least",
        "exclusiveMinimum": "above",
        "maximum": "at most",
        "exclusiveMaximum": "below",
    }
    for branch in [prop, *prop.get("anyOf", [])]:
        said = [(key, branch[key]) for key in words if key in branch]
        if [key for key, _ in said] == ["minimum", "maximum"]:
            return f"{said[0][1]:g} to {said[1][1]:g}"
        if said:
            return " and ".join(f"{words[key]} {value:g}" for key, value in said)
    return ""


def _say_bounds(schema: dict[str, Any]) -> None:
    """The Prefect UI's form shows a field's description, never its schema's bounds: the
    description says them."""
    for prop in schema.get("properties", {}).values():
        bounds = bounds_text(prop)
        if bounds and prop.get("description"):
            prop["description"] = f"{prop['description'].rstrip()} Range: {bounds}."


def _blank_means_none(schema: dict[str, Any]) -> None:
    """The Prefect UI's form shows an optional field (`str | None`, `int | None`) as a type/None
    toggle; its schema here has only the value's type and no null default, so the form shows
    one plain input, left blank for None (an enum gets a blank first choice). Prefect's
    parameter check still takes null for it: an optional property without a default may be
    null there (`prefect.utilities.schema_tools.validation`)."""
    for prop in schema.get("properties", {}).values():
        options = prop.get("anyOf", [])
        if not any(option.get("type") == "null" for option in options):
            continue
        kept = [option for option in prop.pop("anyOf") if option.get("type") != "null"]
        if len(kept) == 1:
            prop.update(kept[0])
        else:
            prop["anyOf"] = kept
        if "const" in prop:
            prop["enum"] = [prop.pop("const")]
        if "enum" in prop:  # the form shows the strings; null stays valid for Prefect's check
            prop["enum"] = ["", *prop["enum"], None]
        if "default" in prop and prop["default"] is None:
            del prop["default"]


def _form_schema(schema: dict[str, Any], model: type) -> None:
    _blank_means_none(schema)
    _say_bounds(schema)
    if isinstance(model, type) and issubclass(model, VllmServerSettings):
        for name in VllmServerSettings.model_fields:  # after the section's own fields
            schema["properties"][name] = schema["properties"].pop(name)


def is_blank(value: Any) -> bool:
    """What a form field left blank sends: an empty or all-space text, or an empty list."""
    return (isinstance(value, str) and not value.strip()) or value == []


def _is_number(annotation: Any) -> bool:
    """An int or float field (optional or not): pydantic reads true as 1 there."""
    kinds = get_args(annotation) or (annotation,)
    return bool not in kinds and any(kind in (int, float) for kind in kinds)


class Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, json_schema_extra=_form_schema
    )

    @model_validator(mode="before")
    @classmethod
    def _blank_is_none(cls, data: Any) -> Any:
        """A blank value of a field whose default is None (a form field left blank) is None."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        for key, value in data.items():
            if isinstance(value, bool) and key in fields and _is_number(fields[key].annotation):
                raise ValueError(
                    f"{key}: {str(value).lower()} is a yes/no value, not a number: write the "
                    "number you mean"
                )
        return {
            key: None
            if key in fields and fields[key].default is None and is_blank(value)
            else value
            for key, value in data.items()
        }


class VllmServerSettings(Strict):
    """A vLLM server eaglet starts itself, the same keys in every section that can start one
    (`hidden_states.vllm`, `evaluate`): the python of vLLM's venv, more flags, and how long it
    may take to be healthy. The section adds what it serves and with what; the form shows these
    keys after the section's own."""

    vllm_python: str | None = Field(
        None,
        description="The python of a vLLM venv on this machine (vLLM's own venv). Set, eaglet "
        "starts the vLLM server this section needs itself, for the target, instead of using "
        "a running one, and stops it when done.",
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="More flags for the server eaglet starts (e.g. --enforce-eager, "
        "--tensor-parallel-size 8, --max-model-len 32768).",
    )
    startup_timeout_s: float = Field(
        900.0,
        gt=0.0,
        le=86_400.0,
        description="Seconds the server eaglet starts may take to be healthy.",
        json_schema_extra=CACHE_NEUTRAL,
    )
