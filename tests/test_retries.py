"""Retries only for transient faults: a deterministic failure (canary, config, quality gate,
4xx-only) fails the stage task at once; a connection error, timeout, 429, 5xx or a killed
worker is retried (eaglet/errors.py, the `stage_task` declaration in tasks/caching.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from eaglet.canary import CanaryError
from eaglet.config import ConfigError
from eaglet.errors import PermanentError, TransientError, is_transient, is_transient_status
from eaglet.extract import QualityGateError
from eaglet.generation import GenerationSummary, TooManyFailuresError
from eaglet.hidden_states.budget import DiskBudgetError
from eaglet.prompt_rendering import PromptError
from eaglet.records.io import RecordFileError
from eaglet.storage import DiskFullError
from tests.conftest import ROOT, cli_env


def too_many_failures(transient_failures: int) -> TooManyFailuresError:
    summary = GenerationSummary(
        total=10,
        already_done=0,
        written=0,
        failed=10,
        truncated=0,
        output_tokens=0,
        elapsed_s=1.0,
        transient_failures=transient_failures,
    )
    return TooManyFailuresError(summary, 0.1)


def http_status_error(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://server/v1/completions")
    return httpx.HTTPStatusError(
        "server said no", request=request, response=httpx.Response(status, request=request)
    )


class KilledWorker(Exception):  # dask.distributed's name for a worker that died
    pass


def raised_from(error: BaseException, cause: BaseException) -> BaseException:
    try:
        raise error from cause
    except BaseException as exc:
        return exc


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("refused"),
        TimeoutError(),
        httpx.ConnectError("refused"),
        httpx.ReadTimeout("slow"),
        http_status_error(429),
        http_status_error(503),
        KilledWorker("worker died"),
        too_many_failures(transient_failures=3),
        raised_from(ValueError("download failed"), ConnectionError("reset")),
        TransientError("server restarting"),
    ],
    ids=repr,
)
def test_transient_faults_are_retried(error):
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        CanaryError("preflight canary failed"),
        ConfigError("unknown key"),
        QualityGateError("quality gate failed"),
        PromptError("sample s1: no user turn"),
        RecordFileError("prompts.jsonl:3: not valid JSON"),
        DiskBudgetError("the features need 2 TB, 1 TB free"),
        DiskFullError(28, "no space left under WORK_DIR/generate"),
        OSError(28, "No space left on device"),
        too_many_failures(transient_failures=0),  # every failure a 4xx
        http_status_error(400),
        http_status_error(404),
        RuntimeError("a bug fails the same way twice"),
        raised_from(CanaryError("no parser"), ConnectionError("first try")),
    ],
    ids=repr,
)
def test_deterministic_failures_are_final(error):
    assert not is_transient(error)


def test_http_statuses():
    assert [
        s for s in (None, 200, 400, 401, 404, 408, 422, 429, 500, 503) if is_transient_status(s)
    ] == [
        None,
        408,
        429,
        500,
        503,
    ]
    assert issubclass(CanaryError, PermanentError) and issubclass(CanaryError, RuntimeError)


FLOW = """
import json, sys
from prefect import flow
from eaglet.canary import CanaryError
from eaglet.config import load_config
from eaglet.generation import GenerationSummary, TooManyFailuresError
from eaglet_prefect.tasks.caching import stage_task

calls = {}
config = load_config(None, [f"work_dir={sys.argv[1]}"])


def failing(name, errors):
    @stage_task("download", retries=3, retry_delay_seconds=[0, 0, 0])
    def body(config, refresh=False):
        calls[name] = calls.get(name, 0) + 1
        if calls[name] <= len(errors):
            raise errors[calls[name] - 1]
        return {"ok": True}
    return body


def four_xx_only():
    summary = GenerationSummary(total=4, already_done=0, written=0, failed=4, truncated=0,
                                output_tokens=0, elapsed_s=1.0)
    return TooManyFailuresError(summary, 0.1)


tasks = {
    "canary": failing("canary", [CanaryError("preflight canary failed: no reasoning parser")]),
    "four_xx": failing("four_xx", [four_xx_only()]),
    "transient": failing("transient", [ConnectionError("refused"), TimeoutError("slow")]),
}


@flow
def main():
    return {name: task(config, return_state=True).type.value for name, task in tasks.items()}


states = main()
print("RESULT " + json.dumps({"states": states, "calls": calls}))
"""


@pytest.mark.slow  # a flow run against the session's Prefect server
def test_through_prefect_a_canary_failure_runs_once_and_a_transient_fault_is_retried(tmp_path):
    env = cli_env(tmp_path, {"PREFECT_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)})
    result = subprocess.run(
        [sys.executable, "-c", FLOW, str(tmp_path / "work")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, result.stdout[-3000:] + result.stderr[-3000:]
    outcome = json.loads(line.removeprefix("RESULT "))
    assert outcome["calls"] == {"canary": 1, "four_xx": 1, "transient": 3}
    assert outcome["states"] == {"canary": "FAILED", "four_xx": "FAILED", "transient": "COMPLETED"}
    assert "a retry cannot mend" in result.stderr + result.stdout
