"""A local server child (eaglet.vllm_process): its port, and which server on that port counts as
up. A plain Python HTTP server stands in for vLLM (this is about the process, not vLLM)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglet.vllm_process import (
    VllmServerError,
    free_port,
    group_is_running,
    stop_process_group,
    vllm_server,
)
from tests.fake_servers import serve

# a child that imports for `delay` seconds, as vLLM does, then binds --port and answers /health
CHILD = """
import http.server, sys, time
time.sleep(float(sys.argv[3]))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Health).serve_forever()
"""


def child_command(tmp_path: Path, port: int, delay_s: float) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return [sys.executable, str(script), "--port", str(port), str(delay_s)]


def test_the_port_is_outside_the_range_the_kernel_hands_out():
    first, _last = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {free_port() for _ in range(20)}
    assert all(port < first for port in ports)
    assert len(ports) > 1  # chosen at random, so two servers starting together do not collide


async def health_only(scope, receive, send):
    status = 200 if scope["path"] == "/health" else 404
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_another_server_on_the_port_is_never_taken_for_ours(tmp_path):
    """The CI failure of stop 42: another program answered /health on the port before vLLM had
    imported, and eaglet measured against it (a 404 on /metrics). Now the child must hold the
    listening socket, and its failure to bind is the error, naming the port."""
    with serve(health_only) as other:
        port = int(other.rsplit(":", 1)[1])
        command = child_command(tmp_path, port, delay_s=1.0)
        with pytest.raises(VllmServerError, match=f"port {port} is held by another program"):
            with vllm_server(command, tmp_path / "server.log", startup_timeout_s=30):
                pytest.fail("yielded a server that is not ours")


def test_our_own_server_counts_once_it_answers(tmp_path):
    port = free_port()
    command = child_command(tmp_path, port, delay_s=1.0)
    with vllm_server(command, tmp_path / "server.log", startup_timeout_s=30) as url:
        assert url == f"http://127.0.0.1:{port}"


def test_stopping_returns_only_once_every_process_of_the_group_has_exited(tmp_path):
    """vLLM's API server has a child in its group (multiprocessing's resource tracker) that
    writes its last lines to the same log after the API server has exited; a log sealed into
    a manifest before then no longer matches its size (`eaglet inspect` read such an evaluate
    folder as corrupt). The leader here dies at once on SIGTERM; its child takes half a
    second to write its last line."""
    log_path = tmp_path / "server.log"
    script = (
        '(trap "sleep 0.5; echo the child stopped; exit 0" TERM; '
        "while :; do sleep 0.05; done) & echo started; wait"
    )
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            ["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    while "started" not in log_path.read_text():
        time.sleep(0.05)
    time.sleep(0.2)  # the child has set its trap
    stop_process_group(process, signal.SIGTERM, grace_s=10)
    assert log_path.read_text().splitlines()[-1] == "the child stopped"
    assert not group_is_running(process.pid)


def test_a_group_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    process = subprocess.Popen(
        ["bash", "-c", 'trap "" TERM; (trap "" TERM; sleep 60) & sleep 60'],
        start_new_session=True,
    )
    time.sleep(0.3)
    stop_process_group(process, signal.SIGTERM, grace_s=1)
    assert process.returncode == -signal.SIGKILL and not group_is_running(process.pid)
