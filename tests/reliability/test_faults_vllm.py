"""Server faults a real vLLM server produces: a wrong model name, and a server killed and
started again in the middle of a run.

- Wrong `generation.served_model`: vLLM answers 404 "The model `...` does not exist."; the
  canary stops the run within seconds, says to set generation.served_model, and the stage is
  not retried; with the name fixed, the same command completes.
- Server restart: `eaglet run` generates against vLLM; the server is SIGKILLed mid-run and
  started again on the same port. Requests in flight and those sent while it is down are
  retried (or, if the retries run out, fail clearly and the same command resumes them);
  every sample ends up written exactly once, and the restarted server's own counters show
  it was sent only the samples not yet written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import run_cli, write_http_run_config
from tests.reliability.conftest import (
    kill_group,
    kill_marked,
    records_by_id,
    start_run,
    temporary_leftovers,
    wait_for_no_marked_processes,
)
from tests.vllm_server import free_port, stop_process_group, vllm_python

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)"),
]

SAMPLES = 16


class RestartableVLLM:
    """A vLLM server serving the fixture as `tiny` on one fixed port, killable and
    restartable there."""

    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout_s: float = 400) -> None:
        self.starts += 1
        log = open(self.log_dir / f"vllm-{self.starts}.log", "w")
        self.process = subprocess.Popen(
            [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
             "--model", str(self.model_dir), "--served-model-name", "tiny",
             "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
             "--max-model-len", "1024", "--enforce-eager"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"},
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited; see {self.log_dir}/vllm-{self.starts}.log")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM not healthy after {timeout_s} s")
            time.sleep(1)

    def kill(self) -> None:
        """SIGKILL the server and its children, as a crash or an OOM kill would."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process, signal.SIGTERM, grace_s=30)

    def successes(self) -> int:
        """Requests this server process finished (vLLM's own counter)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return int(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total{")
            )
        )


@pytest.fixture(scope="module")
def vllm(fixture_model_dir, tmp_path_factory):
    server = RestartableVLLM(fixture_model_dir, tmp_path_factory.mktemp("vllm-logs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def generate_folder(work_dir: Path) -> Path:
    folders = sorted((work_dir / "generate").iterdir())
    done = [f for f in folders if (f / "manifest.json").exists()]
    return (done or folders)[-1]


def output(result) -> str:
    return result.stdout[-4000:] + result.stderr[-4000:]


def test_a_wrong_model_name_fails_fast_with_the_fix_then_the_right_one_completes(
    vllm, tmp_path, fixture_model_dir, sample_data_dir
):
    config = write_http_run_config(
        tmp_path, fixture_model_dir, sample_data_dir, vllm.url, SAMPLES,
        max_tokens=160, canary_requests=2,
    )  # fmt: skip
    settings = json.loads(config.read_text())
    settings["generation"]["served_model"] = "no-such-model"
    config.write_text(json.dumps(settings))
    before = vllm.successes()
    started = time.monotonic()
    wrong = run_cli(["run", str(config), "--until", "generate"], cwd=tmp_path)
    seconds = time.monotonic() - started
    print(f"wrong model name: eaglet run failed after {seconds:.1f} s")
    assert wrong.returncode != 0
    text = output(wrong)
    assert "no-such-model" in text and "served_model" in text, text
    assert "AwaitingRetry" not in text, "a wrong model name was retried"
    assert vllm.successes() == before

    settings["generation"]["served_model"] = "tiny"
    config.write_text(json.dumps(settings))
    right = run_cli(["run", str(config), "--until", "generate"], cwd=tmp_path)
    assert right.returncode == 0, output(right)
    records, duplicates = records_by_id(generate_folder(tmp_path / "work") / "generations.jsonl")
    assert len(records) == SAMPLES and not duplicates


def test_a_server_killed_and_restarted_mid_run_loses_and_repeats_no_sample(
    vllm, tmp_path, fixture_model_dir, sample_data_dir
):
    samples = 48
    config = write_http_run_config(
        tmp_path, fixture_model_dir, sample_data_dir, vllm.url, samples,
        max_tokens=96, canary_requests=1, concurrency=4, max_retries=12, retry_backoff_s=2.0,
        request_timeout_s=60, max_failure_fraction=1.0,
    )  # fmt: skip
    args = ["run", str(config), "--until", "generate"]
    work_dir = tmp_path / "work"
    process, marker = start_run(args, tmp_path, tmp_path / "run.log")
    try:
        deadline = time.monotonic() + 600
        written = 0
        while written < 6:
            assert process.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "fewer than 6 records in 10 minutes"
            generate = work_dir / "generate"
            path = generate_folder(work_dir) / "generations.jsonl" if generate.exists() else None
            written = path.read_bytes().count(b"\n") if path and path.exists() else 0
            time.sleep(0.05)
        vllm.kill()
        time.sleep(2)  # answers received before the kill are written by now
        done_before_restart = len(records_by_id(path)[0])
        assert done_before_restart < samples, "the run finished before the server was killed"
        vllm.start()
        first_rc = process.wait(timeout=900)
        assert not wait_for_no_marked_processes(marker)
    finally:
        if process.poll() is None:
            kill_group(process)
        kill_marked(marker)
    first_log = (tmp_path / "run.log").read_text()
    folder = generate_folder(work_dir)
    failed = records_by_id(folder / "failed.jsonl")[0] if (folder / "failed.jsonl").exists() else {}
    assert first_rc == 0, first_log[-3000:]
    if failed:  # retries ran out while the server was down: listed, then sent again
        rerun = run_cli([*args, "--retry-failed"], cwd=tmp_path)
        assert rerun.returncode == 0, output(rerun)
    print(
        f"server restart: {done_before_restart} records before the kill, first run rc "
        f"{first_rc}, {len(failed)} failed then, {vllm.successes()} answered after restart"
    )
    folder = generate_folder(work_dir)
    records, duplicates = records_by_id(folder / "generations.jsonl")
    assert len(records) == samples and not duplicates
    assert (folder / "manifest.json").exists()
    # The restarted server answered each sample not yet written (and a rerun's canary).
    canary = 1 if failed else 0
    assert vllm.successes() == samples - done_before_restart + canary
    assert not temporary_leftovers(work_dir), temporary_leftovers(work_dir)
