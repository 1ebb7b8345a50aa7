"""A local vLLM OpenAI server as a child process: started in its own process group, waited for
on `/health`, stopped by signalling the whole group (vLLM has child processes).

One home for what both users of a local server need: the evaluate stage (the target with the
draft as its eagle3 speculative model, `eaglet.draft.serving`) and the hidden_states stage and
online training (the target with `extract_hidden_states`, `eaglet.hidden_states.vllm_backend`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from eaglet.errors import PermanentError


class VllmServerError(PermanentError, RuntimeError):
    """The server exited or never became healthy while starting (its log says why)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process_group(
    process: subprocess.Popen, first: signal.Signals = signal.SIGTERM, grace_s: float = 30.0
) -> None:
    """Send `first` to the group of a process started with `start_new_session=True`; SIGKILL
    the group if anything is left after `grace_s`."""
    if process.poll() is None:
        os.killpg(process.pid, first)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextmanager
def vllm_server(
    command: list[str],
    log_path: Path,
    startup_timeout_s: float,
    env: dict[str, str] | None = None,
    timeout_setting: str = "the startup timeout",
) -> Iterator[str]:
    """Run `command` (a vLLM OpenAI server on 127.0.0.1, its `--port` in it) in its own process
    group with `env` added to this environment, wait for `/health`, yield the base URL, and
    stop the whole group afterwards. `timeout_setting` names the config key of the timeout in
    the error."""
    port = command[command.index("--port") + 1]
    base_url = f"http://127.0.0.1:{port}"
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; read by the CPU backend only
    log_path = Path(log_path)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        try:
            deadline = time.time() + startup_timeout_s
            while True:
                if process.poll() is not None:
                    raise VllmServerError(
                        f"vLLM exited with {process.returncode} while starting; see {log_path}"
                    )
                try:
                    if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    raise VllmServerError(
                        f"vLLM not healthy after {startup_timeout_s:.0f} s ({timeout_setting}); "
                        f"see {log_path}"
                    )
                time.sleep(1)
            yield base_url
        finally:
            stop_process_group(process)
