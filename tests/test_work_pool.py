"""The README's work-pool path, end to end: a process work pool, `prefect deploy --all
--prefect-file deployments/prefect.yaml` from the repository root as the README writes it, a
worker, and a run of the short-form deployment through the API that the worker picks up and
completes, every stage; the nightly example's cron schedule is declared and inactive."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest
import yaml

from tests.conftest import ROOT
from tests.prefect_server_helpers import (
    STAGES,
    RetryingTransport,
    api_run_config,
    finished_run,
    start_prefect_server,
    start_process,
    stop_process,
    task_states,
)
from tests.vllm_server import free_port

pytestmark = pytest.mark.slow


def readme_work_pool_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("With a work pool instead of a serving process:") :]
    block = section[
        section.index("```bash\n") + 8 : section.index("```", section.index("```bash") + 7)
    ]
    return [line.strip() for line in block.splitlines() if line.strip()]


def one_run_at_a_time(deployment: dict) -> bool:
    """A deployment (as the API returns it) with a concurrency limit of 1 that enqueues."""
    limit = (deployment.get("global_concurrency_limit") or {}).get("limit")
    strategy = (deployment.get("concurrency_options") or {}).get("collision_strategy")
    return limit == 1 and strategy == "ENQUEUE"


def test_a_work_pool_worker_runs_the_deployments_of_prefect_yaml(
    tmp_path, fixture_model_dir, sample_data_dir
):
    commands = readme_work_pool_commands()
    assert len(commands) == 3 and "worker start" in commands[2], commands
    home = tmp_path / "prefect-home"
    home.mkdir()
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_CLI_PROMPT": "false",  # no TTY here: deploy must not ask
    }
    server = start_prefect_server(port, env, tmp_path / "server.log")
    worker = None
    try:
        client = httpx.Client(base_url=api, timeout=30, transport=RetryingTransport())
        # prefect.yaml's build step creates the notifications when EAGLET_NOTIFY_BLOCK names
        # a block (once per deployment deployed: idempotent)
        from prefect.blocks.notifications import CustomWebhookNotificationBlock
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}):
            CustomWebhookNotificationBlock(name="pool", url="http://127.0.0.1:9").save("pool")
        env["EAGLET_NOTIFY_BLOCK"] = "custom-webhook/pool"
        # The README's three commands as written, by bash in the repository root (the third
        # stays running: it is the worker).
        for command in commands[:2]:
            done = subprocess.run(
                ["bash", "-euc", command], cwd=ROOT, env=env, timeout=300,
                stdout=open(tmp_path / "deploy.log", "ab"), stderr=subprocess.STDOUT,
            )  # fmt: skip
            assert done.returncode == 0, (tmp_path / "deploy.log").read_text()[-3000:]
        worker = start_process(["bash", "-euc", commands[2]], env, tmp_path / "worker.log")

        deployments = {d["name"]: d for d in client.post("/deployments/filter", json={}).json()}
        assert {"pipeline", "pipeline-short-form", "generate-only", "nightly-rerun"} <= set(
            deployments
        )
        for name, deployment in deployments.items():  # one run at a time, the rest queue
            assert one_run_at_a_time(deployment), (name, deployment)
        automations = client.post("/automations/filter", json={}).json()
        assert sorted(a["name"] for a in automations) == [
            "eaglet: a run completed", "eaglet: a run failed or crashed",
        ], automations  # fmt: skip
        (nightly,) = deployments["nightly-rerun"]["schedules"]
        assert nightly["schedule"]["cron"] == "0 2 * * *" and nightly["active"] is False

        base = tmp_path / "base.yaml"
        base.write_text(
            yaml.safe_dump(
                api_run_config(tmp_path, fixture_model_dir, sample_data_dir, "name=pool")
            )
        )
        work_dir = tmp_path / "pool-work"
        response = client.post(
            f"/deployments/{deployments['pipeline-short-form']['id']}/create_flow_run",
            json={"parameters": {"config_path": str(base), "work_dir": str(work_dir)}},
        )
        response.raise_for_status()
        run, tasks = finished_run(client, response.json()["id"])
        assert run["state"]["type"] == "COMPLETED", (
            run["state"],
            (tmp_path / "worker.log").read_text()[-3000:],
        )
        assert task_states(tasks, "pool") == dict.fromkeys(STAGES, "Completed")
        record = json.loads((work_dir / "run.json").read_text())
        assert record["work_dir"] == str(work_dir)
    finally:
        if worker is not None:
            stop_process(worker)
        stop_process(server)
