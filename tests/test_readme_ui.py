"""The README's "Run it from the Prefect UI" commands, run as written from the repository root:
the background Prefect server is still up half a minute later (it used to die 10-12 s after
`prefect server start --background` said it runs), and `eaglet serve` registers both
deployments with it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import httpx
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

API = "http://127.0.0.1:4200/api"


def readme_ui_commands() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Run it from the Prefect UI") :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def port_4200_free() -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", 4200)) != 0


@pytest.mark.skipif(not port_4200_free(), reason="something already listens on port 4200")
def test_the_readmes_ui_commands_start_a_lasting_server_and_serve_the_deployments(tmp_path):
    commands = readme_ui_commands()
    assert "prefect server start --background" in commands and "eaglet serve" in commands
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    log = open(tmp_path / "readme.log", "wb")
    shell = subprocess.Popen(
        ["bash", "-euc", commands],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    started = time.monotonic()
    try:
        deployments: set[str] = set()
        while (
            time.monotonic() - started < 240
            and not {"pipeline", "pipeline-short-form", "generate-only"} <= deployments
        ):
            assert shell.poll() is None, (tmp_path / "readme.log").read_text()[-3000:]
            try:
                found = httpx.post(f"{API}/deployments/filter", json={}, timeout=5).json()
                deployments = {d["name"] for d in found}
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        assert {"pipeline", "pipeline-short-form", "generate-only"} <= deployments, (
            tmp_path / "readme.log"
        ).read_text()
        time.sleep(max(0.0, 40 - (time.monotonic() - started)))  # past the 10-12 s it lasted
        assert httpx.get(f"{API}/health", timeout=10).status_code == 200, "the server died"
    finally:
        log.close()
        if shell.poll() is None:  # `eaglet serve` (bash execs the last command) pauses its
            os.kill(shell.pid, signal.SIGTERM)  # deployments and exits, the server still up
            try:
                shell.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(shell.pid, signal.SIGKILL)
                shell.wait()
        subprocess.run(
            [str(ROOT / ".venv/bin/prefect"), "server", "stop"],
            cwd=ROOT,
            env={**env, "PREFECT_HOME": str(ROOT / ".prefect")},
            capture_output=True,
            timeout=60,
        )
