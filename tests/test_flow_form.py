"""The UI's run form for the pipeline flow: every top-level parameter has a description (read
by Prefect from the flow's docstring), and so does every config field."""

from __future__ import annotations

from prefect.utilities.callables import parameter_schema

from eaglet_prefect.flows.pipeline import pipeline


def test_every_top_level_parameter_of_the_form_is_described():
    schema = parameter_schema(pipeline)
    assert set(schema.properties) == {
        "config", "config_path", "until", "refresh_from", "retry_failed"
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
