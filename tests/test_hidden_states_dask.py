"""Many workers: the hidden_states shard tasks mapped on a local Dask cluster of two worker
processes give the index and shards of the serial run, and both workers took shards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("prefect_dask")

from prefect import flow  # noqa: E402
from prefect.settings import (  # noqa: E402
    PREFECT_API_URL,
    PREFECT_HOME,
    temporary_settings,
)

from eaglet.stage_bodies.every_stage import run_stage_without_prefect  # noqa: E402
from eaglet.stage_context import PlainContext  # noqa: E402
from eaglet.storage import Manifest, stage_folder  # noqa: E402
from eaglet_prefect.tasks.hidden_states import map_hidden_state_shards  # noqa: E402
from tests.conftest import SharedPrefectServer  # noqa: E402
from tests.hidden_states_helpers import config_for, tiny_target, write_examples  # noqa: E402


def examples_manifest(work_dir: Path, examples_file: Path) -> dict:
    """An extract stage folder holding `examples_file`, and its manifest."""
    folder = stage_folder(work_dir, "extract", "ex")
    folder.mkdir(parents=True)
    (folder / "examples.jsonl").write_bytes(examples_file.read_bytes())
    return Manifest(
        stage="extract",
        key="ex",
        path="extract/ex",
        code_hash="c",
        config={},
        started=0.0,
        finished=0.0,
    ).model_dump()


@flow(name="hidden-states-shards-test")
def shards_flow(config, examples: dict) -> list[dict]:
    return map_hidden_state_shards(config, examples)


def finish(config, examples: dict) -> Manifest:
    """The hidden_states stage body (no Prefect task around it): with task_runner dask it
    verifies and indexes the shards the mapped tasks built."""
    inputs = {"examples": Manifest.model_validate(examples)}
    return run_stage_without_prefect("hidden_states", config, inputs, PlainContext())


def shard_bytes(folder: Path) -> dict[str, bytes]:
    names = ["index.jsonl", *sorted(p.name for p in folder.glob("shard-*.safetensors"))]
    return {name: (folder / name).read_bytes() for name in names}


@pytest.mark.slow  # real processes end to end
def test_two_dask_workers_build_the_serial_runs_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = tiny_target(tmp_path / "model")
    write_examples(tmp_path / "examples.jsonl", 40, seed=7)
    settings = {"storage": "int8", "shard_tokens": 256}

    serial = config_for(tmp_path / "serial", model, **settings)
    serial_examples = examples_manifest(serial.work_dir, tmp_path / "examples.jsonl")
    serial_manifest = finish(serial, serial_examples)

    mapped = config_for(tmp_path / "mapped", model, **settings).model_copy(
        update={"execution": serial.execution.model_copy(update={"task_runner": "dask"})}
    )
    examples = examples_manifest(mapped.work_dir, tmp_path / "examples.jsonl")
    # the session's Prefect server: a temporary one would live on inside pytest
    with temporary_settings(
        updates={
            PREFECT_HOME: str(tmp_path / ".prefect-home"),
            PREFECT_API_URL: SharedPrefectServer.api_url(),
        }
    ):
        records = shards_flow(mapped, examples)
    assert len(records) == len(serial_manifest.info["shards"]) > 3
    workers = {r["worker"] for r in records}
    assert len(workers) == 2, workers  # both worker processes took shards
    assert all(r["worker"].split(":")[1] != str(os.getpid()) for r in records)
    partial = stage_folder(mapped.work_dir, "hidden_states", "x").parent
    built = {p.name: p.stat().st_mtime_ns for p in partial.rglob("shard-*.safetensors")}
    mapped_manifest = finish(mapped, examples)
    final = Path(stage_folder(mapped.work_dir, "hidden_states", mapped_manifest.key))
    assert {p.name: p.stat().st_mtime_ns for p in final.glob("shard-*.safetensors")} == built
    serial_folder = stage_folder(serial.work_dir, "hidden_states", serial_manifest.key)
    assert shard_bytes(final) == shard_bytes(serial_folder)
