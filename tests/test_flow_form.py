"""The UI's run form for the pipeline flow: every top-level parameter has a description (read
by Prefect from the flow's docstring), and so does every config field."""

from __future__ import annotations

import pytest
from prefect.utilities.callables import parameter_schema
from pydantic import ValidationError

from eaglet.config import PipelineConfig, load_config
from eaglet_prefect.flows.pipeline import pipeline


def test_every_top_level_parameter_of_the_form_is_described():
    schema = parameter_schema(pipeline)
    assert set(schema.properties) == {
        "config", "config_path", "until", "refresh_from", "retry_failed", "plan_only"
    }  # fmt: skip
    for name, prop in schema.properties.items():
        assert prop.get("description"), f"{name} has no description in the UI form"


def test_every_config_field_is_described():
    schema = parameter_schema(pipeline).model_dump()
    undescribed = [
        f"{model}.{field}"
        for model, definition in schema["definitions"].items()
        for field, prop in definition.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert not undescribed, undescribed


def test_the_form_says_each_fields_bounds_in_its_description():
    """The UI shows descriptions, not JSON-schema bounds: every bounded field says them."""
    from eaglet.config import bounds_text

    definitions = parameter_schema(pipeline).model_dump()["definitions"]
    bounded = {
        f"{model}.{field}": prop
        for model, definition in definitions.items()
        for field, prop in definition.get("properties", {}).items()
        if bounds_text(prop)
    }
    assert len(bounded) > 40
    for name, prop in bounded.items():
        assert prop["description"].endswith(f"Range: {bounds_text(prop)}."), name
    epochs = definitions["TrainConfig"]["properties"]["epochs"]["description"]
    assert epochs.endswith("Range: 1 to 1000.")
    lr = definitions["TrainConfig"]["properties"]["lr"]["description"]
    assert lr.endswith("Range: above 0 and at most 1.")
    steps = definitions["TrainConfig"]["properties"]["max_steps"]["description"]  # optional
    assert steps.endswith("Range: at least 1.")


def test_the_full_form_has_no_toggles_and_prefect_takes_its_defaults():
    """No field of the `pipeline` form is nullable in its schema (Prefect's form would show a
    type/None toggle); an optional one shows as a plain input, blank for None. Prefect's own
    parameter check (the server's, for a run from a deployment) takes the form's defaults, and
    still refuses what the config refuses."""
    from prefect.utilities.schema_tools import validate

    from tests.form_schema_helpers import nullable_fields

    schema = parameter_schema(pipeline).model_dump()
    assert nullable_fields(schema) == []
    definitions = schema["definitions"]
    assert set(definitions["HiddenStatesConfig"]["properties"]) >= {"backend", "hf", "vllm"}
    hf, vllm = definitions["HFSettings"]["properties"], definitions["VllmSettings"]["properties"]
    assert hf["device_map"]["enum"] == ["", "auto", None]  # the form shows "" and "auto"
    assert "default" not in vllm["connector_path"]  # blank, not "null"
    defaults = {name: prop["default"] for name, prop in schema["properties"].items()}
    assert validate(defaults, schema, raise_on_error=True) == []
    defaults["config"]["train"]["threads"] = 0
    defaults["config"]["hidden_states"]["hf"]["device_map"] = "gpu"
    refused = validate(defaults, schema, ignore_required=True)
    assert sorted(error.json_path for error in refused) == [
        "$.config.hidden_states.hf.device_map", "$.config.train.threads"
    ]  # fmt: skip


def test_a_blank_optional_field_is_none(tmp_path):
    """What the form sends for an optional field left blank ("" or an empty list) reads as
    None, in the flow's config and in a YAML file alike; a blank required text stays an
    error."""
    config = PipelineConfig.model_validate(
        {
            "target": {"revision": "  "},
            "hidden_states": {"device_map": "", "aux_layer_ids": []},
            "train": {"init_from": "", "threads": None},
            "evaluate": {"serving_endpoint": ""},
        }
    )
    assert config.target.revision is None
    assert config.hidden_states.hf.device_map is None
    assert config.hidden_states.aux_layer_ids is None
    assert config.train.init_from is None
    assert config.evaluate.serving_endpoint is None
    assert config.train.threads is None
    config_file = tmp_path / "config.yaml"
    config_file.write_text("train:\n  init_from: ''\n  max_steps:\n")
    assert load_config(config_file).train.init_from is None
    with pytest.raises(ValidationError, match="source"):
        PipelineConfig.model_validate({"datasets": [{"source": " ", "path": "a.jsonl"}]})
