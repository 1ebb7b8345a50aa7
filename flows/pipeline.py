"""The eaglet pipeline: seven stage tasks wired in order. Nothing here does the work."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow

from eaglet.config import STAGES, PipelineConfig, Stage, load_config
from eaglet.storage import write_json_atomic
from tasks.caching import result_storage_path
from tasks.download import download
from tasks.evaluate import evaluate
from tasks.extract import extract
from tasks.generate import generate
from tasks.hidden_states import hidden_states
from tasks.tokenize import tokenize
from tasks.train import train

TASKS = {
    "download": download,
    "tokenize": tokenize,
    "generate": generate,
    "extract": extract,
    "hidden_states": hidden_states,
    "train": train,
    "evaluate": evaluate,
}


@flow(name="eaglet-pipeline", log_prints=True)
def pipeline(
    config: PipelineConfig = PipelineConfig(),  # noqa: B008 - the UI form shows these defaults
    config_path: str | None = None,
    until: Stage = "evaluate",
    refresh_from: Stage | None = None,
) -> dict:
    """Regenerate the target's answers and train an EAGLE-3 draft on them.

    `config` is the whole configuration; `config_path` (a YAML file on the worker) replaces
    it when given. Stages run up to `until`; `refresh_from` re-runs that stage (and so every
    stage after it) even when its inputs and code are unchanged, e.g. after a server flag or a
    dataset revision changed."""
    if config_path:
        config = load_config(config_path)
    storage = result_storage_path(config)
    summary: dict[str, dict] = {}
    results: dict[str, dict] = {}

    def run(stage: str, **inputs: dict) -> dict | None:
        if STAGES.index(stage) > STAGES.index(until):
            return None
        started = time.time()
        task = TASKS[stage].with_options(
            result_storage=storage, refresh_cache=True if stage == refresh_from else None
        )
        state = task(config, **inputs, refresh=stage == refresh_from, return_state=True)
        manifest = state.result()  # raises the task's error: the flow fails with it
        summary[stage] = {
            "state": state.name,
            "key": manifest["key"],
            "path": manifest["path"],
            "records": manifest["counts"].get("records", 0),
            "seconds": round(time.time() - started, 2),
        }
        write_json_atomic(Path(config.work_dir) / "run.json", {"stages": summary})
        results[stage] = manifest
        return manifest

    samples = run("download")
    prompts = run("tokenize", samples=samples) if samples else None
    generations = run("generate", prompts=prompts) if prompts else None
    examples = run("extract", generations=generations, prompts=prompts) if generations else None
    features = run("hidden_states", examples=examples) if examples else None
    draft = run("train", features=features) if features else None
    if draft:
        run("evaluate", draft=draft, prompts=prompts)
    return {"stages": summary, "evaluation": results.get("evaluate", {}).get("info", {})}
