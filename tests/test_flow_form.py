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
