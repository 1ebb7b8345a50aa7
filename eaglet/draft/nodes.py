"""Training across machines (train.nnodes > 1): torchrun's c10d rendezvous, the round the
leading machine announces, and the loop a joining machine runs.

Every machine runs the same `eaglet run CONFIG`. The one that takes the work dir's lock leads:
it runs the pipeline, and its train stage announces a *round* in the work dir
(`ROUND_FILE`: the job file, the rendezvous id of this round) before it starts torchrun with
`--nnodes N --rdzv-backend c10d --rdzv-endpoint E --rdzv-id ID`. Each other machine finds the
lock held and joins (`follow`): it waits for a round, starts torchrun with the same job and
rendezvous, and waits for the next round until the leading run ends (its lock is released).
The work dir is on a shared file system (the lock, the job, the checkpoints, the features).

torchrun assigns global ranks itself (sorted by host name and pid), so global rank 0 may run
on any machine: it alone writes, into the shared out_dir. The leading machine's first process
(`EAGLET_TRAIN_LEADER`) reports the progress and logs the training lines, which every rank
computes alike from all-reduced sums. A resume across machines is the one-machine resume: the
checkpoint holds the step, and a global batch's rows do not depend on the world size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from eaglet import work_dir_lock
from eaglet.draft.job import TrainJob
from eaglet.storage import write_json_atomic

ROUND_FILE = ".eaglet-train-round.json"
LEADER_ENV = "EAGLET_TRAIN_LEADER"  # set for the leading machine's processes
JOINED_PREFIX = "EAGLET_TRAIN_JOINED "  # a worker's line once its process group is up
POLL_S = 1.0


class Round(BaseModel):
    """One torchrun launch of the leading machine that others join."""

    job: Path
    rdzv_id: str
    nnodes: int
    leader: str  # host and pid, for the joining machine's log


def round_path(work_dir: Path) -> Path:
    return Path(work_dir) / ROUND_FILE


def announce(job: TrainJob) -> Round:
    """Write this launch's round where the other machines look (the job's work dir)."""
    if job.work_dir is None:
        raise ValueError(f"train.nnodes={job.train.nnodes}: the job names no work dir to meet in")
    this = Round(
        job=job.path,
        rdzv_id=f"{job.rendezvous_id()}-{time.time_ns():x}",
        nnodes=job.train.nnodes,
        leader=f"{os.uname().nodename} pid {os.getpid()}",
    )
    write_json_atomic(round_path(job.work_dir), this.model_dump(mode="json"))
    return this


def withdraw(work_dir: Path, this: Round) -> None:
    """Remove the round file if it is still `this` round's."""
    if read_round(work_dir) == this:
        round_path(work_dir).unlink(missing_ok=True)


def read_round(work_dir: Path) -> Round | None:
    try:
        return Round.model_validate_json(round_path(work_dir).read_text())
    except (OSError, ValueError):
        return None


def torchrun_command(job: TrainJob, rdzv_id: str | None = None) -> list[str]:
    """torchrun for `job`: one machine (`--standalone`), or train.nnodes meeting at the c10d
    rendezvous `rdzv_id` (the round's)."""
    train = job.train
    command = [sys.executable, "-m", "torch.distributed.run"]
    if train.nnodes == 1:
        command += ["--standalone"]
    else:
        assert rdzv_id is not None and train.rdzv_endpoint is not None
        command += [
            f"--nnodes={train.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={train.rdzv_endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=join_timeout={int(train.rdzv_timeout_s)}",
            "--max-restarts=0",
        ]
    command += [f"--nproc-per-node={train.nproc_per_node}", "-m", "eaglet.draft.train_worker"]
    return command + [str(job.path)]


def follow(
    work_dir: Path, threads: Callable[[TrainJob], int], log_line: Callable[[str], None] = print
) -> int:
    """Join each training round the run holding `work_dir` announces, until that run ends;
    0 when every round joined ended well (or none was needed), else 1. `threads(job)` is each
    process's OMP_NUM_THREADS."""
    holder = work_dir_lock.describe(work_dir_lock.read_holder(work_dir))
    log_line(f"train: {work_dir} is held by {holder}; this machine joins its training")
    done: set[str] = set()
    failed = 0
    while work_dir_lock.is_held(work_dir):
        this = read_round(work_dir)
        if this is None or this.rdzv_id in done:
            time.sleep(POLL_S)
            continue
        done.add(this.rdzv_id)
        job = TrainJob.read(this.job)
        log_line(f"train: joining round {this.rdzv_id} of {this.leader} ({job.train.nnodes} "
                 f"machines x {job.train.nproc_per_node} processes)")  # fmt: skip
        code = join(work_dir, this, job, threads(job), log_line)
        failed += code != 0
        log_line(f"train: round {this.rdzv_id} ended with {code}")
    log_line(f"train: the run holding {work_dir} ended; {len(done)} round(s) joined")
    return 1 if failed else 0


def join(
    work_dir: Path, this: Round, job: TrainJob, threads: int, log_line: Callable[[str], None]
) -> int:
    """Run this machine's torchrun of a round; stop it if the round is withdrawn before its
    processes joined (the leading launch ended without us). Returns torchrun's exit code."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop(LEADER_ENV, None)
    joined = threading.Event()
    proc = subprocess.Popen(
        torchrun_command(job, this.rdzv_id), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env, start_new_session=True,
    )  # fmt: skip

    def watch() -> None:
        while proc.poll() is None and not joined.is_set():
            if read_round(work_dir) != this:
                log_line(f"train: round {this.rdzv_id} was withdrawn before this machine joined")
                proc.terminate()
                return
            time.sleep(POLL_S)

    threading.Thread(target=watch, daemon=True).start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(JOINED_PREFIX):
                joined.set()
                continue
            log_line(line)
        return proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def joined_line(rank: int, world: int) -> str:
    return JOINED_PREFIX + json.dumps({"rank": rank, "world": world})
