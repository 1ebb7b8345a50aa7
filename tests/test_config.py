"""PipelineConfig: YAML loading, overrides, and errors that name the offending key."""

import pytest
import yaml

from eaglet.config import ConfigError, PipelineConfig, load_config


def test_defaults_serve_the_demo():
    config = load_config(None)
    assert config.generation.engine == "local"
    assert {d.source for d in config.datasets} == {"arith", "tools", "mixed"}


def test_yaml_file_and_overrides_apply_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "name: arith\nwork_dir: runs/arith\ngeneration:\n  engine: vllm\n  max_tokens: 64\n"
        "datasets:\n  - source: arith\n    path: data/arith.jsonl\n    limit: 200\n"
    )
    config = load_config(path, ["generation.max_tokens=32", "datasets.0.limit=5", "train.lr=0.01"])
    assert config.name == "arith"
    assert config.generation.engine == "vllm"
    assert config.generation.max_tokens == 32
    assert config.datasets[0].limit == 5
    assert config.train.lr == 0.01


def test_unknown_key_in_file_is_an_error_naming_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("generation:\n  engine: local\n  max_token: 64\n")
    with pytest.raises(ConfigError, match=r"unknown key 'generation.max_token'"):
        load_config(path)


def test_unknown_key_in_override_is_an_error_naming_it():
    with pytest.raises(ConfigError, match=r"unknown key 'train.learning_rate'"):
        load_config(None, ["train.learning_rate=3"])


def test_out_of_bounds_value_is_rejected_with_its_path():
    with pytest.raises(ConfigError, match=r"generation.temperature"):
        load_config(None, ["generation.temperature=-1"])


def test_bad_engine_name_is_rejected():
    with pytest.raises(ConfigError, match=r"generation.engine"):
        load_config(None, ["generation.engine=tgi"])


def test_duplicate_source_tags_are_rejected():
    with pytest.raises(ConfigError, match="repeated"):
        load_config(None, ["datasets=[{source: a, path: x.jsonl}, {source: a, path: y.jsonl}]"])


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_schema_has_descriptions_for_the_ui_form():
    schema = PipelineConfig.model_json_schema()
    generation = schema["$defs"]["GenerationConfig"]["properties"]
    assert generation["engine"]["enum"] == ["local", "vllm", "sglang", "openai"]
    assert all("description" in field for field in generation.values())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("datasets.5.limit=3", r"'datasets' has 3 item\(s\); index 5 is out of range"),
        ("datasets.x.limit=3", r"'datasets' is a list; 'x' is not an index"),
        ("generation.stop=[unclosed", r"the value is not valid YAML"),
        ("generation.max_tokens", r"not of the form key.path=value"),
        ("generation.max_tokens.x=1", r"'generation.max_tokens' is not a section"),
    ],
)
def test_bad_override_is_a_config_error_naming_it(override, message):
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(None, [override])
    assert override in str(raised.value)


def test_relative_paths_resolve_against_the_config_files_folder(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    (folder / "data").mkdir(parents=True)
    (folder / "model").mkdir()
    (folder / "run.yaml").write_text(
        "work_dir: ../runs/x\ntarget:\n  model: model\n"
        "datasets:\n  - source: a\n    path: data/a.jsonl\n  - source: hub\n    path: org/set\n"
    )
    monkeypatch.chdir(tmp_path / "configs" / "data")  # anywhere but the config's folder
    config = load_config(folder / "run.yaml")
    assert config.work_dir == str(tmp_path / "runs" / "x")
    assert config.target.model == str(folder / "model")
    assert config.datasets[0].path == str(folder / "data" / "a.jsonl")
    assert config.datasets[1].path == "org/set"  # a hub id stays one


def test_override_paths_resolve_against_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.yaml").write_text("name: x\n")
    monkeypatch.chdir(tmp_path)
    config = load_config(tmp_path / "configs" / "run.yaml", ["work_dir=w"])
    assert config.work_dir == str(tmp_path / "w")


def test_hub_model_id_is_kept_as_it_is(tmp_path):
    config = load_config(None, ["target.model=Qwen/Qwen3-0.6B"])
    assert config.target.model == "Qwen/Qwen3-0.6B"


@pytest.mark.parametrize("source", ["../x", "a/b", ".hidden", "", "a b"])
def test_a_source_tag_that_could_name_a_path_is_rejected(source):
    with pytest.raises(ConfigError, match=r"datasets\.0\.source"):
        load_config(None, [f"datasets=[{{source: '{source}', path: x.jsonl}}]"])


def test_a_model_folder_not_built_yet_resolves_as_a_local_path(tmp_path, monkeypatch):
    """The demo's case on a fresh clone: `runs/demo/models/fixture` does not exist yet and is
    still a folder (made absolute), never a hub id left relative."""
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["work_dir=runs/demo", "target.model=runs/demo/models/fixture"])
    assert config.target.model == str(tmp_path / "runs" / "demo" / "models" / "fixture")
    assert config.work_dir == str(tmp_path / "runs" / "demo")


@pytest.mark.parametrize(
    ("value", "hub"),
    [
        ("Qwen/Qwen3-0.6B", True),
        ("gpt2", True),
        ("runs/demo/models/fixture", False),  # more parts than org/name
        ("./model", False),
        ("../models/x", False),
        ("~/models/x", False),
        ("/abs/no-suffix", False),
    ],
)
def test_one_rule_says_what_a_hub_id_is(tmp_path, value, hub):
    from eaglet.local_paths import is_hub_dataset, is_hub_id

    assert is_hub_id(value, tmp_path) is hub
    assert is_hub_dataset(value, tmp_path) is hub


def test_an_existing_folder_with_a_hub_ids_shape_is_local(tmp_path):
    from eaglet.local_paths import is_hub_id

    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not is_hub_id("org/model", tmp_path)


@pytest.mark.parametrize("name", ["org/data.jsonl", "data.csv", "x.parquet"])
def test_a_dataset_with_a_file_suffix_is_never_a_hub_id(tmp_path, name):
    from eaglet.local_paths import is_hub_dataset

    assert not is_hub_dataset(name, tmp_path)


def test_an_absolute_dataset_path_without_a_suffix_is_a_missing_file_not_a_hub_lookup(tmp_path):
    from eaglet.config import DatasetSpec
    from eaglet.datasets import DatasetError, read_samples

    missing = tmp_path / "mydata"
    with pytest.raises(DatasetError, match="dataset file not found"):
        list(read_samples(DatasetSpec(source="x", path=str(missing))))


def test_a_key_written_twice_is_an_error_naming_both_lines(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: a\ngeneration:\n  max_tokens: 10\n  max_tokens: 20\n")
    with pytest.raises(ConfigError, match=r"'max_tokens' appears twice \(lines 3 and 4\)"):
        load_config(path)


def test_an_empty_config_file_is_an_error_not_the_demo(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config(path)


@pytest.mark.parametrize(
    "written", ["http://h:8000/v1", "http://h:8000/v1/", "http://h:8000/", " http://h:8000"]
)
def test_an_endpoint_written_the_openai_way_names_the_same_server(written):
    config = load_config(
        None,
        [
            f"generation.endpoints=['{written}']",
            f"hidden_states.endpoints=['{written}']",
            f"evaluate.serving_endpoint={written.strip()}",
        ],
    )
    assert config.generation.endpoints == ["http://h:8000"]
    assert config.hidden_states.vllm.endpoints == ["http://h:8000"]
    assert config.evaluate.serving_endpoint == "http://h:8000"


def test_an_endpoint_that_is_not_a_url_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"generation\.endpoints\.0"):
        load_config(None, ["generation.endpoints=['127.0.0.1:8000']"])


def test_the_same_file_under_two_source_tags_is_an_error():
    with pytest.raises(ConfigError, match="datasets 0 and 1 read the same data"):
        load_config(
            None, ["datasets=[{source: a, path: /d/x.jsonl}, {source: b, path: /d/x.jsonl}]"]
        )


OLD_HIDDEN_STATES = """\
hidden_states:
  backend: vllm
  storage: bfloat16
  endpoints: [http://h:8100/v1]
  connector_path: connector
  served_model: big
  concurrency: 32
  vllm_args: [--max-model-len, '4096']
"""
NEW_HIDDEN_STATES = """\
hidden_states:
  backend: vllm
  storage: bfloat16
  vllm:
    endpoints: [http://h:8100/v1]
    connector_path: connector
    served_model: big
    concurrency: 32
    vllm_args: [--max-model-len, '4096']
"""


def test_a_backends_keys_written_in_hidden_states_itself_still_load_into_its_section(tmp_path):
    """Issue 35 gave each hidden-state backend its section (hidden_states.hf, .vllm); a config
    written before, its keys in hidden_states itself, loads as the same config, overrides of
    the older spelling included, and its relative connector_path resolves against the file's
    folder as before."""
    (tmp_path / "old.yaml").write_text(OLD_HIDDEN_STATES)
    (tmp_path / "new.yaml").write_text(NEW_HIDDEN_STATES)
    with pytest.warns(FutureWarning, match=r"hidden_states\.endpoints is the older spell"):
        old = load_config(tmp_path / "old.yaml")
    new = load_config(tmp_path / "new.yaml")
    assert old == new
    vllm = new.hidden_states.vllm
    assert vllm.endpoints == ["http://h:8100"] and vllm.served_model == "big"
    assert vllm.connector_path == str(tmp_path / "connector")
    assert vllm.vllm_args == ["--max-model-len", "4096"] and new.hidden_states.storage == "bfloat16"
    for spelling in ("hidden_states.concurrency=4", "hidden_states.vllm.concurrency=4"):
        for path in (tmp_path / "old.yaml", tmp_path / "new.yaml"):
            assert load_config(path, [spelling]).hidden_states.vllm.concurrency == 4
    flat = PipelineConfig.model_validate({"hidden_states": {"device_map": "auto"}})
    assert flat.hidden_states.hf.device_map == "auto"
    saved = tmp_path / "saved.yaml"  # what a run writes (WORK_DIR/config.yaml) loads back
    saved.write_text(yaml.safe_dump(old.model_dump(mode="json")))
    assert load_config(saved) == old


def test_a_backend_key_written_both_ways_with_two_values_is_an_error(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text(NEW_HIDDEN_STATES + "  served_model: other\n")
    with pytest.raises(ConfigError, match="hidden_states.served_model .* and hidden_states.vllm"):
        load_config(path)
    path.write_text(NEW_HIDDEN_STATES + "  served_model: big\n")  # the same value: no doubt
    assert load_config(path).hidden_states.vllm.served_model == "big"


def test_every_vllm_server_eaglet_starts_has_the_same_keys_the_older_one_still_loading():
    """One settings model (`VllmServerSettings`) for a vLLM server eaglet starts, in both
    sections that start one, its keys after the section's own in the form; evaluate's older
    `serving_startup_timeout_s` loads as `evaluate.startup_timeout_s`, said deprecated."""
    from eaglet.config_fields import VllmServerSettings

    server = list(VllmServerSettings.model_fields)
    schema = PipelineConfig.model_json_schema()["$defs"]
    for section in (PipelineConfig().evaluate, PipelineConfig().hidden_states.vllm):
        assert isinstance(section, VllmServerSettings)
        assert list(schema[type(section).__name__]["properties"])[-len(server) :] == server
    with pytest.warns(FutureWarning, match=r"evaluate\.serving_startup_timeout_s is the older"):
        loaded = load_config(None, ["evaluate.serving_startup_timeout_s=42"])
    assert loaded.evaluate.startup_timeout_s == 42
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="both set, to 1 and 2"):
        PipelineConfig.model_validate(
            {"evaluate": {"serving_startup_timeout_s": 1, "startup_timeout_s": 2}}
        )


def test_a_vllm_server_eaglet_does_not_start_needs_its_connector_folder():
    with pytest.raises(ConfigError, match="needs hidden_states.vllm.connector_path"):
        load_config(None, ["hidden_states.backend=vllm"])
    assert load_config(None, ["hidden_states.vllm.connector_path=/c"])  # hf: not needed


def test_the_type_checkers_hidden_states_sections_are_the_registrys():
    """`HiddenStatesConfig` is built from the backend registry at run time; the type checker
    reads the sections declared by hand under TYPE_CHECKING (eaglet/config/hidden_states.py).
    Both name the same backends with the same settings classes."""
    import ast
    from pathlib import Path

    from eaglet.config import HiddenStatesConfig
    from eaglet.config import hidden_states as module
    from eaglet.hidden_states.backends import BACKENDS

    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    declared = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == "HiddenStatesConfig"
    )
    sections = {
        field.target.id: ast.unparse(field.annotation)
        for field in declared.body
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
    }
    built = {name: HiddenStatesConfig.model_fields[name].annotation.__name__ for name in BACKENDS}
    assert sections == built


def test_the_cli_prints_an_older_spellings_deprecation_in_one_line(monkeypatch):
    import warnings

    from eaglet_prefect.flows import cli

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)
    cli._eaglets_warnings_in_one_line()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config(None, ["hidden_states.concurrency=4"])
    assert loaded.hidden_states.vllm.concurrency == 4
    (warning,) = caught
    shown = warnings.formatwarning(warning.message, warning.category, warning.filename, 1)
    assert shown == (
        "warning: hidden_states.concurrency is the older spelling of "
        "hidden_states.vllm.concurrency: it is read as hidden_states.vllm.concurrency; write it "
        "there (the flat spelling is deprecated and will be removed)\n"
    )
    other = warnings.formatwarning("x", UserWarning, "/elsewhere/lib.py", 3)
    assert other.startswith("/elsewhere/lib.py:3: UserWarning: x")
