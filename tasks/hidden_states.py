"""The hidden_states stage as Prefect tasks: examples → safetensors feature shards.

`hidden_states` is the stage (cached by its key; its work: `eaglet.stage_bodies.hidden_states`):
it plans the shards, checks the disk budget, builds every shard not yet finished and writes the
index and the manifest. Its partial
folder survives a crash, and a rerun keeps every finished shard (verified by its sha256).
With `execution.task_runner: dask`, `map_hidden_state_shards` first builds the shards as
mapped `hidden_states_shard` tasks on a Dask cluster; the stage task then only verifies and
indexes them. Task arguments and results are shard ranges and small records, never tensors.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict
from pathlib import Path

from prefect import get_run_logger, task, unmapped

from eaglet.config import ExecutionConfig, PipelineConfig
from eaglet.hidden_states.backends import hidden_states_backend
from eaglet.hidden_states.reuse import FeatureReuse
from eaglet.hidden_states.stage import ShardSpec, backend_factory, build_shard, prepare_stage
from eaglet.reuse import earlier_runs_alike
from eaglet.stage_bodies import hidden_states as hidden_states_body
from eaglet.stages import EXAMPLES_FILE
from eaglet.storage import read_manifest, stage_dir
from eaglet_prefect.tasks.caching import partial_folder, run_stage_task, stage_task


def _examples_path(config: PipelineConfig, examples: dict) -> Path:
    return stage_dir(config.work_dir, examples) / EXAMPLES_FILE


@stage_task("hidden_states", retries=1)  # a killed worker: finished shards are kept
def hidden_states(config: PipelineConfig, examples: dict, refresh: bool = False) -> dict:
    return run_stage_task(
        "hidden_states", hidden_states_body.run, config, {"examples": examples}, refresh=refresh
    )


@task(name="hidden_states_plan", task_run_name="hidden_states_plan[{config.name}]")
def hidden_states_plan(config: PipelineConfig, examples: dict) -> list[dict]:
    """The shards still to build (empty when the stage folder is complete), after the disk
    budget check."""
    key, partial = partial_folder("hidden_states", config, {"examples": examples})
    if read_manifest(partial.with_name(key)) is not None:
        return []
    partial.mkdir(parents=True, exist_ok=True)
    specs = prepare_stage(config, partial, _examples_path(config, examples))
    return [{**asdict(spec), "folder": str(partial)} for spec in specs]


@task(name="hidden_states_shard", task_run_name="hidden_states_shard[{shard[name]}]")
def hidden_states_shard(config: PipelineConfig, examples: dict, shard: dict) -> dict:
    """Build one shard (or verify it is already built); returns a small record."""
    spec = ShardSpec(**{k: v for k, v in shard.items() if k != "folder"})
    earlier = earlier_runs_alike("hidden_states", config, Path(shard["folder"]))
    record = build_shard(
        Path(shard["folder"]),
        _examples_path(config, examples),
        spec,
        backend_factory(config),
        config.hidden_states.storage,
        reuse=FeatureReuse(earlier) if earlier else None,
    )
    get_run_logger().info(
        "%s: %d tokens %s", spec.name, spec.tokens, "verified" if record["skipped"] else "built"
    )
    return {
        "shard": spec.name,
        "tokens": spec.tokens,
        "skipped": record["skipped"],
        "worker": f"{socket.gethostname()}:{os.getpid()}",
    }


def task_runner(execution: ExecutionConfig):
    """The Dask task runner of `execution` (prefect-dask): an existing cluster's address, or a
    local cluster of `dask_workers` processes."""
    from prefect_dask import DaskTaskRunner

    if execution.dask_address:
        return DaskTaskRunner(address=execution.dask_address)
    return DaskTaskRunner(
        cluster_kwargs={
            "n_workers": execution.dask_workers,
            "threads_per_worker": 1,
            "processes": True,
            "dashboard_address": None,
        }
    )


def map_hidden_state_shards(config: PipelineConfig, examples: dict) -> list[dict]:
    """Build the stage's shards as mapped tasks on the configured Dask cluster (call from a
    flow); returns each shard task's record."""
    shards = hidden_states_plan(config, examples)
    if not shards:
        return []
    # The servers the backend starts for the stage (the vllm backend's vllm_python): its
    # preflight refused a server on 127.0.0.1 that a remote Dask cluster's workers must reach.
    folder = Path(shards[0]["folder"])
    backend = hidden_states_backend(config.hidden_states.backend)
    with backend.serving(config, folder, get_run_logger().info) as run:
        with task_runner(config.execution) as runner:
            futures = runner.map(
                hidden_states_shard,
                {"config": unmapped(run), "examples": unmapped(examples), "shard": shards},
            )
            return [future.result() for future in futures]
