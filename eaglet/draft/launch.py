"""Run a training job (`eaglet.draft.job.TrainJob`) in this process, or under torchrun: as
`nproc_per_node` processes on this machine, or on `train.nnodes` machines meeting at a c10d
rendezvous (eaglet/draft/nodes.py).

`run_job` trains it here; `launch` writes it to `<out_dir>/job.json`, announces the round to
the other machines when there are several, starts

    python -m torch.distributed.run --standalone --nproc-per-node N -m eaglet.draft.train_worker JOB

(or its `--nnodes/--rdzv-*` form), streams the processes' output (progress records are lines
starting with `PROGRESS_PREFIX`) and returns global rank 0's summary. A killed launch resumes
like a single process: from `state/`.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eaglet import work_dir_lock
from eaglet.config import PipelineConfig
from eaglet.cpu_threads import choose_threads, report_to
from eaglet.draft import nodes
from eaglet.draft.job import TrainJob
from eaglet.draft.online import OnlineData
from eaglet.draft.train import train_draft
from eaglet.hidden_states.backends import hidden_states_backend
from eaglet.progress import say

PROGRESS_PREFIX = "EAGLET_TRAIN_PROGRESS "
SUMMARY_FILE = "summary.json"


def run_training(
    job: TrainJob,
    nproc_per_node: int | None = None,
    progress: Callable[[dict], None] | None = None,
    log_line: Callable[[str], None] = print,
) -> dict:
    """`launch` under torchrun when the job trains on more than one process (train.nnodes,
    train.nproc_per_node, or `nproc_per_node` given here), else `run_job` here (the trainer's
    thread choice is written to `log_line` too)."""
    if nproc_per_node is not None and nproc_per_node != job.train.nproc_per_node:
        job = job.model_copy(
            update={"train": job.train.model_copy(update={"nproc_per_node": nproc_per_node})}
        )
    if job.train.nproc_per_node > 1 or job.train.nnodes > 1:
        return launch(job, progress=progress, log_line=log_line)
    with report_to(log_line):
        return run_job(job, progress)


def run_job(job: TrainJob, progress: Callable[[dict], None] | None = None) -> dict:
    """Train the job in this process (one of several when a process group is up)."""
    exclude = frozenset(job.exclude_sample_ids)
    data: Any = job.hidden_states_dir
    if job.examples_path is not None:
        settings = job.online_source
        served = hidden_states_backend(settings.backend).served  # fetched ahead when served
        data = OnlineData(
            job.examples_path,
            job.target,
            job.aux_layer_ids,
            exclude,
            job.train.max_seq_len,
            prefetch=job.train.online_prefetch if served else 0,
            hidden_states=settings,  # the backend it names, opened on first use
        )
    try:
        return train_draft(
            data,
            job.target,
            job.out_dir,
            job.train,
            job.aux_layer_ids,
            job.aux_layer_convention,
            exclude_sample_ids=exclude,
            progress=progress,
            resume=job.resume,
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


def job_threads(job: TrainJob) -> int:
    return worker_threads(job.train.threads, job.train.nproc_per_node)


def launch(
    job: TrainJob,
    nproc_per_node: int | None = None,
    progress: Callable[[dict], None] | None = None,
    log_line: Callable[[str], None] = print,
) -> dict:
    """Run the job under torchrun (`nproc_per_node`, when given, overrides the job's);
    `progress` gets the records of this machine's first process, `log_line` every other
    output line. Raises with the last lines of output when a process fails."""
    if nproc_per_node is not None:
        job = job.model_copy(
            update={"train": job.train.model_copy(update={"nproc_per_node": nproc_per_node})}
        )
    train = job.train
    job_path = job.write()
    (job.out_dir / SUMMARY_FILE).unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(job_threads(job)), **{nodes.LEADER_ENV: "1"})
    machines = f"{train.nnodes} machines x " if train.nnodes > 1 else ""
    log_line(f"train: {machines}{train.nproc_per_node} processes, "
             f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} each")  # fmt: skip
    this = nodes.announce(job) if train.nnodes > 1 else None
    if this is not None:
        log_line(f"train: round {this.rdzv_id} at {train.rdzv_endpoint}: waiting up to "
                 f"{train.rdzv_timeout_s:.0f} s for {train.nnodes - 1} more machine(s) "
                 f"(`eaglet run` of this config on each)")  # fmt: skip
    # torchrun's own report of a failed process is about 45 lines: the tail keeps the worker's
    # last words above it (CI: a rank's SIGABRT, its cause cut off at 40 lines)
    tail: deque[str] = deque(maxlen=150)
    try:
        with subprocess.Popen(
            nodes.torchrun_command(job, this.rdzv_id if this else None),
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
                if line.startswith(nodes.JOINED_PREFIX):
                    continue
                tail.append(line)
                log_line(line)
            code = proc.wait()
    finally:
        if this is not None and job.work_dir is not None:
            nodes.withdraw(job.work_dir, this)
    if code != 0:
        raise RuntimeError(
            f"torchrun training ({machines}{train.nproc_per_node} processes, job {job_path}) "
            f"exited with {code}; state/ keeps the last checkpoint, rerun to resume. Last "
            "output:\n" + "\n".join(tail)
        )
    return json.loads((job.out_dir / SUMMARY_FILE).read_text())


@contextmanager
def held_or_joined(
    config: PipelineConfig, log_line: Callable[[str], None] = say
) -> Iterator[int | None]:
    """`eaglet run`'s hold on the work dir: None while this run holds it (it leads: the caller
    runs the pipeline); with train.nnodes > 1 and another run holding it, this machine joins
    that run's training instead (`nodes.follow`) and the exit code of that comes back.
    Otherwise `work_dir_lock.WorkDirLocked`, as for any second run."""
    try:
        previous = work_dir_lock.acquire(config.work_dir)
    except work_dir_lock.WorkDirLocked:
        if config.train.nnodes == 1:
            raise
        yield nodes.follow(Path(config.work_dir), job_threads, log_line)
        return
    if previous is not None:
        log_line(work_dir_lock.took_over_message(config.work_dir, previous))
    try:
        yield None
    finally:
        work_dir_lock.release(config.work_dir)
