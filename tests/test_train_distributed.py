"""The trainer under torchrun: two gloo processes on CPU follow one process's loss curve with
the same global batch, and a stopped torchrun run resumes where it stopped."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eaglet.config import TargetConfig, TrainConfig
from eaglet.draft.job import train_job
from eaglet.draft.launch import launch, run_job
from eaglet.draft.nodes import torchrun_command
from tests.train_helpers import AUX_IDS, CONVENTION, make_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    torch.set_num_threads(1)
    make_world(root, 32)
    return root


def job(world, out, **train):
    config = TrainConfig(
        **(
            dict(
                epochs=2,
                lr=1e-2,
                batch_size=8,
                draft_vocab_size=256,
                warmup_steps=2,
                log_every=1,
                intermediate_size=128,
                threads=1,
            )
            | train
        )
    )
    return train_job(
        out,
        TargetConfig(model=str(world / "target"), device="cpu"),
        config,
        AUX_IDS,
        CONVENTION,
        hidden_states_dir=world / "hs",
    )


def losses(folder):
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").open()]


def test_torchrun_command_is_standalone_with_n_processes(world, tmp_path):
    spec = job(world, tmp_path, nproc_per_node=2)
    command = torchrun_command(spec)
    assert command[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert command[-3:] == ["-m", "eaglet.draft.train_worker", str(tmp_path / "job.json")]


@pytest.mark.slow  # real processes end to end
def test_two_processes_follow_one_process_loss_curve(world):
    single = run_job(job(world, world / "one"))
    seen = []
    double = launch(job(world, world / "two"), 2, progress=seen.append, log_line=lambda _: None)
    assert double["world_size"] == 2 and single["world_size"] == 1
    assert double["steps"] == single["steps"] == 8
    assert [r["step"] for r in seen] == list(range(1, 9))
    one, two = losses(world / "one"), losses(world / "two")
    assert len(one) == len(two) == 8
    assert one[-1] < 0.9 * one[0]  # it trains, so equal curves mean something
    for a, b in zip(one, two, strict=True):
        assert b == pytest.approx(a, rel=1e-5)
    a = load_file(str(world / "one" / "draft" / "model.safetensors"))
    b = load_file(str(world / "two" / "draft" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.slow  # real processes end to end
def test_torchrun_run_resumes_from_its_checkpoint(world):
    out = world / "resumed"
    part = launch(job(world, out, max_steps=3, save_every=3), 2, log_line=lambda _: None)
    assert part["steps"] == 3
    assert json.loads((out / "state" / "state.json").read_text())["step"] == 3
    full = launch(job(world, out, save_every=3), 2, log_line=lambda _: None)
    assert full["resumed_from_step"] == 3 and full["steps"] == 8
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()]
    assert steps == list(range(1, 9))
    if (world / "one" / "draft").exists():  # resumed = never stopped (within float sums)
        a = load_file(str(world / "one" / "draft" / "model.safetensors"))
        b = load_file(str(out / "draft" / "model.safetensors"))
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.slow  # real processes end to end
@pytest.mark.parametrize("keep_best", ["loss", "tau"])
def test_keep_best_under_torchrun_measures_and_keeps_what_one_process_does(world, keep_best):
    """train.keep_best with two processes: the held-out loss at each epoch's end is summed
    across both and equals one process's (9 held-out samples: the last held-out batch has one
    row, and the second process none of it), and the draft exported is the same best epoch's.
    With `tau`, the first process measures tau while the second waits at the next step, and
    the taus equal one process's."""
    held_out = frozenset(f"s{i}" for i in range(9))  # 23 training samples: 3 steps an epoch
    settings = dict(epochs=3, keep_best=keep_best)
    if keep_best == "tau":
        settings |= dict(keep_best_prompts=4, keep_best_max_new_tokens=16)

    def keep_best_job(out):
        spec = job(world, out, **settings)
        return spec.model_copy(update={"exclude_sample_ids": sorted(held_out)})

    single = run_job(keep_best_job(world / f"best-{keep_best}-one"))
    double = launch(keep_best_job(world / f"best-{keep_best}-two"), 2, log_line=lambda _: None)
    assert double["world_size"] == 2 and single["steps"] == double["steps"] == 9
    one, two = single["heldout_losses"], double["heldout_losses"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [3, 6, 9]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert one[-1]["loss"] < one[0]["loss"]  # it trains, so equal losses mean something
    if keep_best == "tau":
        tau_one, tau_two = [r["tau"] for r in one], [r["tau"] for r in two]
        print(f"tau per epoch: one process {tau_one}, two {tau_two}")
        assert tau_two == pytest.approx(tau_one, rel=1e-6)
        assert max(tau_one) > 1.0  # the draft is accepted at all
    assert double["best_epoch"] == single["best_epoch"]
    a = load_file(str(world / f"best-{keep_best}-one" / "draft" / "model.safetensors"))
    b = load_file(str(world / f"best-{keep_best}-two" / "draft" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-4, msg=name)
