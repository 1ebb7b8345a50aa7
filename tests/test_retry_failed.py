"""`eaglet run --retry-failed`: a finished generate stage with failed samples sends exactly
those again, keeps every record already written, and later stages see the completed data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglet.config import TargetConfig
from eaglet.generation import Failure
from eaglet.records.generations import Generation
from eaglet.records.io import read_jsonl
from eaglet.target import load_tokenizer
from tests.conftest import run_cli, write_http_run_config
from tests.fake_servers import FakeServer, serve

pytestmark = pytest.mark.slow
CANARY_REQUESTS = 2


def generate_stage(work_dir: Path) -> tuple[str, Path]:
    stage = json.loads((work_dir / "run.json").read_text())["stages"]["generate"]
    return stage["state"], Path(stage["path"])


def test_retry_failed_sends_only_the_failed_samples(tmp_path, fixture_model_dir, sample_data_dir):
    # The fake server answers in the fixture's own tokens, so the canary's checks hold.
    server = FakeServer(load_tokenizer(TargetConfig(model=str(fixture_model_dir))))
    with serve(server) as url:
        config_path = write_http_run_config(
            tmp_path, fixture_model_dir, sample_data_dir, url, samples=6,
            concurrency=1, canary_requests=CANARY_REQUESTS, max_failure_fraction=0.5,
        )  # fmt: skip
        args = ["run", str(config_path), "--until", "generate"]
        server.faults.extend(["ok"] * CANARY_REQUESTS + ["400"])  # the first sample is refused
        first = run_cli(args, cwd=tmp_path)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        state, folder = generate_stage(tmp_path / "work")
        failures = list(read_jsonl(folder / "failed.jsonl", Failure))
        assert state == "Completed" and len(failures) == 1 and failures[0].status == 400
        written = {g.sample_id for g in read_jsonl(folder / "generations.jsonl", Generation)}
        assert len(written) == 5 and failures[0].sample_id not in written

        sent_before = len(server.log)
        plain = run_cli(args, cwd=tmp_path)
        assert plain.returncode == 0, plain.stderr[-3000:]
        assert generate_stage(tmp_path / "work")[0] == "Cached"
        assert len(server.log) == sent_before, "a plain rerun must not send anything"

        retry = run_cli([*args, "--retry-failed"], cwd=tmp_path)
        assert retry.returncode == 0, retry.stdout[-3000:] + retry.stderr[-3000:]
        state, retried_folder = generate_stage(tmp_path / "work")
        sent = [entry["body"]["prompt"] for entry in server.log[sent_before + CANARY_REQUESTS :]]
    assert state == "Completed" and retried_folder == folder
    records = list(read_jsonl(folder / "generations.jsonl", Generation))
    by_prompt = {tuple(g.prompt_ids): g.sample_id for g in records}
    assert [by_prompt[tuple(ids)] for ids in sent] == [failures[0].sample_id]
    assert sorted(g.sample_id for g in records) == sorted(written | {failures[0].sample_id})
    assert (folder / "failed.jsonl").read_text() == ""
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["counts"]["failed"] == 0 and manifest["counts"]["records"] == 6
