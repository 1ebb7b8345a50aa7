"""An API key from a Prefect Secret block: sent to the server, never written anywhere."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eaglet.config import TargetConfig
from eaglet.target import load_tokenizer
from tests.conftest import cli_env, run_cli, write_http_run_config
from tests.fake_servers import FakeServer, serve

pytestmark = pytest.mark.slow
KEY = "sk-eaglet-test-5f3c9a"


def test_generate_reads_the_key_from_a_prefect_secret_block(
    tmp_path, fixture_model_dir, sample_data_dir
):
    # The block is saved to, and read from, one Prefect server: the session's.
    saved = subprocess.run(
        [sys.executable, "-c", "import sys; from prefect.blocks.system import Secret; "
         "Secret(value=sys.stdin.read()).save('llm-server-key', overwrite=True)"],
        input=KEY, env=cli_env(tmp_path),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert saved.returncode == 0, saved.stderr[-2000:]
    server = FakeServer(load_tokenizer(TargetConfig(model=str(fixture_model_dir))), api_key=KEY)
    with serve(server) as url:
        config_path = write_http_run_config(
            tmp_path, fixture_model_dir, sample_data_dir, url, samples=4,
            canary_requests=2, api_key_secret="llm-server-key",
        )  # fmt: skip
        run = run_cli(["run", str(config_path), "--until", "generate"], cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        doctor = run_cli(["doctor", str(config_path)], cwd=tmp_path)
        assert doctor.returncode == 0, doctor.stdout[-3000:] + doctor.stderr[-3000:]
    assert len(server.log) == 2 + 4 + 2  # canary, the samples, doctor's canary
    assert {entry["authorization"] for entry in server.log} == {f"Bearer {KEY}"}
    for output in (run.stdout, run.stderr, doctor.stdout, doctor.stderr):
        assert KEY not in output
    written = [p for p in (tmp_path / "work").rglob("*") if p.is_file()]
    assert any(p.name == "generations.jsonl" for p in written)
    for path in written:
        assert KEY.encode() not in path.read_bytes(), f"the key was written to {path}"


def test_a_missing_secret_block_is_named_with_how_to_create_it(tmp_path, fixture_model_dir):
    config = {
        "work_dir": str(tmp_path / "work"),
        "target": {"model": str(fixture_model_dir)},
        "generation": {"engine": "vllm", "api_key_secret": "no-such-block"},
    }
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    doctor = run_cli(["doctor", str(tmp_path / "config.yaml")], cwd=tmp_path)
    assert doctor.returncode != 0
    assert "generation.api_key_secret='no-such-block'" in doctor.stdout + doctor.stderr
