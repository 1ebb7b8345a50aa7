"""`eaglet serve` waits for a Prefect server only where one may still come up: a loopback URL
waits long only when a `prefect server start` for that port runs on this machine; a server
starting on another port never answers this one, so a refused port fails in seconds
(issue 46: it waited 120 s)."""

from __future__ import annotations

import subprocess
import sys
import time

from eaglet.vllm_process import free_port
from eaglet_prefect.flows.prefect_server import (
    NO_SERVER_STARTING_WAIT_S,
    SERVER_WAIT_S,
    prefect_server_starting,
    server_wait_s,
)


def test_a_server_starting_on_another_port_does_not_make_serve_wait_for_this_one():
    port, other = free_port(), free_port()
    # a process whose command line is a `prefect server start --port PORT`
    starting = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "prefect", "server", "start",
         "--port", str(port)]
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not prefect_server_starting(port=port) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server_wait_s(f"http://127.0.0.1:{port}/api") == SERVER_WAIT_S
        assert server_wait_s(f"http://127.0.0.1:{other}/api") == NO_SERVER_STARTING_WAIT_S
    finally:
        starting.kill()
        starting.wait()
