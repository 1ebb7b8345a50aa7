"""Online training from many capture servers into many ranks across machines, end to end on
real processes: two vLLM CPU servers (extract_hidden_states, eaglet's connector, one shared
connector folder; the command `capture_server_command` builds) feed two training ranks on two
loopback "nodes" (two torchrun process groups at a c10d rendezvous; the second is `eaglet run`
of the same config, joining). The run is killed mid-epoch (SIGKILL of the joining machine's
torchrun and workers), resumed, and loses a capture server (SIGKILL) while it resumes: the
ledger shows every window trained exactly once per epoch, the resumed run follows the
uninterrupted one-process run's schedule and losses, its optimizer kept its steps, and its
draft's τ equals the one-process run's within 1%. `eaglet doctor` prints the two servers'
rates, a rank's and the split. Two servers for the module: each start costs most of a minute.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eaglet import shutdown, work_dir_lock
from eaglet.config import PipelineConfig
from eaglet.draft import ledger
from eaglet.draft.evaluate import evaluate_draft
from eaglet.draft.job import train_job
from eaglet.draft.launch import launch, run_job
from eaglet.hidden_states.backends.vllm import capture_server_command
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION
from eaglet.records.examples import Example
from eaglet.records.io import write_jsonl
from eaglet.vllm_process import free_port, vllm_server
from tests.vllm_server import ROOT, vllm_python

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)"),
]

AUX = [2, 4, 6]
SAMPLES, PROMPT, ANSWER = 24, 12, 32  # 24 windows, 3 steps an epoch of 8
TRAIN = dict(
    epochs=8, batch_size=8, lr=1e-2, warmup_steps=2, draft_vocab_size=512, log_every=1,
    intermediate_size=128, threads=1, device="cpu", holdout_fraction=0.0,
    hidden_states="online", online_prefetch=2,
)  # fmt: skip


def greedy_examples(model_dir: Path) -> list[Example]:
    """The fixture target's greedy answers to random prompts (its own continuations)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(10, model.config.vocab_size, (SAMPLES, PROMPT), generator=g)
    with torch.no_grad():
        out = model.generate(prompts, do_sample=False, max_new_tokens=ANSWER,
                             min_new_tokens=ANSWER, pad_token_id=0)  # fmt: skip
    return [
        Example(
            sample_id=f"s{i}",
            source="t",
            reasoning="",
            content="",
            input_ids=row.tolist(),
            loss_mask=[0] * PROMPT + [1] * ANSWER,
            finish_reason="length",
        )  # fmt: skip
        for i, row in enumerate(out)
    ]


@pytest.fixture(scope="module")
def fleet(fixture_model_dir, tmp_path_factory):
    """Two capture servers writing into one connector folder, and the examples."""
    root = tmp_path_factory.mktemp("fleet")
    connector = root / "connector"
    connector.mkdir()
    base = PipelineConfig.model_validate({
        "work_dir": str(root / "work"), "target": {"model": str(fixture_model_dir),
                                                   "device": "cpu", "dtype": "float32"},
        "hidden_states": {"backend": "vllm", "aux_layer_ids": AUX, "vllm": {
            "vllm_python": str(vllm_python()), "concurrency": 4,
            "vllm_args": ["--enforce-eager", "--max-model-len", "1024"]}},
    })  # fmt: skip
    write_jsonl(root / "examples.jsonl", greedy_examples(fixture_model_dir))
    servers: dict[str, int] = {}
    with ExitStack() as stack:
        urls: list[str | None] = [None, None]

        def start(i: int) -> None:
            command, env = capture_server_command(base, free_port(), str(connector))
            urls[i] = stack.enter_context(
                vllm_server(command, root / f"server{i}.log", 240, env=env)
            )

        threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(urls), [(root / f"server{i}.log").read_text()[-2000:] for i in range(2)]
        for url in urls:
            servers[url] = _listening_group(int(url.rsplit(":", 1)[1]))
        yield root, connector, urls, servers


def _listening_group(port: int) -> int:
    """The process group of the vLLM server listening on `port` (to kill it as a machine)."""
    from eaglet.vllm_process import listening_socket_inodes

    wanted = {f"socket:[{i}]" for i in listening_socket_inodes(port) or ()}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and any(
                os.readlink(fd) in wanted for fd in (entry / "fd").iterdir()
            ):
                return os.getpgid(int(entry.name))
        except OSError:
            continue
    raise AssertionError(f"no process listens on {port}")


def online(connector: Path, urls) -> dict:
    return {
        "backend": "vllm", "aux_layer_ids": AUX,
        "vllm": {"endpoints": list(urls), "connector_path": str(connector), "concurrency": 4,
                 "request_timeout_s": 300},  # one server answers both ranks on a loaded box
    }  # fmt: skip


def job_of(fixture_model_dir, fleet, out: Path, work: Path | None, **train):
    root, connector, urls, _ = fleet
    config = PipelineConfig.model_validate({
        "work_dir": str(work or out), "target": {"model": str(fixture_model_dir),
                                                 "device": "cpu", "dtype": "float32"},
        "hidden_states": online(connector, urls), "train": TRAIN | train,
    })  # fmt: skip
    job = train_job(
        out, config.target, config.train, AUX, AUX_LAYER_CONVENTION,
        examples_path=root / "examples.jsonl", hidden_states=config.hidden_states,
        work_dir=work,
    )  # fmt: skip
    return job, config


def tau(fixture_model_dir, draft: Path, examples: Path) -> tuple[float, float]:
    """τ on the training prompts, and an untrained draft's there."""
    from eaglet.records.io import read_jsonl

    prompts = [e.input_ids[:PROMPT] for e in read_jsonl(examples, Example)][:8]
    report = evaluate_draft(draft, str(fixture_model_dir), prompts, 4, max_new_tokens=ANSWER,
                            untrained_seed=0, device="cpu")  # fmt: skip
    return report["tau"], report["untrained"]["tau"]


@pytest.fixture(scope="module")
def reference(fixture_model_dir, fleet):
    """One process, online from both servers, never stopped."""
    root = fleet[0]
    job, _ = job_of(fixture_model_dir, fleet, root / "one", None)
    summary = run_job(job)
    return summary, tau(fixture_model_dir, root / "one" / "draft", root / "examples.jsonl")[0]


def joining(config: PipelineConfig, path: Path, log: Path) -> subprocess.Popen:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    return subprocess.Popen(
        [sys.executable, "-m", "eaglet_prefect.flows.cli", "run", str(path)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
    )  # fmt: skip


def test_doctor_prints_each_servers_rate_a_ranks_and_the_split(fixture_model_dir, fleet):
    root = fleet[0]
    _, config = job_of(fixture_model_dir, fleet, root / "doctor", None, nproc_per_node=2)
    path = root / "doctor.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    out = subprocess.run(
        [sys.executable, "-m", "eaglet_prefect.flows.cli", "doctor", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line.startswith("split: ")]
    print("\n".join(lines))
    for url in fleet[2]:
        assert any(line.startswith(f"split: capture server {url}: ") for line in lines), out
    assert any(line.startswith("split: one training rank (cpu): ") for line in lines)
    assert any("as configured (2 servers + 2 ranks)" in line for line in lines)
    assert any(line.startswith("split: suggested for 4 devices: ") for line in lines)


def test_two_nodes_killed_and_resumed_train_every_sample_once(fixture_model_dir, fleet, reference):
    root, connector, urls, servers = fleet
    work, port = root / "nodes", free_port()
    nodes_train = dict(nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}", save_every=2)
    job, config = job_of(fixture_model_dir, fleet, work / "train", work, **nodes_train)
    steps = TRAIN["epochs"] * 3

    # killed mid-epoch: after step 5 the joining machine dies; the checkpoint holds step 4
    other = joining(config, root / "nodes.yaml", root / "joining-1.log")
    killed = threading.Event()

    def kill_at_5(record: dict) -> None:
        if record["step"] == 5 and not killed.is_set():
            killed.set()
            for pid in shutdown.descendants(other.pid):
                os.kill(pid, signal.SIGKILL)

    with pytest.raises(RuntimeError, match="rerun to resume"):
        with work_dir_lock.held(work, log=lambda _: None):
            launch(job, progress=kill_at_5, log_line=print)
    assert other.wait(timeout=120) == 1
    assert json.loads((work / "train" / "state" / "state.json").read_text())["step"] == 4

    # resumed on both machines; at step 14 a capture server dies (its whole process group)
    dead = urls[1]

    def kill_server_at_8(record: dict) -> None:
        if record["step"] == 14 and dead in servers:
            os.killpg(servers.pop(dead), signal.SIGKILL)

    other = joining(config, root / "nodes.yaml", root / "joining-2.log")
    try:
        with work_dir_lock.held(work, log=lambda _: None):
            try:
                resumed = launch(job, progress=kill_server_at_8, log_line=print)
            except RuntimeError as error:  # the joining machine's side too, and the servers':
                # raised last, so the end of a CI log, which keeps only its head and tail, has it
                logs = ["joining-2.log", "server0.log", "server1.log"]
                raise AssertionError("\n".join(
                    f"--- {log}:\n" + (root / log).read_text()[-3000:] for log in logs
                )) from error  # fmt: skip
        assert other.wait(timeout=120) == 0, (root / "joining-2.log").read_text()[-3000:]
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == steps
    assert resumed["world_size"] == 2

    # exactly once: each epoch's steps trained every window once, no step twice
    lines = ledger.read(work / "train")
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    for epoch in range(TRAIN["epochs"]):
        windows = [w for line in lines if line["epoch"] == epoch for w in line["windows"]]
        assert sorted(windows) == list(range(SAMPLES)), epoch
    # the capture server that died: its requests went to the other, none was skipped
    servers_seen = resumed["throughput"]["servers"]
    assert servers_seen[dead]["retries"] >= 1
    assert sum(s["samples"] for s in servers_seen.values()) >= (steps - 4) * 8

    # the same schedule and optimizer as a run never stopped, and about the same losses
    summary, tau_one = reference
    one = [json.loads(line) for line in (root / "one" / "metrics.jsonl").open()]
    two = [json.loads(line) for line in (work / "train" / "metrics.jsonl").open()]
    assert [m["step"] for m in two] == list(range(1, steps + 1))
    assert [m["lr"] for m in two] == pytest.approx([m["lr"] for m in one], rel=1e-9)
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=2e-3)
    state = json.loads((work / "train" / "state" / "state.json").read_text())
    assert state["step"] == steps
    moments = load_file(str(work / "train" / "state" / "optimizer.safetensors"))
    counts = {float(v) for k, v in moments.items() if k.endswith(".step")}
    assert counts == {float(steps)}  # the optimizer's own step count: restored, not restarted
    tau_two, untrained = tau(fixture_model_dir, work / "train" / "draft", root / "examples.jsonl")
    print(f"tau one process {tau_one:.4f}, two nodes killed and resumed {tau_two:.4f}, "
          f"untrained {untrained:.4f}")  # fmt: skip
    assert tau_one > untrained + 0.3  # a trained draft, so the comparison means something
    assert tau_two == pytest.approx(tau_one, rel=0.01)
