"""Helpers of the tests that run eaglet through a real Prefect server
(tests/test_prefect_server.py, test_work_pool.py, test_serve_schedules.py): processes started
in their own session with their output in a log and stopped with SIGINT then SIGKILL, polling
until a condition holds, `prefect server start` once its API answers (a team's server: on a
PostgreSQL database, behind basic authentication), an HTTP client that authenticates and
retries a busy server, and a flow run's end and its tasks' states read back through the API."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import ROOT, small_run_overrides
from tests.vllm_server import stop_process_group

STAGES = ("download", "tokenize", "generate", "extract", "hidden_states", "train", "evaluate")


def start_process(command: list[str], env: dict, log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """`command` in its own session, stdout and stderr to `log`."""
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop_process(process: subprocess.Popen) -> None:
    # Prefect workers and runners ignore SIGTERM in some states: SIGINT first, then SIGKILL.
    stop_process_group(process, signal.SIGINT, grace_s=20)


def wait_for(predicate, timeout: float, what: str):
    """`predicate()`'s first true value, polled each second; TimeoutError naming `what`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise TimeoutError(f"timed out waiting for {what}")


def team_auth() -> str:
    """A fresh `user:password` for a server's basic authentication (the server's
    PREFECT_SERVER_API_AUTH_STRING, each client's PREFECT_API_AUTH_STRING)."""
    return f"eaglet-team:{secrets.token_hex(12)}"


def start_prefect_server(
    port: int, env: dict, log: Path, database: str | None = None, auth: str | None = None
) -> subprocess.Popen:
    """`prefect server start` on `port`, once its API answers (stopped if it never does); on
    the PostgreSQL `database` (a SQLAlchemy URL) and behind basic authentication with `auth`
    when given: a team's server. Those two reach the server's environment only."""
    prefect = str(Path(sys.executable).with_name("prefect"))
    server_env = dict(env)
    if database is not None:
        server_env["PREFECT_API_DATABASE_CONNECTION_URL"] = database
    if auth is not None:
        server_env["PREFECT_SERVER_API_AUTH_STRING"] = auth
    server = start_process(
        [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], server_env, log
    )

    def healthy():
        try:
            return httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 90, "the Prefect server")
    except TimeoutError:
        stop_process(server)
        raise
    return server


class RetryingTransport(httpx.HTTPTransport):
    """Retries 429, 502 and 503 as Prefect's own client does: a SQLite-backed server on a
    loaded machine answers 503 while its database is busy."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(6):
            response = super().handle_request(request)
            if response.status_code not in (429, 502, 503) or attempt == 5:
                return response
            response.close()
            time.sleep(1 + attempt)
        raise AssertionError("unreachable")


def api_client(api: str, auth: str | None = None) -> httpx.Client:
    """An HTTP client of the Prefect API at `api`: basic authentication with `auth`
    (`user:password`, as Prefect's own client sends PREFECT_API_AUTH_STRING), busy answers
    retried."""
    basic = httpx.BasicAuth(*auth.split(":", 1)) if auth else None
    return httpx.Client(base_url=api, timeout=30, transport=RetryingTransport(), auth=basic)


def finished_run(client: httpx.Client, run_id: str) -> tuple[dict, dict]:
    """Wait for a flow run to end; return it and {task name: task run}."""

    def finished():
        run = client.get(f"/flow_runs/{run_id}").json()
        return run if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED") else None

    run = wait_for(finished, 900, f"flow run {run_id}")
    task_runs = client.post(
        "/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}
    ).json()
    return run, {t["name"]: t for t in task_runs}


def task_states(tasks: dict, name: str, stages=STAGES) -> dict[str, str]:
    """stage -> the state name of its task in a run of the config `name`."""
    return {stage: tasks[f"{stage}[{name}]"]["state"]["name"] for stage in stages}


def api_run_config(
    tmp_path: Path, fixture_model_dir: Path, sample_data_dir: Path, *extra: str
) -> dict:
    """The small test pipeline's config (named "api", then `extra` overrides) as run
    parameters."""
    from eaglet.config import load_config

    overrides = [*small_run_overrides(tmp_path / "work", fixture_model_dir, sample_data_dir)]
    return load_config(None, [*overrides, "name=api", *extra]).model_dump(mode="json")
