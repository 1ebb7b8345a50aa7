"""A schedule added in the Prefect UI (here: through the same API call) outlives a restart of
`eaglet serve`: the deployment comes back with it, active and unpaused."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from tests.prefect_server_helpers import RetryingTransport, start_process, stop_process, wait_for
from tests.vllm_server import free_port

pytestmark = pytest.mark.slow


def test_a_schedule_added_in_the_ui_survives_a_serve_restart(tmp_path):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    prefect = str(Path(sys.executable).with_name("prefect"))
    command = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"]
    server = start_process(command, env, tmp_path / "server.log")
    client = httpx.Client(base_url=api, timeout=30, transport=RetryingTransport())  # 503: busy
    serving = None

    def deployment():
        try:
            found = client.post("/deployments/filter", json={}).json()
        except (httpx.HTTPError, ValueError):
            return None
        return next((d for d in found if d["name"] == "pipeline"), None)

    def serve(log: str):
        process = start_process(
            [sys.executable, "-m", "eaglet_prefect.flows.cli", "serve"], env, tmp_path / log
        )
        return process, wait_for(deployment, 180, "the served deployment")

    try:
        serving, first = serve("serve-1.log")
        assert first["schedules"] == []
        added = client.post(
            f"/deployments/{first['id']}/schedules",
            json=[{"schedule": {"cron": "0 3 * * *", "timezone": "UTC"}, "active": True}],
        )
        assert added.status_code == 201, added.text
        stop_process(serving)
        serving, again = serve("serve-2.log")
        wait_for(lambda: not deployment()["paused"], 60, "the deployment unpaused")
        again = deployment()
        assert again["id"] == first["id"]
        schedules = [(s["schedule"].get("cron"), s["active"]) for s in again["schedules"]]
        assert schedules == [("0 3 * * *", True)], again["schedules"]
    finally:
        if serving is not None:
            stop_process(serving)
        stop_process(server)
