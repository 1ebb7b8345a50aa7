"""Run a training job in this process, or as `nproc_per_node` processes under torchrun.

A job is a JSON-able dict (`train_job`): the data (offline: a hidden-states folder; online: an
examples file the target turns into features as training goes), the target's and the trainer's
settings, the output folder and the aux layer ids. `run_job` trains it here; `launch` writes it
to `<out_dir>/job.json`, starts

    python -m torch.distributed.run --standalone --nproc-per-node N -m eaglet.draft.train_worker JOB

streams the processes' output (progress records are lines starting with `PROGRESS_PREFIX`) and
returns rank 0's summary. A killed launch resumes like a single process: from `state/`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eaglet.config import HiddenStatesConfig, PipelineConfig, TargetConfig, TrainConfig
from eaglet.cpu_threads import choose_threads, report_to
from eaglet.draft.online import OnlineData
from eaglet.draft.train import train_draft
from eaglet.hidden_states.backends import hidden_states_backend
from eaglet.hidden_states.feature_encoding import bytes_per_token
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION, layer_ids_of
from eaglet.hidden_states.shards import read_index
from eaglet.records.examples import Example
from eaglet.records.io import read_jsonl
from eaglet.split import heldout_ids
from eaglet.target import load_config

PROGRESS_PREFIX = "EAGLET_TRAIN_PROGRESS "
SUMMARY_FILE = "summary.json"


def train_job(
    out_dir: Path,
    target: TargetConfig,
    train: TrainConfig,
    aux_layer_ids: list[int],
    aux_layer_convention: str,
    exclude_sample_ids: set[str] | frozenset[str] = frozenset(),
    hidden_states_dir: Path | None = None,
    examples_path: Path | None = None,
    resume: bool = True,
    hidden_states: HiddenStatesConfig | None = None,
) -> dict[str, Any]:
    """The job as plain JSON data: offline with `hidden_states_dir`, online with
    `examples_path`."""
    if (hidden_states_dir is None) == (examples_path is None):
        raise ValueError("a training job reads a hidden-states folder or an examples file")
    return {
        "out_dir": str(out_dir),
        "target": target.model_dump(),
        "train": train.model_dump(),
        "aux_layer_ids": list(aux_layer_ids),
        "aux_layer_convention": aux_layer_convention,
        "exclude_sample_ids": sorted(exclude_sample_ids),
        "hidden_states_dir": str(hidden_states_dir) if hidden_states_dir else None,
        "examples_path": str(examples_path) if examples_path else None,
        "resume": resume,
        # the hidden-state settings the online source computes the features with
        "online_source": (hidden_states or HiddenStatesConfig()).model_dump(),
    }


def pipeline_job(
    config: PipelineConfig,
    out_dir: Path,
    features_dir: Path | None = None,
    features_info: dict | None = None,
    examples_path: Path | None = None,
) -> dict[str, Any]:
    """The train stage's job: offline from the hidden_states stage's folder and manifest info,
    online from the extract stage's examples file (aux layer ids resolved as the hidden_states
    stage would). Held-out samples (train.holdout_fraction) are left out either way."""
    fraction = config.train.holdout_fraction
    if features_dir is not None:
        ids = [row["sample_id"] for row in read_index(features_dir)]
        aux_ids = features_info["aux_layer_ids"]
        convention = features_info["aux_layer_convention"]
    else:
        ids = [e.sample_id for e in read_jsonl(examples_path, Example)]
        num_layers = load_config(config.target).num_hidden_layers
        aux_ids = layer_ids_of(config, num_layers)
        convention = AUX_LAYER_CONVENTION
    return train_job(
        out_dir,
        config.target,
        config.train,
        aux_ids,
        convention,
        exclude_sample_ids=heldout_ids(ids, fraction),
        hidden_states_dir=features_dir,
        examples_path=examples_path,
        hidden_states=config.hidden_states,
    )


def feature_disk(
    config: PipelineConfig, features_dir: Path | None = None, examples_path: Path | None = None
) -> dict:
    """For the manifest: which mode ran, the feature bytes it stored, and (online) the bytes
    the offline shards of the same examples (held-out ones included, as the hidden_states stage
    stores them) would have taken in hidden_states.storage."""
    if features_dir is not None:
        stored = sum(f.stat().st_size for f in Path(features_dir).glob("*.safetensors"))
        return {"hidden_states_mode": "offline", "feature_bytes_stored": stored}
    tokens = sum(len(e.input_ids) for e in read_jsonl(examples_path, Example))
    hidden_size = load_config(config.target).hidden_size
    per_token = bytes_per_token(hidden_size, config.hidden_states.storage)
    return {
        "hidden_states_mode": "online",
        "feature_bytes_stored": 0,
        "feature_bytes_saved": tokens * per_token,
        "feature_bytes_saved_storage": config.hidden_states.storage,
    }


def run_training(
    job: dict[str, Any],
    nproc_per_node: int,
    progress: Callable[[dict], None] | None = None,
    log_line: Callable[[str], None] = print,
) -> dict:
    """`launch` under torchrun when `nproc_per_node` > 1, else `run_job` here (the trainer's
    thread choice is written to `log_line` too)."""
    if nproc_per_node > 1:
        return launch(job, nproc_per_node, progress, log_line)
    with report_to(log_line):
        return run_job(job, progress)


def run_job(job: dict[str, Any], progress: Callable[[dict], None] | None = None) -> dict:
    """Train the job in this process (one of several when a process group is up)."""
    target = TargetConfig.model_validate(job["target"])
    train = TrainConfig.model_validate(job["train"])
    exclude = frozenset(job["exclude_sample_ids"])
    data: Any = job["hidden_states_dir"]
    if job["examples_path"]:
        settings = HiddenStatesConfig.model_validate(job["online_source"])
        served = hidden_states_backend(settings.backend).served  # fetched ahead when served
        data = OnlineData(
            Path(job["examples_path"]),
            target,
            job["aux_layer_ids"],
            exclude,
            train.max_seq_len,
            prefetch=train.online_prefetch if served else 0,
            hidden_states=settings,  # the backend it names, opened on first use
        )
    try:
        return train_draft(
            data,
            target,
            Path(job["out_dir"]),
            train,
            job["aux_layer_ids"],
            job["aux_layer_convention"],
            exclude_sample_ids=exclude,
            progress=progress,
            resume=job["resume"],
        )
    finally:
        if isinstance(data, OnlineData):
            data.close()


def worker_threads(threads: int | None, nproc_per_node: int, **readers) -> int:
    """Intra-op threads of each torchrun process: train.threads, else OMP_NUM_THREADS, else
    an equal share of the threads this process may use now (cpu_threads.choose_threads; at
    least 1). The workers read it as OMP_NUM_THREADS, an explicit setting."""
    choice = choose_threads(threads, **readers)
    return choice.threads if not choice.chosen else max(1, choice.threads // nproc_per_node)


def torchrun_command(job_path: Path, nproc_per_node: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        "-m",
        "eaglet.draft.train_worker",
        str(job_path),
    ]


def launch(
    job: dict[str, Any],
    nproc_per_node: int,
    progress: Callable[[dict], None] | None = None,
    log_line: Callable[[str], None] = print,
) -> dict:
    """Run the job under torchrun; `progress` gets rank 0's records, `log_line` every other
    output line. Raises with the last lines of output when a process fails."""
    out_dir = Path(job["out_dir"])
    out_dir.mkdir(parents=True, exist_ok=True)
    job_path = out_dir / "job.json"
    job_path.write_text(json.dumps(job, indent=2) + "\n")
    (out_dir / SUMMARY_FILE).unlink(missing_ok=True)
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(worker_threads(job["train"].get("threads"), nproc_per_node))
    log_line(f"train: {nproc_per_node} processes, OMP_NUM_THREADS={env['OMP_NUM_THREADS']} each")
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(
        torchrun_command(job_path, nproc_per_node),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(PROGRESS_PREFIX):
                if progress is not None:
                    progress(json.loads(line[len(PROGRESS_PREFIX) :]))
                continue
            tail.append(line)
            log_line(line)
        code = proc.wait()
    if code != 0:
        raise RuntimeError(
            f"torchrun training ({nproc_per_node} processes, job {job_path}) exited with "
            f"{code}; state/ keeps the last checkpoint, rerun to resume. Last output:\n"
            + "\n".join(tail)
        )
    return json.loads((out_dir / SUMMARY_FILE).read_text())
