"""Failures that end on one line naming the file or the setting and what to do, before any work
where the config already shows them: a read-only work dir, an evaluation endpoint that is not
vLLM, a generate stage that left nothing to train on."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from eaglet.config import ReasoningConfig, load_config
from eaglet.extract import QualityGateError, check_quality_gate
from eaglet.preflight import PreflightReport, check_endpoints, check_hidden_states_backend
from tests.conftest import run_cli


@pytest.mark.slow  # seconds of subprocess or timeouts: outside the fast suite
def test_a_read_only_work_dir_says_so_and_what_to_do_with_exit_2(tmp_path):
    """It exited 1 on `OSError [Errno 30]` for `.eaglet.lock` though nothing ran."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root (CI runs this as root)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)])
    if mounted.returncode != 0:
        pytest.skip("mount not permitted here")
    try:
        result = run_cli(["run", "/dev/null", "--set", f"work_dir={mount}"], cwd=tmp_path)
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert f"work dir {mount} cannot be written" in line and "eaglet inspect" in line
    assert "Traceback" not in result.stderr


async def openai_like(scope, receive, send) -> None:
    """An OpenAI-compatible server that is not vLLM: /v1/models answers, /metrics is a 404."""
    from tests.fake_servers import _send_json

    if scope["type"] != "http":
        return
    if scope["path"] == "/v1/models":
        await _send_json(send, 200, {"data": [{"id": "tiny"}]})
    else:
        await _send_json(send, 404, {"detail": "Not Found"})


def test_an_evaluation_endpoint_that_is_not_vllm_is_refused_by_the_preflight():
    """It passed ("a vLLM server answers") and failed after training on /metrics' 404."""
    from tests.fake_servers import serve

    with serve(openai_like) as url:
        config = load_config(None, ["evaluate.serving=vllm", f"evaluate.serving_endpoint={url}"])
        report = PreflightReport()
        check_endpoints(config, report)
    [problem] = report.problems
    assert problem.startswith("evaluate.serving_endpoint:") and "no vLLM counters" in problem


def test_extract_with_every_answer_dropped_by_the_loop_guard_fails_naming_why():
    """It completed with 0 examples and train failed on "no training samples"."""
    report = {
        "records": 0,
        "per_source": {
            "arith": {
                "records": 0,
                "looped": 30,
                "reasoning_capture_rate": None,
                "truncation_rate": 0.0,
            }
        },  # fmt: skip
        "example_ids_by_flag": {"looped": ["a1", "a2"]},
    }
    with pytest.raises(QualityGateError) as raised:
        check_quality_gate(report, True, ReasoningConfig())
    message = str(raised.value)
    assert "no training examples" in message and "loop guard stopped all 30" in message
    assert "reasoning.looped_rows" in message and "a1" in message


@pytest.mark.slow  # seconds of subprocess or timeouts: outside the fast suite
def test_serve_with_a_dead_loopback_api_url_says_so_in_seconds(tmp_path, monkeypatch, capsys):
    """Issue 40: `eaglet serve` with PREFECT_API_URL at nothing waited 120 s before saying so.
    Where no process on this machine is starting a Prefect server, a loopback URL gets 5 s."""
    from eaglet.vllm_process import free_port
    from eaglet_prefect.flows import cli, prefect_server

    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{free_port()}/api")
    # other tests of this suite may be running a Prefect server on this machine meanwhile
    monkeypatch.setattr(prefect_server, "prefect_server_starting", lambda **_: False)
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "no Prefect server answers" in err and "no process here is starting one" in err
    assert "after 5 s" in err  # not the 120 s a server that may be starting gets


def test_a_starting_prefect_server_is_recognised_by_its_command_line(tmp_path):
    from eaglet_prefect.flows.prefect_server import prefect_server_starting

    def proc_with(*commands: list[str]) -> Path:
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        for pid, words in enumerate(commands, start=1):
            (root / str(pid)).mkdir(parents=True)
            (root / str(pid) / "cmdline").write_bytes(b"\0".join(w.encode() for w in words))
        return root

    pytest_run = ["python", "-m", "pytest", "tests/test_prefect_server.py", "-k", "server"]
    assert prefect_server_starting(proc_with(pytest_run)) is False
    assert prefect_server_starting(proc_with(["/v/bin/prefect", "server", "start"])) is True
    uvicorn = ["python", "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"]
    assert prefect_server_starting(proc_with(pytest_run, uvicorn)) is True
    assert prefect_server_starting(tmp_path / "no-proc") is None


def test_a_hidden_states_endpoint_that_is_not_vllm_is_refused_by_the_preflight(tmp_path):
    """Issue 40: online training from a server that is not vLLM passed the preflight and
    ended hours later; an OpenAI-compatible server without vLLM's counters is refused now."""
    from tests.fake_servers import serve

    with serve(openai_like) as url:
        config = load_config(
            None,
            ["hidden_states.backend=vllm", f"hidden_states.endpoints=[{url}]",
             "train.hidden_states=online", f"hidden_states.connector_path={tmp_path}"],
        )  # fmt: skip
        report = PreflightReport()
        check_hidden_states_backend(config, report)
    [problem] = report.problems
    assert problem.startswith("hidden_states.vllm.endpoints[0] (online training):"), problem
    assert "is not vLLM" in problem and "extract_hidden_states" in problem


def test_an_offline_hub_dataset_not_in_any_cache_is_refused_by_the_preflight(tmp_path, monkeypatch):
    """Issue 40: with HF_HUB_OFFLINE set, a hub dataset passed the preflight, then the download
    stage retried twice (35 s) and ended on a bare ConnectionError. The preflight looks in the
    local caches now; a prepared copy in datasets' cache passes."""
    import datasets.config
    from huggingface_hub import constants

    from eaglet.preflight import hub_dataset_problem

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    problem = hub_dataset_problem("datasets[0].path", "someone/chats", None)
    assert problem is not None and problem.startswith("datasets[0].path: 'someone/chats'")
    assert "HF_HUB_OFFLINE is set" in problem and "local caches" in problem
    (tmp_path / "datasets" / "someone___chats").mkdir(parents=True)
    assert hub_dataset_problem("datasets[0].path", "someone/chats", None) is None


def test_the_gated_llama_example_offline_is_told_the_cache_lacks_it(tmp_path, monkeypatch):
    """Issue 40: the Llama example offline asked whether trust_remote_code was needed."""
    from huggingface_hub import constants

    from eaglet.preflight import hub_lookup_problem

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    problem = hub_lookup_problem("meta-llama/Llama-3.1-8B-Instruct", None)
    assert problem is not None and "HF_HUB_OFFLINE is set" in problem, problem
    assert "gated" in problem and "HF_TOKEN" in problem and "trust_remote_code" not in problem


def test_a_target_config_that_cannot_load_gets_advice_from_what_failed(tmp_path):
    """trust_remote_code is suggested only for a model type transformers does not know."""
    from eaglet.preflight import PreflightReport, load_target

    def problem_for(config_text: str) -> str:
        model = tmp_path / str(len(list(tmp_path.iterdir())))
        model.mkdir()
        (model / "config.json").write_text(config_text)
        (model / "tokenizer.json").write_text("{}")
        report = PreflightReport()
        load_target(load_config(None, [f"target.model={model}"]), report)
        [problem] = [p for p in report.problems if "config.json could not be read" in p]
        return problem

    damaged = problem_for('{"model_type": "qwen3", "hidden_')
    assert "damaged" in damaged and "trust_remote_code" not in damaged
    custom = problem_for('{"model_type": "eaglet_custom_arch"}')
    assert "target.trust_remote_code: true" in custom
