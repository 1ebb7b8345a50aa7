"""The README's work-pool path, end to end, on a team's server (PostgreSQL, basic
authentication: every client here has the credentials): a process work pool, `prefect deploy
--all --prefect-file deployments/prefect.yaml` from the repository root as the README writes
it, and two workers of the pool on two "machines" (two processes, each in a home of its own:
its own copy of the project and Prefect home, started with the README's command). A run of
the short-form deployment is taken by one and completes every stage in that machine's home;
with that worker gone, the next run of the deployment is taken by the other, in its home. The
nightly example's cron schedule is declared and inactive."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml

from tests.conftest import ROOT
from tests.pipeline_helpers import copy_project
from tests.prefect_server_helpers import (
    STAGES,
    api_client,
    api_run_config,
    finished_run,
    start_prefect_server,
    start_process,
    stop_process,
    task_states,
    team_auth,
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


def test_two_workers_of_a_pool_on_two_machines_take_the_runs_of_prefect_yaml_in_turn(
    tmp_path, postgres, fixture_model_dir, sample_data_dir
):
    commands = readme_work_pool_commands()
    assert len(commands) == 3 and "worker start" in commands[2], commands
    home = tmp_path / "prefect-home"
    home.mkdir()
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    auth = team_auth()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_API_AUTH_STRING": auth,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_CLI_PROMPT": "false",  # no TTY here: deploy must not ask
    }
    database = postgres.database("pool")
    server = start_prefect_server(port, env, tmp_path / "server.log", database, auth)
    workers: dict[str, object] = {}
    try:
        client = api_client(api, auth)
        # prefect.yaml's build step creates the notifications when EAGLET_NOTIFY_BLOCK names
        # a block (once per deployment deployed: idempotent)
        from prefect.blocks.notifications import CustomWebhookNotificationBlock
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api, PREFECT_API_AUTH_STRING: auth}):
            CustomWebhookNotificationBlock(name="pool", url="http://127.0.0.1:9").save("pool")
        env["EAGLET_NOTIFY_BLOCK"] = "custom-webhook/pool"
        # The README's first two commands as written, by bash in the repository root.
        for command in commands[:2]:
            done = subprocess.run(
                ["bash", "-euc", command], cwd=ROOT, env=env, timeout=300,
                stdout=open(tmp_path / "deploy.log", "ab"), stderr=subprocess.STDOUT,
            )  # fmt: skip
            assert done.returncode == 0, (tmp_path / "deploy.log").read_text()[-3000:]
        # Two machines: each its own copy of the project and Prefect home, and a worker
        # started there with the README's third command (EAGLET_HOME=$PWD: its home).
        machines = {name: copy_project(tmp_path / f"machine-{name}") for name in ("a", "b")}
        for name, machine in machines.items():
            (machine / ".venv").symlink_to(ROOT / ".venv")  # its install (the README's path)
            machine_env = {**env, "PREFECT_HOME": str(machine / ".prefect"),
                           "PYTHONPATH": str(machine)}  # fmt: skip
            workers[name] = start_process(
                ["bash", "-euc", commands[2]], machine_env, tmp_path / f"worker-{name}.log",
                cwd=machine,
            )  # fmt: skip

        deployments = {d["name"]: d for d in client.post("/deployments/filter", json={}).json()}
        assert {"pipeline", "pipeline-short-form", "generate-only", "nightly-rerun", "watch",
                "refresh"} <= set(deployments)  # fmt: skip
        for name, deployment in deployments.items():  # one run at a time, the rest queue
            assert one_run_at_a_time(deployment), (name, deployment)
            # each worker's own home: the placeholder is read on the worker's machine (the
            # README deploys without EAGLET_HOME, which would write the deployer's path)
            (step,) = deployment["pull_steps"]
            assert step == {"prefect.deployments.steps.set_working_directory": {
                "directory": "{{ $EAGLET_HOME }}"}}, (name, step)  # fmt: skip
        automations = client.post("/automations/filter", json={}).json()
        assert sorted(a["name"] for a in automations) == [
            "eaglet: a run completed", "eaglet: a run failed or crashed",
            "eaglet: refresh a draft when its target changes",
        ], automations  # fmt: skip
        (watch,) = deployments["watch"]["schedules"]  # off until a work dir is set
        assert watch["schedule"]["interval"] == 3600 and watch["active"] is False
        (nightly,) = deployments["nightly-rerun"]["schedules"]
        assert nightly["schedule"]["cron"] == "0 2 * * *" and nightly["active"] is False

        base = tmp_path / "base.yaml"
        base.write_text(
            yaml.safe_dump(
                api_run_config(tmp_path, fixture_model_dir, sample_data_dir, "name=pool")
            )
        )
        short_form = deployments["pipeline-short-form"]["id"]

        def run_on_a_machine(parameters: dict) -> tuple[dict, dict, str]:
            """A short-form run through the API; its flow run, tasks, and the machine whose
            home holds its work dir (`runs/pool`, relative: each machine's own)."""
            response = client.post(
                f"/deployments/{short_form}/create_flow_run", json={"parameters": parameters}
            )
            response.raise_for_status()
            run, tasks = finished_run(client, response.json()["id"])
            logs = {name: (tmp_path / f"worker-{name}.log").read_text()[-2000:] for name in workers}
            assert run["state"]["type"] == "COMPLETED", (run["state"], logs)
            (machine,) = [n for n, m in machines.items() if (m / "runs/pool/run.json").exists()
                          and json.loads((m / "runs/pool/run.json").read_text())
                          ["flow_run"] == run["id"]]  # fmt: skip
            return run, tasks, machine

        parameters = {"config_path": str(base), "work_dir": "runs/pool"}
        run, tasks, first = run_on_a_machine(parameters)
        assert task_states(tasks, "pool") == dict.fromkeys(STAGES, "Completed")
        record = json.loads((machines[first] / "runs/pool/run.json").read_text())
        assert record["work_dir"] == str(machines[first] / "runs/pool")
        # that machine's worker goes away: the next run of the deployment is the other's
        stop_process(workers.pop(first))
        run, tasks, second = run_on_a_machine({**parameters, "until": "tokenize"})
        assert second != first, (first, second)
        assert task_states(tasks, "pool", STAGES[:2]) == dict.fromkeys(STAGES[:2], "Completed")
    finally:
        for worker in workers.values():
            stop_process(worker)
        stop_process(server)
