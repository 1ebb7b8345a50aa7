"""The cluster recipes of docs/cluster.md, checked as far as this machine allows.

Slurm: `deployments/slurm/eaglet.sbatch` itself runs on loopback, its `srun` and `scontrol`
the ones in tests/slurm_loopback/ (every "node" is 127.0.0.1, each srun copy a local
process): two capture servers (real vLLM CPU servers, started by the script's own command),
then `eaglet run` on two trainer "nodes", one leading the pipeline and one joining its
training at the c10d rendezvous. Kubernetes: the manifests parse, name the commands the
sbatch script runs, and their config loads."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from eaglet.config import load_config
from tests.conftest import ROOT, cli_env
from tests.vllm_server import free_port, vllm_python

SBATCH = ROOT / "deployments" / "slurm" / "eaglet.sbatch"
KUBERNETES = ROOT / "deployments" / "kubernetes"


def small_config(folder: Path, model: Path, data: Path) -> Path:
    config = {
        "work_dir": str(folder / "work"),
        "target": {"model": str(model), "device": "cpu", "dtype": "float32"},
        "datasets": [{"source": "arith", "path": str(data / "arith.jsonl"), "limit": 12}],
        "generation": {"engine": "local", "max_tokens": 32},
        "reasoning": {"max_truncation_rate": 1.0},  # short answers: the test is the cluster
        "hidden_states": {"vllm": {"vllm_args": ["--enforce-eager", "--max-model-len", "1024"],
                                   "concurrency": 4}},
        "train": {"epochs": 1, "batch_size": 4, "threads": 1, "holdout_fraction": 0.2,
                  "draft_vocab_size": 512, "log_every": 1},
    }  # fmt: skip
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)")
def test_the_sbatch_script_runs_on_loopback(tmp_path, fixture_model_dir, sample_data_dir):
    config = small_config(tmp_path, fixture_model_dir, sample_data_dir)
    bin_dir = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin"
    env = cli_env(ROOT, {
        "PATH": f"{ROOT / 'tests' / 'slurm_loopback'}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[1-4]", "SLURM_JOB_NUM_NODES": "4",
        "CAPTURE_NODES": "2", "CAPTURE_PORT": str(free_port()), "RDZV_PORT": str(free_port()),
        "CONNECTOR": str(tmp_path / "hs"), "EAGLET": str(ROOT / ".venv" / "bin" / "eaglet"),
        "EAGLET_PYTHON": str(bin_dir / "python"), "VLLM_PYTHON": str(vllm_python()),
        "EAGLET_RUN_ARGS": "--until train", "VLLM_CPU_KVCACHE_SPACE": "1",
    })  # fmt: skip
    done = subprocess.run(
        ["bash", str(SBATCH), str(config)], env=env, cwd=tmp_path, capture_output=True,
        text=True, timeout=1200,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "joins its training" in output  # the second trainer node joined
    manifests = list((tmp_path / "work").glob("train/*/manifest.json"))
    assert len(manifests) == 1, output[-3000:]
    info = json.loads(manifests[0].read_text())["info"]
    assert info["world_size"] == 2 and info["hidden_states_mode"] == "online"
    assert len(info["throughput"]["servers"]) == 2  # both capture servers served
    assert not list((tmp_path / "hs").glob("*.safetensors"))


def test_the_kubernetes_manifests_run_what_the_sbatch_script_runs(tmp_path):
    documents = [
        doc
        for path in sorted(KUBERNETES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
    ]
    kinds = {doc["kind"] for doc in documents}
    assert {"StatefulSet", "Service", "ConfigMap", "Job"} <= kinds
    commands = json.dumps(documents)
    assert "eaglet.hidden_states.capture_server" in commands  # the capture servers
    assert '"eaglet", "run"' in commands or "eaglet run" in commands  # the trainer nodes
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    config = load_config(path)
    assert config.train.nnodes > 1 and config.train.rdzv_endpoint
    assert config.hidden_states.backend == "vllm" and config.train.hidden_states == "online"
