"""Servers a later stage reaches or starts, checked now rather than hours into the run: the
serving check's vLLM python (`evaluate.vllm_python`) or running server
(`evaluate.serving_endpoint`: it answers, and as vLLM), and a Dask scheduler
(`execution.dask_address`). The vLLM probes serve the hidden-state backend's own check too.
The generation servers are the canary's (`eaglet.canary`).
"""

from __future__ import annotations

import os
from pathlib import Path

from eaglet.config.pipeline import PipelineConfig
from eaglet.preflight.report import PreflightReport, first_line

# Exit status 0 where the python can import vllm; finds the package without importing it.
_FINDS_VLLM = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"


def check_python_with_vllm(setting: str, python: str, report: PreflightReport) -> None:
    """`python` (the value of `setting`) is an executable that finds the vllm package: the
    server it starts comes hours into a run, after training."""
    import subprocess

    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        report.problems.append(
            f"{setting}: {python} is not an executable file: give the python of a venv with "
            "vLLM installed (e.g. .vllm-venv/bin/python)"
        )
        return
    try:
        found = subprocess.run([python, "-c", _FINDS_VLLM], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        report.problems.append(f"{setting}: {python} did not run: {first_line(exc)}")
        return
    if found.returncode != 0:
        report.problems.append(
            f"{setting}: {python} has no vllm package (`{python} -c 'import vllm'` fails): give "
            "the python of a venv with vLLM installed (e.g. .vllm-venv/bin/python; "
            "`make vllm-venv` makes it)"
        )
    else:
        report.passed.append(f"{setting} {python}: finds vllm")


def check_vllm_python(config: PipelineConfig, report: PreflightReport) -> None:
    """The vLLM python the serving check starts a server with finds vLLM: the server starts
    only at the evaluate stage, hours into a run (the hidden-state backend's is its own
    check, `check_hidden_states_backend`, with `check_python_with_vllm` too)."""
    evaluate = config.evaluate
    python = evaluate.vllm_python
    if evaluate.serving != "vllm" or evaluate.serving_endpoint or not python:
        return
    check_python_with_vllm("evaluate.vllm_python", python, report)
    if evaluate.temperature > 0:
        import torch

        if not torch.cuda.is_available():  # the vLLM eaglet starts here is its CPU build
            report.problems.append(
                f"evaluate.temperature={config.evaluate.temperature:g} with evaluate.serving="
                "vllm on a vLLM eaglet starts on this CPU: vLLM 0.32's CPU build verifies sampled "
                "drafts wrongly (its _expand_kernel_impl casts each request's temperature to "
                "an integer), so the served check would fail after the whole run; set "
                "evaluate.temperature: 0, evaluate.serving: none, or a GPU server in "
                "evaluate.serving_endpoint"
            )


ENDPOINT_TIMEOUT_S = 5.0


def vllm_endpoint_problem(setting: str, url: str) -> str | None:
    """Why `url` is not a vLLM server that answers (refused, timed out, no `/v1/models`), in
    one line naming `setting` and the URL; None when it answers as vLLM does."""
    import httpx

    probe = f"{url}/v1/models"
    try:
        response = httpx.get(probe, timeout=ENDPOINT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return (
            f"{setting}: {url} does not answer (GET {probe}: {first_line(exc)}): start the "
            "server, fix the URL, or leave it unset so that eaglet starts one (vllm_python)"
        )
    try:
        models = response.json().get("data") if response.status_code == 200 else None
    except ValueError:
        models = None
    if not isinstance(models, list):
        return (
            f"{setting}: {url} answers, but not as a vLLM server (GET {probe}: HTTP "
            f"{response.status_code}): point it at vLLM's OpenAI API server"
        )
    return None


def not_vllm_problem(setting: str, url: str, needed: str, instead: str) -> str | None:
    """Why `url` is not vLLM: no Prometheus `/metrics` with vLLM's `vllm:` series (any
    OpenAI-compatible server answers /v1/models too). `needed` says what needs vLLM,
    `instead` what to do."""
    import httpx

    try:
        response = httpx.get(f"{url}/metrics", timeout=ENDPOINT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return f"{setting}: GET {url}/metrics failed ({first_line(exc)}): {needed}"
    if response.status_code != 200 or "vllm:" not in response.text:
        return (
            f"{setting}: {url} answers /v1/models but is not vLLM (its /metrics, HTTP "
            f"{response.status_code}, has no vLLM counters): {needed}; {instead}"
        )
    return None


def check_vllm_server(
    setting: str, url: str, needed: str, instead: str, report: PreflightReport
) -> None:
    """`url` (the value of `setting`) answers as a vLLM server does, or the problem: refused,
    timed out, no `/v1/models`, or no vLLM counters (`needed` says what needs vLLM, `instead`
    what to do)."""
    problem = vllm_endpoint_problem(setting, url) or not_vllm_problem(setting, url, needed, instead)
    if problem:
        report.problems.append(problem)
    else:
        report.passed.append(f"{setting} {url}: a vLLM server answers")


def _tcp_problem(setting: str, address: str) -> str | None:
    import socket

    host_port = address.split("://", 1)[-1].rstrip("/")
    host, _, port = host_port.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=ENDPOINT_TIMEOUT_S):
            return None
    except ValueError:
        return f"{setting}: {address!r} has no port; write tcp://host:8786"
    except OSError as exc:
        return (
            f"{setting}: nothing answers at {address} ({exc.strerror or exc}): start the "
            "Dask scheduler, fix the address, or leave it unset for a local cluster"
        )


def check_endpoints(config: PipelineConfig, report: PreflightReport) -> None:
    """Servers the later stages will use, checked now rather than hours into the run: the
    serving check's running server and a Dask scheduler. The generation servers are the
    canary's (the first minute of generate); the hidden-state backend's are its own check."""
    url = config.evaluate.serving_endpoint
    if config.evaluate.serving == "vllm" and url:
        check_vllm_server(
            "evaluate.serving_endpoint",
            url,
            "served τ is read from vLLM's spec-decode counters",
            "point it at a vLLM server started with the draft, or set evaluate.serving: none",
            report,
        )
    execution = config.execution
    if execution.task_runner == "dask" and execution.dask_address:
        problem = _tcp_problem("execution.dask_address", execution.dask_address)
        if problem:
            report.problems.append(problem)
        else:
            report.passed.append(f"execution.dask_address {execution.dask_address}: answers")
