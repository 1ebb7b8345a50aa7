"""The resumable writer: resume by id, torn lines, failures retried, kill -9 mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from eaglet.engines.vllm import VLLMEngine
from eaglet.generation import (
    Failure,
    GenerationProgress,
    TooManyFailuresError,
    run_generation,
    run_generation_sync,
)
from eaglet.records.generations import Generation
from eaglet.records.io import read_jsonl, repair_and_read_ids, write_jsonl
from eaglet.records.prompts import Prompt
from tests.engine_helpers import TOKENIZER, make_config, make_prompt
from tests.fake_servers import EOS_ID, FakeServer, serve

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake():
    server = FakeServer(TOKENIZER)
    with serve(server) as url:
        server.url = url
        yield server


def engine(url: str, **generation) -> VLLMEngine:
    return VLLMEngine(make_config([url], **generation), end_ids=[EOS_ID])


def written_ids(path: Path) -> list[str]:
    return [json.loads(line)["sample_id"] for line in path.read_text().splitlines()]


def sample_ids_sent(server: FakeServer, prompts: list[Prompt], since: int = 0) -> list[str]:
    by_ids = {tuple(p.prompt_ids): p.sample_id for p in prompts}
    return [by_ids[ids] for ids in server.prompts_sent()[since:]]


def test_writes_every_record_once_and_reports_progress(fake, tmp_path):
    prompts = [make_prompt(i) for i in range(12)]
    reports: list[GenerationProgress] = []
    out, failed = tmp_path / "generations.jsonl", tmp_path / "failed.jsonl"
    summary = run_generation_sync(engine(fake.url), prompts, out, failed, reports.append)
    assert sorted(written_ids(out)) == [p.sample_id for p in prompts]
    assert all(isinstance(g, Generation) for g in read_jsonl(out, Generation))
    assert summary.written == summary.total == 12 and summary.failed == 0
    assert summary.finish_reasons == {"stop": 12} and summary.output_tokens > 0
    assert failed.read_text() == ""
    final = reports[-1]
    assert final.done == final.total == 12 and final.requests_per_s > 0
    assert final.output_tokens_per_s > 0 and final.eta_s == 0


def test_resume_skips_ids_already_written(fake, tmp_path):
    prompts = [make_prompt(i) for i in range(10)]
    out, failed = tmp_path / "generations.jsonl", tmp_path / "failed.jsonl"
    run_generation_sync(engine(fake.url), prompts[:4], out, failed)
    fake.log.clear()
    summary = run_generation_sync(engine(fake.url), prompts, out, failed)
    assert summary.already_done == 4 and summary.written == 6
    assert sorted(sample_ids_sent(fake, prompts)) == [p.sample_id for p in prompts[4:]]
    assert Counter(written_ids(out)) == Counter(p.sample_id for p in prompts)


def test_a_torn_last_line_is_cut_and_its_sample_generated_again(fake, tmp_path):
    prompts = [make_prompt(i) for i in range(5)]
    out, failed = tmp_path / "generations.jsonl", tmp_path / "failed.jsonl"
    run_generation_sync(engine(fake.url), prompts[:3], out, failed)
    with open(out, "a") as handle:
        handle.write('{"sample_id": "s003", "source": "toy", "prompt_ids": [1, 2')
    fake.log.clear()
    run_generation_sync(engine(fake.url), prompts, out, failed)
    assert sorted(sample_ids_sent(fake, prompts)) == ["s003", "s004"]
    assert Counter(written_ids(out)) == Counter(p.sample_id for p in prompts)


def test_failures_are_recorded_and_retried_by_a_rerun(fake, tmp_path):
    prompts = [make_prompt(i) for i in range(6)]
    out, failed = tmp_path / "generations.jsonl", tmp_path / "failed.jsonl"
    fake.faults.append("400")
    summary = run_generation_sync(engine(fake.url, concurrency=1), prompts, out, failed)
    assert summary.failed == 1 and summary.written == 5
    failures = list(read_jsonl(failed, Failure))
    assert len(failures) == 1 and failures[0].status == 400
    assert "maximum context length" in failures[0].message
    assert failures[0].sample_id not in written_ids(out)
    with pytest.raises(TooManyFailuresError, match="failed.jsonl"):
        summary.check(0.1)
    summary.check(0.2)
    fake.log.clear()
    rerun = run_generation_sync(engine(fake.url), prompts, out, failed)
    assert rerun.retried_failures == 1 and rerun.written == 1 and rerun.failed == 0
    assert sample_ids_sent(fake, prompts) == [failures[0].sample_id]
    assert failed.read_text() == ""
    assert sorted(written_ids(out)) == [p.sample_id for p in prompts]


def test_too_many_failures_stop_the_run_early(fake, tmp_path):
    prompts = [make_prompt(i) for i in range(40)]
    fake.faults.extend(["400"] * 40)
    with pytest.raises(TooManyFailuresError) as raised:
        run_generation_sync(
            engine(fake.url, concurrency=2),
            prompts,
            tmp_path / "generations.jsonl",
            tmp_path / "failed.jsonl",
            max_failure_fraction=0.05,
        )
    summary = raised.value.summary
    assert summary.stopped_early and summary.failed == 3
    assert len(fake.log) < 10


def test_a_sync_engine_runs_in_a_worker_thread(tmp_path):
    class SyncEngine:
        name = "local"

        def generate(self, prompts):
            for p in prompts:
                yield Generation(
                    sample_id=p.sample_id,
                    source=p.source,
                    prompt_ids=p.prompt_ids,
                    output_ids=[5, EOS_ID],
                    finish_reason="stop",
                    engine="local",
                )

    prompts = [make_prompt(i) for i in range(7)]
    out = tmp_path / "generations.jsonl"

    async def inside_a_loop():  # the sync wrapper also works where a loop already runs
        return run_generation_sync(SyncEngine(), prompts, out, tmp_path / "failed.jsonl")

    summary = asyncio.run(inside_a_loop())
    assert summary.written == 7 and sorted(written_ids(out)) == [p.sample_id for p in prompts]


def test_duplicate_prompt_ids_are_sent_once(fake, tmp_path):
    prompts = [make_prompt(1), make_prompt(1), make_prompt(2)]
    out = tmp_path / "generations.jsonl"
    summary = asyncio.run(run_generation(engine(fake.url), prompts, out, tmp_path / "f.jsonl"))
    assert summary.total == 2 and len(fake.log) == 2 and len(written_ids(out)) == 2


CHILD = """
import sys
from pathlib import Path
from eaglet.config import PipelineConfig
from eaglet.engines.vllm import VLLMEngine
from eaglet.generation import run_generation_sync
from eaglet.records.io import read_jsonl
from eaglet.records.prompts import Prompt

url, prompts_path, out, failed = sys.argv[1:5]
config = PipelineConfig.model_validate(
    {"generation": {"engine": "vllm", "endpoints": [url], "concurrency": 8}}
)
prompts = list(read_jsonl(Path(prompts_path), Prompt))
run_generation_sync(VLLMEngine(config, end_ids=[2]), prompts, Path(out), Path(failed))
"""


def test_sigkill_mid_run_then_resume_sends_nothing_twice(tmp_path):
    prompts = [make_prompt(i) for i in range(300)]
    prompts_path = tmp_path / "prompts.jsonl"
    write_jsonl(prompts_path, prompts)
    out, failed = tmp_path / "generations.jsonl", tmp_path / "failed.jsonl"
    fake = FakeServer(TOKENIZER, delay_s=0.03)
    with serve(fake) as url:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, url, str(prompts_path), str(out), str(failed)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        deadline = time.monotonic() + 60
        while not out.exists() or out.stat().st_size < 60 * 400:  # ~60 records
            assert child.poll() is None, "the child finished before it could be killed"
            assert time.monotonic() < deadline, "the child wrote nothing"
            time.sleep(0.005)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        sent_before_kill = len(fake.log)
        finished = repair_and_read_ids(out)  # also cuts a torn last line
        assert 0 < len(finished) < len(prompts)
        summary = run_generation_sync(engine(url), prompts, out, failed)
        resent = sample_ids_sent(fake, prompts, since=sent_before_kill)
    assert set(resent).isdisjoint(finished), "a finished sample was sent again"
    # every unfinished sample sent again (a loaded machine may time one out and retry it)
    assert set(resent) == {p.sample_id for p in prompts} - finished
    counts = Counter(written_ids(out))
    assert set(counts) == {p.sample_id for p in prompts}
    assert max(counts.values()) == 1, "a sample was written twice"
    assert summary.already_done == len(finished) and summary.failed == 0


def test_a_bad_line_in_the_middle_is_set_aside_and_every_later_record_kept(fake, tmp_path):
    """Issue 13: resume's repair used to truncate at the first unreadable line, deleting every
    record after it. Only a torn last line may be cut; a bad middle line is moved, with its
    line number, to generations.rejected-lines.jsonl and the records after it stay."""
    prompts = [make_prompt(i) for i in range(10)]
    out, failed = tmp_path / "generations.jsonl", tmp_path / "failed.jsonl"
    run_generation_sync(engine(fake.url), prompts, out, failed)
    lines = out.read_bytes().splitlines(keepends=True)
    victim = json.loads(lines[3])["sample_id"]
    bad_json = b'{"sample_id": "x", "output_ids": [1, 2\n'
    bad_utf8, no_id = b"\xff\xfe{}\n", b"{}\n"
    damaged = lines[:3] + [bad_json] + lines[4:6] + [bad_utf8, no_id] + lines[6:]
    out.write_bytes(b"".join(damaged) + b'{"sample_id": "torn", "outp')  # + a torn last line
    sent_before = len(fake.log)
    summary = run_generation_sync(engine(fake.url), prompts, out, failed)
    # Only the sample whose line was damaged is generated again: nine records survived.
    assert sample_ids_sent(fake, prompts, since=sent_before) == [victim]
    assert summary.already_done == 9 and summary.set_aside_lines == 3
    assert Counter(written_ids(out)) == Counter(p.sample_id for p in prompts)
    rejected = [json.loads(x) for x in (tmp_path / "generations.rejected-lines.jsonl").open()]
    assert [r["line"] for r in rejected] == [4, 7, 8]
    assert all(r["file"] == "generations.jsonl" and r["why"] for r in rejected)
    # The set-aside text is the original bytes (bad UTF-8 included), not a lossy copy.
    restored = [r["text"].encode("utf-8", "surrogateescape") + b"\n" for r in rejected]
    assert restored == [bad_json, bad_utf8, no_id]
    assert "torn" not in out.read_text()


def test_repair_keeps_a_clean_file_byte_for_byte(tmp_path):
    path = tmp_path / "generations.jsonl"
    content = b'{"sample_id": "a"}\n\n{"sample_id": "b"}\n'
    path.write_bytes(content)
    assert repair_and_read_ids(path) == {"a", "b"}
    assert path.read_bytes() == content
    assert not (tmp_path / "generations.rejected-lines.jsonl").exists()
