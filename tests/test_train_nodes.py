"""Training across machines, as two loopback "nodes": two torchrun process groups meeting at
torchrun's c10d rendezvous (gloo on CPU). The leading one holds the work dir and launches
(`eaglet.draft.launch.launch`); the other is `eaglet run CONFIG` of the same config, which
finds the work dir held and joins its training (`eaglet.draft.nodes.follow`). Two nodes of one
process each follow one process's loss curve; a node killed mid-epoch (SIGKILL) fails the
round on both, and the rerun resumes at the checkpoint's step with the same weights as a run
never stopped; a config with nodes but no rendezvous is refused before any stage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eaglet import shutdown, work_dir_lock
from eaglet.config import ConfigError, PipelineConfig, TargetConfig, TrainConfig, load_config
from eaglet.draft import ledger, nodes
from eaglet.draft.job import train_job
from eaglet.draft.launch import launch, run_job
from tests.train_helpers import AUX_IDS, CONVENTION, make_world
from tests.vllm_server import ROOT, free_port

TRAIN = dict(
    epochs=2, lr=1e-2, batch_size=8, draft_vocab_size=256, warmup_steps=2, log_every=1,
    intermediate_size=128, threads=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    torch.set_num_threads(1)
    make_world(root, 32)
    return root


def node_job(world, work_dir: Path, port: int | None, **train):
    settings = TRAIN | train
    if port is not None:
        settings |= dict(nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}")
    return train_job(
        work_dir / "train", TargetConfig(model=str(world / "target"), device="cpu"),
        TrainConfig(**settings), AUX_IDS, CONVENTION, hidden_states_dir=world / "hs",
        work_dir=work_dir,
    )  # fmt: skip


def joining_node(work_dir: Path, train: dict, log: Path) -> subprocess.Popen:
    """`eaglet run CONFIG` on the second machine: the config names the same work dir."""
    config = work_dir.parent / f"{work_dir.name}.yaml"
    config.write_text(yaml.safe_dump({"work_dir": str(work_dir), "train": train}))
    return subprocess.Popen(
        [sys.executable, "-m", "eaglet_prefect.flows.cli", "run", str(config)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
    )  # fmt: skip


def lead(job, seen: list | None = None) -> dict:
    """The leading machine: it holds the work dir while it launches, as `eaglet run` does."""
    with work_dir_lock.held(job.work_dir, log=lambda _: None):
        return launch(job, progress=None if seen is None else seen.append, log_line=lambda _: None)


def losses(folder: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").open()]


def test_nodes_without_a_rendezvous_are_refused_before_any_stage(tmp_path):
    with pytest.raises(ValueError, match="train.rdzv_endpoint"):
        TrainConfig(nnodes=2)
    with pytest.raises(ValueError, match="do nothing with train.nnodes=1"):
        TrainConfig(rdzv_endpoint="node001:29500")
    with pytest.raises(ValueError, match="not host:port"):
        TrainConfig(nnodes=2, rdzv_endpoint="node001")
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  nnodes: 2\n")
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        load_config(path)


def test_the_job_round_trips_and_names_one_rendezvous_per_work_dir(world, tmp_path):
    job = node_job(world, tmp_path / "w", 29500)
    job.write()
    read = type(job).read(job.path)
    assert read == job and read.train.nnodes == 2
    assert read.rendezvous_id() == node_job(world, tmp_path / "w", 1234).rendezvous_id()
    assert read.rendezvous_id() != node_job(world, tmp_path / "v", 29500).rendezvous_id()
    command = nodes.torchrun_command(job, "r1")
    assert "--nnodes=2" in command and "--rdzv-backend=c10d" in command
    assert "--rdzv-endpoint=127.0.0.1:29500" in command and "--rdzv-id=r1" in command
    assert "--standalone" not in command


@pytest.mark.slow  # real torchrun process groups, a real `eaglet run` joining
def test_two_nodes_follow_one_process_loss_curve_and_resume_after_a_kill(world, tmp_path):
    single = run_job(node_job(world, tmp_path / "one", None))
    work = tmp_path / "two"
    port = free_port()
    job = node_job(world, work, port)
    log = tmp_path / "joining.log"
    other = joining_node(work, dict(TRAIN, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}"), log)
    seen: list[dict] = []
    try:
        double = lead(job, seen)
        assert other.wait(timeout=120) == 0, log.read_text()
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)
    assert "joins its training" in log.read_text()
    assert double["world_size"] == 2 and single["world_size"] == 1
    assert double["steps"] == single["steps"] == 8
    assert [r["step"] for r in seen] == list(range(1, 9))  # the leading machine reports
    one, two = losses(tmp_path / "one" / "train"), losses(work / "train")
    assert one[-1] < 0.9 * one[0]  # it trains, so equal curves mean something
    assert two == pytest.approx(one, rel=1e-5)
    windows = [w for line in ledger.read(work / "train") for w in line["windows"]]
    assert sorted(windows) == sorted(list(range(32)) * 2)  # both epochs, every window once
    assert not nodes.round_path(work).exists()  # the round is withdrawn

    # killed mid-epoch: the joining machine's torchrun group dies after step 5 (the
    # checkpoint holds step 4); the round fails on both machines, and the rerun resumes
    resumed = tmp_path / "resumed"
    job = node_job(world, resumed, port := free_port(), save_every=4)
    train = dict(TRAIN, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}", save_every=4)
    other = joining_node(resumed, train, tmp_path / "killed.log")
    killed = threading.Event()

    def kill_at_5(record: dict) -> None:
        if record["step"] == 5 and not killed.is_set():
            killed.set()
            for pid in shutdown.descendants(other.pid):  # its torchrun and its workers
                os.kill(pid, signal.SIGKILL)
            time.sleep(1)

    with pytest.raises(RuntimeError, match="rerun to resume"):
        with work_dir_lock.held(resumed, log=lambda _: None):
            launch(job, progress=kill_at_5, log_line=lambda _: None)
    assert other.wait(timeout=60) == 1  # its round failed
    assert json.loads((resumed / "train" / "state" / "state.json").read_text())["step"] == 4
    other = joining_node(resumed, train, tmp_path / "resumed.log")
    try:
        again = lead(job)
        assert other.wait(timeout=120) == 0
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)
    assert again["resumed_from_step"] == 4 and again["steps"] == 8
    steps = [line["step"] for line in ledger.read(resumed / "train")]
    assert steps == list(range(1, 9))  # the steps after the checkpoint, once
    a = load_file(str(tmp_path / "one" / "train" / "draft" / "model.safetensors"))
    b = load_file(str(resumed / "train" / "draft" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-4, msg=name)


def test_a_pipeline_config_with_nodes_loads(tmp_path):
    config = PipelineConfig.model_validate(
        {"work_dir": str(tmp_path), "train": {"nnodes": 2, "rdzv_endpoint": "h:29500"}}
    )
    assert config.train.nnodes == 2


def test_nodes_reading_a_server_eaglet_starts_on_127_0_0_1_are_refused(tmp_path):
    from eaglet.preflight import check_nodes
    from eaglet.preflight.report import PreflightReport

    def report_of(vllm_python):
        config = PipelineConfig.model_validate({
            "work_dir": str(tmp_path),
            "hidden_states": {"backend": "vllm", "vllm": {"vllm_python": vllm_python,
                                                          "connector_path": str(tmp_path)}},
            "train": {"hidden_states": "online", "nnodes": 2, "rdzv_endpoint": "h:29500"},
        })  # fmt: skip
        report = PreflightReport()
        check_nodes(config, report)
        return report

    refused = report_of("/opt/vllm/bin/python")
    assert len(refused.problems) == 1 and "hidden_states.vllm.endpoints" in refused.problems[0]
    passed = report_of(None)
    assert not passed.problems and "meet at h:29500" in passed.passed[0]
