"""Server faults against the generate stage, through `eaglet run` as a user runs it.

Each fault is injected by the stand-in server of `tests/fake_servers.py` (only faults that no
real server produces on demand; a restarted server and a wrong model name are tested against
real vLLM in test_faults_vllm.py). For each: the run either retries the fault away or fails
clearly, naming the samples and the file that lists them; no sample is silently skipped
(every prompt is in `generations.jsonl` or in `failed.jsonl`); and a rerun, once the fault is
gone, completes with every sample exactly once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from eaglet.config import TargetConfig
from eaglet.target import load_tokenizer
from tests.conftest import run_cli, write_http_run_config
from tests.fake_servers import FakeServer, ResetProxy, serve
from tests.reliability.conftest import (
    kill_group,
    kill_marked,
    records_by_id,
    start_run,
    temporary_leftovers,
    wait_for_no_marked_processes,
)

pytestmark = pytest.mark.slow

SAMPLES = 6
CANARY = 1
# Short limits so a fault costs seconds: backoff 0.05 s doubling, 4 retries per request.
FAST_RETRIES = {
    "canary_requests": CANARY,
    "concurrency": 2,
    "max_retries": 4,
    "retry_backoff_s": 0.05,
    "request_timeout_s": 1.5,
    "max_tokens": 64,
}


@pytest.fixture(scope="module")
def tokenizer(fixture_model_dir):
    return load_tokenizer(TargetConfig(model=str(fixture_model_dir)))


def generate_folder(work_dir: Path) -> Path:
    """The generate stage's folder: the finished one, else the `.partial` one."""
    folders = sorted((work_dir / "generate").iterdir())
    finished = [f for f in folders if (f / "manifest.json").exists()]
    return (finished or folders)[-1]


def prompt_ids(work_dir: Path) -> set[str]:
    [folder] = [f for f in (work_dir / "tokenize").iterdir() if (f / "manifest.json").exists()]
    return set(records_by_id(folder / "prompts.jsonl")[0])


def accounted(work_dir: Path) -> tuple[Counter, set[str]]:
    """(how often each sample id is in generations.jsonl, ids in failed.jsonl)."""
    folder = generate_folder(work_dir)
    generations = folder / "generations.jsonl"
    lines = generations.read_text().splitlines() if generations.exists() else []
    written = Counter(line.split('"sample_id":"', 1)[1].split('"', 1)[0] for line in lines)
    failed_path = folder / "failed.jsonl"
    failed = set(records_by_id(failed_path)[0]) if failed_path.exists() else set()
    return written, failed


def assert_every_sample_exactly_once(work_dir: Path) -> None:
    written, failed = accounted(work_dir)
    assert (work_dir / "generate").is_dir()
    assert (generate_folder(work_dir) / "manifest.json").exists(), "generate did not finish"
    assert set(written) == prompt_ids(work_dir), "a sample is missing from generations.jsonl"
    assert max(written.values()) == 1, f"written twice: {[k for k, v in written.items() if v > 1]}"
    assert not failed
    assert not temporary_leftovers(work_dir), temporary_leftovers(work_dir)


def run_generate(folder: Path) -> tuple[object, float]:
    started = time.monotonic()
    result = run_cli(["run", str(folder / "config.yaml"), "--until", "generate"], cwd=folder)
    return result, time.monotonic() - started


def output(result) -> str:
    """Everything a run printed (a loaded machine's Prefect shutdown noise can fill the tail)."""
    return result.stdout + result.stderr


TRANSIENT = ["503", "500", "429:1", "hang", "drop", "malformed", "truncated"]


def test_transient_faults_are_retried_and_every_sample_is_written_once(
    tmp_path, fixture_model_dir, sample_data_dir, tokenizer
):
    """One of each transient server fault (5xx, 429 with Retry-After, no answer within
    request_timeout_s, a connection dropped mid-answer, a body that is not JSON, JSON cut
    short), then TCP resets of every open connection (requests in flight) and of the next new
    ones: each faulted request is sent again, the run completes without a failure, and every
    sample is written once."""
    server = FakeServer(tokenizer, hang_s=4.0, delay_s=0.2)
    server.faults.extend(["ok"] * CANARY + TRANSIENT)
    generation = {**FAST_RETRIES, "max_retries": 8}
    with serve(server) as url:
        proxy = ResetProxy(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        write_http_run_config(
            tmp_path, fixture_model_dir, sample_data_dir, proxy.url, SAMPLES, **generation
        )

        def reset_once_the_faults_are_through() -> None:
            deadline = time.monotonic() + 600
            while len(server.log) < CANARY + len(TRANSIENT) + 1:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
            proxy.reset_next(2)
            proxy.reset_all()

        resetter = threading.Thread(target=reset_once_the_faults_are_through, daemon=True)
        resetter.start()
        try:
            result, _ = run_generate(tmp_path)
        finally:
            resetter.join(timeout=5)
            proxy.close()
    assert result.returncode == 0, output(result)
    faults = [entry["fault"] for entry in server.log if entry["fault"]]
    assert sorted(faults) == sorted(TRANSIENT), faults
    assert proxy.resets >= 2, f"only {proxy.resets} connections were reset"
    answered = len(server.log) - CANARY - len(TRANSIENT)
    assert answered >= SAMPLES, "a faulted sample was not sent again"
    assert_every_sample_exactly_once(tmp_path / "work")


def run_through_a_failed_try(folder: Path) -> tuple[int, str, dict]:
    """`eaglet run --until generate` whose generate task fails once (too many failed samples)
    and is retried by Prefect: (exit code, output, what the stage folder held when the
    failure was reported: written and failed ids, whether a manifest was there)."""
    log = folder / "run.log"
    process, marker = start_run(["run", str(folder / "config.yaml"), "--until", "generate"],
                                folder, log)  # fmt: skip
    seen: dict = {}
    try:
        deadline = time.monotonic() + 900
        while process.poll() is None and time.monotonic() < deadline:
            if not seen and "max_failure_fraction" in log.read_text(errors="replace"):
                written, failed = accounted(folder / "work")
                finished = (generate_folder(folder / "work") / "manifest.json").exists()
                seen = {"written": set(written), "failed": failed, "finished": finished}
            time.sleep(0.05)
        code = process.wait(timeout=10)
        assert not wait_for_no_marked_processes(marker)
    finally:
        if process.poll() is None:
            kill_group(process)
        kill_marked(marker)
    return code, log.read_text(errors="replace"), seen


def test_a_5xx_storm_longer_than_the_request_retries_fails_the_try_and_the_task_retry_completes(
    tmp_path, fixture_model_dir, sample_data_dir, tokenizer
):
    """Every request gets 503 for longer than a request's own retries last: those samples fail
    for good, the stage's try fails naming them and failed.jsonl, nothing is taken as done;
    the task's retry (a transient fault) comes after the storm and completes, each sample
    written once, no finished sample sent again."""
    server = FakeServer(tokenizer)
    generation = {**FAST_RETRIES, "max_retries": 2, "retry_backoff_s": 0.01}
    with serve(server) as url:
        write_http_run_config(
            tmp_path, fixture_model_dir, sample_data_dir, url, SAMPLES, **generation
        )

        def storm_after_the_canary() -> None:
            deadline = time.monotonic() + 600
            while not server.log and time.monotonic() < deadline:
                time.sleep(0.005)
            server.storm(5.0)

        threading.Thread(target=storm_after_the_canary, daemon=True).start()
        code, text, seen = run_through_a_failed_try(tmp_path)
    assert seen, "the stage never failed: " + text[-3000:]
    assert "failed.jsonl" in text and "HTTP 503" in text, text[-3000:]
    assert not seen["finished"], "the stage was taken as done with samples missing"
    assert seen["failed"] and not seen["written"] & seen["failed"]
    assert code == 0, text[-4000:]
    answered = [e for e in server.log if e["fault"] is None]
    assert len(answered) == 2 * CANARY + SAMPLES, "a finished sample was sent again"
    assert_every_sample_exactly_once(tmp_path / "work")


def test_a_sample_answered_with_cut_json_every_time_fails_clearly_then_a_rerun_completes(
    tmp_path, fixture_model_dir, sample_data_dir, tokenizer
):
    """One request answered with JSON cut short on each of its tries: that sample fails with
    the body quoted, the stage fails over max_failure_fraction keeping every good record and
    naming failed.jsonl (a server that answers one prompt with bad JSON three times is not
    retried as a task); the same command then sends only the samples not written yet."""
    server = FakeServer(tokenizer)
    server.faults.extend(["ok"] * CANARY + ["truncated"] * 3)  # 1 try + 2 retries
    generation = {**FAST_RETRIES, "concurrency": 1}
    with serve(server) as url:
        write_http_run_config(
            tmp_path, fixture_model_dir, sample_data_dir, url, SAMPLES, **generation
        )
        failed_run, _ = run_generate(tmp_path)
        work_dir = tmp_path / "work"
        written, failed = accounted(work_dir)
        finished = (generate_folder(work_dir) / "manifest.json").exists()
        sent_before = len(server.log)
        rerun, _ = run_generate(tmp_path)
    assert failed_run.returncode != 0, output(failed_run)
    text = output(failed_run)
    assert "malformed answer" in text and "failed.jsonl" in text, text
    assert len(failed) == 1 and not set(written) & failed and not finished
    assert rerun.returncode == 0, output(rerun)
    resent = len(server.log) - sent_before
    assert resent == CANARY + SAMPLES - len(written), "the rerun sent a finished sample again"
    assert_every_sample_exactly_once(work_dir)


def test_a_server_that_returns_text_without_token_ids_fails_fast_then_a_rerun_completes(
    tmp_path, fixture_model_dir, sample_data_dir, tokenizer
):
    """The vllm engine needs token ids; a server that ignores `return_token_ids` is a setup
    error: the canary stops the run before any sample is sent, saying what is missing."""
    server = FakeServer(tokenizer, completion_token_ids=False)
    with serve(server) as url:
        write_http_run_config(
            tmp_path, fixture_model_dir, sample_data_dir, url, SAMPLES, **FAST_RETRIES
        )
        failed_run, seconds = run_generate(tmp_path)
        sent = len(server.log)
        server.completion_token_ids = True
        rerun, _ = run_generate(tmp_path)
    assert failed_run.returncode != 0, output(failed_run)
    assert "token_ids" in output(failed_run) and "canary" in output(failed_run)
    assert sent <= 2 * CANARY * 4, f"{sent} requests for a setup error (retried as transient?)"
    print(f"text without token ids: failed after {seconds:.1f} s, {sent} requests")
    assert rerun.returncode == 0, output(rerun)
    assert_every_sample_exactly_once(tmp_path / "work")
