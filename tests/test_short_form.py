"""The short form (`eaglet.short_form`, the `pipeline-short-form` deployment): ten described
fields and the plan-only switch, with no "unset" toggle, each a change over a base config that
a blank one keeps. The run of it from the Prefect UI is in tests/test_prefect_server.py."""

from __future__ import annotations

import pytest
import yaml
from prefect.utilities.callables import parameter_schema

from eaglet.config import ConfigError, load_config
from eaglet.short_form import ShortFormDataset, short_form_overrides
from eaglet_prefect.flows.short_form import short_form
from tests.conftest import ROOT
from tests.form_schema_helpers import nullable_fields


def test_the_short_form_has_ten_described_fields_a_plan_switch_and_no_toggles():
    schema = parameter_schema(short_form).model_dump()
    assert list(schema["properties"]) == [
        "target_model", "datasets", "engine", "endpoints", "served_model", "epochs",
        "work_dir", "until", "refresh_from", "config_path", "plan_only",
    ]  # fmt: skip
    assert schema["properties"]["plan_only"]["default"] is False
    assert not schema.get("required")  # every field may stay blank
    assert nullable_fields(schema) == []
    described = [
        *schema["properties"].items(),
        *schema["definitions"]["ShortFormDataset"]["properties"].items(),
    ]
    for name, prop in described:
        assert prop.get("description"), f"{name} has no description in the form"
    assert schema["properties"]["epochs"]["description"].endswith("Range: 0 to 1000.")
    assert schema["properties"]["engine"]["enum"] == ["", "local", "vllm", "sglang", "openai"]
    assert schema["properties"]["refresh_from"]["enum"][0] == ""


def test_blank_fields_keep_the_base_config_and_filled_ones_change_it(tmp_path):
    assert short_form_overrides() == []
    assert short_form_overrides(target_model="  ", endpoints=[" "], epochs=0) == []
    base = tmp_path / "base.yaml"
    base.write_text(
        yaml.safe_dump(
            {
                "name": "mine",
                "target": {"model": "org/base-model"},
                "generation": {"engine": "vllm", "max_tokens": 77, "served_model": "base"},
                "train": {"epochs": 3},
            }
        )
    )
    kept = load_config(base, short_form_overrides())
    assert (kept.target.model, kept.generation.engine, kept.train.epochs) == (
        "org/base-model", "vllm", 3,
    )  # fmt: skip
    overrides = short_form_overrides(
        target_model="Qwen/Qwen3-8B",
        datasets=[
            ShortFormDataset(source="math", path="org/math", limit=500),
            {"source": "chat", "path": str(tmp_path / "chat.jsonl")},
        ],
        engine="sglang",
        endpoints=["http://10.0.0.5:30000", ""],
        served_model="qwen3",
        epochs=2,
        work_dir=str(tmp_path / "work"),
    )
    config = load_config(base, overrides)
    assert config.name == "mine" and config.generation.max_tokens == 77  # kept
    assert config.target.model == "Qwen/Qwen3-8B"
    assert (config.generation.engine, config.generation.served_model) == ("sglang", "qwen3")
    assert [str(e) for e in config.generation.endpoints] == ["http://10.0.0.5:30000"]
    assert config.train.epochs == 2 and config.work_dir == str(tmp_path / "work")
    assert [(d.source, d.path, d.limit) for d in config.datasets] == [
        ("math", "org/math", 500),
        ("chat", str(tmp_path / "chat.jsonl"), None),
    ]
    # a value with YAML's special characters arrives as written
    odd = load_config(None, short_form_overrides(served_model="a: b, [c] # d"))
    assert odd.generation.served_model == "a: b, [c] # d"


def test_a_bad_field_is_named_in_the_error():
    with pytest.raises(ConfigError, match="generation.endpoints"):
        load_config(None, short_form_overrides(engine="vllm", endpoints=["not a url"]))
    with pytest.raises(ValueError, match="source"):
        short_form_overrides(datasets=[{"path": "x.jsonl"}])


def test_every_work_pool_deployment_names_a_flow_that_loads():
    """deployments/prefect.yaml's entrypoints (`prefect deploy --all`) load as Prefect loads
    them, the short form's among them."""
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    flows = {
        d["name"]: load_flow_from_entrypoint(str(ROOT / d["entrypoint"]))
        for d in spec["deployments"]
    }
    assert flows["pipeline-short-form"].name == short_form.name
    assert {f.name for f in flows.values()} == {
        "eaglet-pipeline", "eaglet-pipeline-short-form", "eaglet-watch", "eaglet-refresh",
    }  # fmt: skip
