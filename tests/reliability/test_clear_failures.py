"""Failures that end on one line naming the file or the setting and what to do, before any work
where the config already shows them: a read-only work dir, an evaluation endpoint that is not
vLLM, a generate stage that left nothing to train on."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from eaglet.config import ReasoningConfig, load_config
from eaglet.extract import QualityGateError, check_quality_gate
from eaglet.preflight import PreflightReport, check_endpoints
from tests.conftest import run_cli


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


def test_an_evaluation_endpoint_that_is_not_vllm_is_refused_by_the_preflight():
    """It passed ("a vLLM server answers") and failed after training on /metrics' 404."""
    from tests.fake_servers import _send_json, serve

    async def openai_like(scope, receive, send):  # /v1/models answers; no /metrics
        if scope["type"] != "http":
            return
        if scope["path"] == "/v1/models":
            await _send_json(send, 200, {"data": [{"id": "tiny"}]})
        else:
            await _send_json(send, 404, {"detail": "Not Found"})

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
