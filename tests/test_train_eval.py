"""Training and offline evaluation end to end on a tiny target, on CPU.

The target is a random `Qwen3ForCausalLM` whose embeddings dominate its residual stream and whose
lm_head maps token v's embedding to the row of perm[v]: its greedy continuation follows a fixed
permutation (with the random layers as small context noise), so a draft can learn it in seconds.
The training data are the target's own greedy answers to random prompts, written into shards by
the pipeline's own `extract_hidden_states`, so a format change cannot pass unnoticed.
That world is in tests/train_helpers.py; its fixtures (`one_thread`, `world`, `trained`), which
other modules share, are in tests/conftest.py.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from eaglet.config import TargetConfig, TrainConfig
from eaglet.draft.evaluate import evaluate_draft, load_target, plot_acceptance, target_forward
from eaglet.draft.heldout_tau import HeldoutTau, heldout_prompts
from eaglet.draft.methods.eagle3 import propose
from eaglet.draft.methods.eagle3_checkpoint import load_draft
from eaglet.draft.methods.eagle3_ttt import ttt_unroll
from eaglet.draft.train import setup, train_draft, train_step
from eaglet.draft.train_data import HiddenStatesData, epoch_order, length_groups, micro_batches
from eaglet.errors import NonFiniteError
from eaglet.records.examples import Example
from tests.train_helpers import (
    ANSWER_LEN,
    AUX_IDS,
    CONVENTION,
    HIDDEN,
    PROMPT_LEN,
    VOCAB,
    random_prompts,
    settings,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_shards_follow_the_contract(world):
    data = HiddenStatesData(world / "hs")
    assert len(data) == 64 and data.aux_width() == 3 * HIDDEN
    item = data[3]
    assert item["input_ids"].shape == (PROMPT_LEN + ANSWER_LEN,)
    assert item["loss_mask"][:PROMPT_LEN].sum() == 0 and item["loss_mask"][PROMPT_LEN:].all()
    target = load_target(world / "target")
    logits = target.lm_head(item["final_hidden_states"])
    ref = target(item["input_ids"][None], use_cache=False).logits[0]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_training_lowers_loss_and_writes_outputs(trained, world):
    summary, progress = trained
    assert summary["steps"] == summary["total_steps"] == 20 * 8
    assert summary["final_loss"] < 0.5 * summary["initial_loss"]
    assert min(summary["final_acc"]) > 0.9
    assert summary["draft_vocab_size"] == 256 and 0.8 < summary["vocab_coverage"] < 1.0
    assert summary["train_samples"] == 64 and summary["train_tokens"] == 64 * 52
    assert progress[-1]["step"] == 160 and len(progress[-1]["acc"]) == 4
    # what the train task's log lines and progress artifact show: rate and ETA
    assert progress[-1]["stop_at"] == 160 and progress[-1]["eta_s"] == 0
    assert progress[0]["eta_s"] > 0 and all(r["tokens_per_s"] > 0 for r in progress)
    metrics = [json.loads(line) for line in (world / "run" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == list(range(5, 161, 5))
    assert {"step", "epoch", "loss", "acc", "lr", "tokens_per_s"} <= set(metrics[0])
    assert (world / "run" / "loss.png").stat().st_size > 0
    draft, config = load_draft(world / "run" / "draft")
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["intermediate_size"] == 128 and config["vocab_size"] == VOCAB
    assert config["eaglet"]["aux_layer_convention"] == CONVENTION


def test_training_raises_tau_over_untrained(trained, world, tmp_path):
    prompts = random_prompts(6, seed=99)  # unseen prompts, same distribution
    args = (world / "run" / "draft", world / "target", prompts)
    report = evaluate_draft(*args, num_speculative_tokens=4, max_new_tokens=32)
    baseline = report.pop("untrained")
    print(f"tau trained {report['tau']:.3f} untrained {baseline['tau']:.3f}")
    assert report["outputs_match_greedy"] and baseline["outputs_match_greedy"]
    assert report["new_tokens"] == baseline["new_tokens"] == 6 * 32
    assert baseline["tau"] < 1.3
    assert report["tau"] > 3.0
    assert report["num_rounds"] < baseline["num_rounds"]
    acc = report["per_position_acceptance"]
    assert len(acc) == 4 and all(a >= b for a, b in zip(acc, acc[1:], strict=False))
    assert report["tau"] == pytest.approx(1 + report["accepted_tokens"] / report["num_rounds"])
    plot_acceptance(report, tmp_path / "acceptance.png")
    assert (tmp_path / "acceptance.png").stat().st_size > 0


def test_eval_drafting_equals_the_training_unroll(trained, world):
    """`propose` (inference) and `ttt_unroll` (training) give the same tokens for a prefix."""
    draft, _ = load_draft(world / "run" / "draft")
    target = load_target(world / "target")
    embed = target.get_input_embeddings().weight
    prompt = random_prompts(1, seed=7)[0]
    greedy, aux = target_forward(target, prompt, AUX_IDS)
    x_next = int(greedy[-1])
    drafted = propose(draft, embed, prompt, aux, x_next, k=4)
    with torch.no_grad():
        ids = torch.tensor([prompt + [x_next] + drafted[:3]])  # step i reads token L+i at L-1
        logits = ttt_unroll(draft, embed, ids, draft.fuse(aux[None]), ttt_length=4)
    unrolled = [int(draft.to_target_ids(step[0, -1].argmax())) for step in logits]
    assert unrolled == drafted


def test_resume_continues_at_saved_step_with_same_vocab(world, tmp_path, monkeypatch):
    fast = settings(epochs=2, log_every=2)  # 16 steps
    held_out = {"s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7"}
    args = (world / "hs", world / "target")
    kwargs = dict(
        aux_layer_ids=AUX_IDS, aux_layer_convention=CONVENTION, exclude_sample_ids=held_out
    )
    full = train_draft(*args, tmp_path / "full", fast, **kwargs)
    assert full["steps"] == 14 and full["train_samples"] == 56  # 56 samples / 8 = 7 per epoch

    part = train_draft(
        *args, tmp_path / "part", settings(epochs=2, log_every=2, max_steps=5), **kwargs
    )
    assert part["steps"] == 5
    state = json.loads((tmp_path / "part" / "state" / "state.json").read_text())
    assert state["step"] == 5 and state["epoch"] == 0
    vocab_before = (tmp_path / "part" / "state" / "vocab.json").read_text()

    def no_recount(*a, **k):
        raise AssertionError("the vocab must be loaded on resume, not recomputed")

    monkeypatch.setattr("eaglet.draft.train.build_draft_vocab", no_recount)
    steps_seen = []
    resumed = train_draft(
        *args, tmp_path / "part", fast, progress=lambda r: steps_seen.append(r["step"]), **kwargs
    )
    assert resumed["resumed_from_step"] == 5 and resumed["steps"] == 14
    assert steps_seen[0] == 6
    assert (tmp_path / "part" / "state" / "vocab.json").read_text() == vocab_before
    metrics = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [2, 4, 5, 6, 8, 10, 12, 14]

    # resuming gives the same weights as never stopping
    a = load_file(str(tmp_path / "full" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "draft" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


HELD_OUT = frozenset(f"s{i}" for i in range(8))  # 56 training samples: 7 steps an epoch


def test_keep_best_exports_the_epoch_of_the_lowest_held_out_loss(world, tmp_path, monkeypatch):
    """train.keep_best: the held-out loss at each epoch's end is in the summary; the exported
    draft holds the weights of the epoch where it was lowest (here the second of three), while
    the training state keeps the last epoch's for a resume."""
    args = (world / "hs", world / "target")
    kwargs = dict(
        aux_layer_ids=AUX_IDS, aux_layer_convention=CONVENTION, exclude_sample_ids=HELD_OUT
    )
    real = train_draft(*args, tmp_path / "real", settings(epochs=3, keep_best=True), **kwargs)
    losses = [r["loss"] for r in real["heldout_losses"]]
    assert [r["step"] for r in real["heldout_losses"]] == [7, 14, 21]
    assert [r["epoch"] for r in real["heldout_losses"]] == [1.0, 2.0, 3.0]
    assert 0 < losses[2] < losses[0]  # measured on the 8 held-out samples, it falls
    assert real["best_epoch"] == 1.0 + losses.index(min(losses))

    planted = [3.0, 1.0, 2.0]  # the second epoch is the best
    monkeypatch.setattr("eaglet.draft.train.heldout_loss", lambda run: planted.pop(0))
    best = train_draft(*args, tmp_path / "best", settings(epochs=3, keep_best=True), **kwargs)
    assert best["best_epoch"] == 2.0 and [r["loss"] for r in best["heldout_losses"]] == [3, 1, 2]
    # the same run stopped at the second epoch's end (same schedule: max_steps keeps it)
    second = train_draft(*args, tmp_path / "second", settings(epochs=3, max_steps=14), **kwargs)
    assert second["steps"] == 14
    exported = load_file(str(tmp_path / "best" / "draft" / "model.safetensors"))
    at_second = load_file(str(tmp_path / "second" / "draft" / "model.safetensors"))
    last = load_file(str(tmp_path / "best" / "state" / "model.safetensors"))
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, at_second[name], rtol=0, atol=0, msg=name)
    assert any(not torch.equal(last[n], exported[n]) for n in last if n in exported)
    state = json.loads((tmp_path / "best" / "state" / "state.json").read_text())
    assert [r["loss"] for r in state["heldout_losses"]] == [3, 1, 2]


def test_keep_best_tau_exports_the_epoch_the_target_accepts_most(world, tmp_path, monkeypatch):
    """train.keep_best: tau measures the evaluator's tau on held-out prompts at each epoch's end
    (beside the loss) and exports the epoch of the highest tau, whatever the loss says."""
    args = (world / "hs", world / "target")
    kwargs = dict(
        aux_layer_ids=AUX_IDS, aux_layer_convention=CONVENTION, exclude_sample_ids=HELD_OUT
    )
    config = settings(epochs=3, keep_best="tau", keep_best_prompts=4, keep_best_max_new_tokens=16)
    real = train_draft(*args, tmp_path / "real", config, **kwargs)
    taus = [r["tau"] for r in real["heldout_losses"]]
    print(f"held-out tau per epoch {taus}, loss {[r['loss'] for r in real['heldout_losses']]}")
    assert [r["step"] for r in real["heldout_losses"]] == [7, 14, 21]
    assert all(1.0 <= t <= 1 + config.ttt_length for t in taus) and taus[-1] > 1.2
    assert real["best_epoch"] == 1.0 + taus.index(max(taus))
    # the exported draft's tau, evaluated from its folder as the evaluate stage would
    prompts = heldout_prompts(HiddenStatesData(world / "hs", only_sample_ids=HELD_OUT), 4)
    report = evaluate_draft(
        tmp_path / "real" / "draft", world / "target", prompts, config.ttt_length, 16,
        untrained_seed=None, device="cpu",
    )  # fmt: skip
    assert report["tau"] == pytest.approx(max(taus))

    planted_tau, planted_loss = [2.0, 3.0, 1.5], [3.0, 2.0, 1.0]  # tau best at 2, loss at 3
    monkeypatch.setattr(HeldoutTau, "__call__", lambda self, draft: planted_tau.pop(0))
    monkeypatch.setattr("eaglet.draft.train.heldout_loss", lambda run: planted_loss.pop(0))
    best = train_draft(*args, tmp_path / "best", config, **kwargs)
    assert best["best_epoch"] == 2.0
    train_draft(*args, tmp_path / "second", settings(epochs=3, max_steps=14), **kwargs)
    exported = load_file(str(tmp_path / "best" / "draft" / "model.safetensors"))
    at_second = load_file(str(tmp_path / "second" / "draft" / "model.safetensors"))
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, at_second[name], rtol=0, atol=0, msg=name)


def test_keep_best_true_is_the_loss_as_before():
    assert TrainConfig(keep_best=True).keep_best == "loss"
    assert TrainConfig(keep_best=False).keep_best == "off"


def test_keep_best_resumes_with_the_losses_it_measured(world, tmp_path):
    """A keep_best run stopped mid-way and resumed records the same held-out losses and
    exports the same draft as a run never stopped."""
    args = (world / "hs", world / "target")
    kwargs = dict(
        aux_layer_ids=AUX_IDS, aux_layer_convention=CONVENTION, exclude_sample_ids=HELD_OUT
    )
    config = settings(epochs=2, keep_best=True)
    full = train_draft(*args, tmp_path / "full", config, **kwargs)
    train_draft(
        *args, tmp_path / "part", settings(epochs=2, keep_best=True, max_steps=10), **kwargs
    )
    resumed = train_draft(*args, tmp_path / "part", config, **kwargs)
    assert resumed["resumed_from_step"] == 10
    steps = [(r["epoch"], r["step"]) for r in resumed["heldout_losses"]]
    assert steps == [(r["epoch"], r["step"]) for r in full["heldout_losses"]] == [(1, 7), (2, 14)]
    losses = [r["loss"] for r in resumed["heldout_losses"]]
    assert losses == pytest.approx([r["loss"] for r in full["heldout_losses"]], rel=1e-6)
    a = load_file(str(tmp_path / "full" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "draft" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_hidden_noise_changes_the_steps_and_resumes_exactly(world, tmp_path):
    """train.hidden_noise: Gaussian noise on the aux states makes other steps than none (and
    still trains); the noise comes from the saved RNG, so a resumed run equals one never
    stopped."""
    args = (world / "hs", world / "target")
    kwargs = dict(
        aux_layer_ids=AUX_IDS, aux_layer_convention=CONVENTION, exclude_sample_ids=HELD_OUT
    )
    quiet = train_draft(*args, tmp_path / "quiet", settings(epochs=2, log_every=2), **kwargs)
    noisy_config = settings(epochs=2, log_every=2, hidden_noise=0.5)
    noisy = train_draft(*args, tmp_path / "noisy", noisy_config, **kwargs)
    assert noisy["final_loss"] != pytest.approx(quiet["final_loss"], rel=1e-4)
    assert noisy["final_loss"] < 0.9 * noisy["initial_loss"]
    part_config = settings(epochs=2, log_every=2, hidden_noise=0.5, max_steps=9)
    train_draft(*args, tmp_path / "part", part_config, **kwargs)
    train_draft(*args, tmp_path / "part", noisy_config, **kwargs)
    a = load_file(str(tmp_path / "noisy" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "draft" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_keep_best_needs_offline_shards_and_held_out_samples():
    with pytest.raises(ValueError, match="keep_best reads the held-out samples' features"):
        TrainConfig(keep_best=True, hidden_states="online")
    with pytest.raises(ValueError, match="holdout_fraction > 0"):
        TrainConfig(keep_best=True, holdout_fraction=0.0)


def test_gradient_accumulation_follows_the_same_loss_curve(world, tmp_path):
    """Two micro-batches per step, each normalized by the whole batch's counts: the same
    steps as one batch (float sums aside)."""
    runs = {}
    for accumulation in (1, 2):
        out = tmp_path / f"accum{accumulation}"
        config = settings(epochs=1, log_every=1, grad_accumulation=accumulation)
        train_draft(world / "hs", world / "target", out, config, AUX_IDS, CONVENTION)
        runs[accumulation] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").open()]
    assert len(runs[1]) == 8 and runs[1][-1] < runs[1][0]
    assert runs[2] == pytest.approx(runs[1], rel=1e-5)


def test_length_groups_cover_every_row_once_with_bounded_padding():
    lengths = {0: 36, 1: 374, 2: 98, 3: 40, 4: 120, 5: 37, 6: 300, 7: 95}
    groups = length_groups(list(lengths), lengths, max_padding=0.5)
    assert sorted(r for g in groups for r in g) == list(lengths)
    for group in groups:
        padded = len(group) * max(lengths[r] for r in group)
        assert padded <= 1.5 * sum(lengths[r] for r in group)
    assert [sorted(g) for g in groups] == [[0, 3, 5], [2, 4, 7], [1, 6]]
    assert length_groups(list(lengths), lengths, max_padding=float("inf")) == [
        sorted(lengths, key=lengths.get)
    ]


def test_a_step_split_into_length_groups_equals_one_padded_batch(world, tmp_path, monkeypatch):
    """Windows of 20 and 12 tokens (max_seq_len 20 over 52-token samples): split by length,
    each piece divided by the whole batch's counts, the steps are the padded batch's steps."""
    data = HiddenStatesData(world / "hs", set(), max_seq_len=20)
    assert {w[-1] for w in data.windows} == {20, 12}
    target = TargetConfig(model=str(world / "target"))
    config = settings(max_seq_len=20, batch_size=12)
    runs, losses = {}, {}
    for max_padding in (0.0, float("inf")):
        monkeypatch.setattr("eaglet.draft.train_data.MAX_PADDING", max_padding)
        run = setup(data, target, tmp_path / str(max_padding), config, AUX_IDS, CONVENTION, False)
        order = epoch_order(run, 0)
        pieces = [micro_batches(run, batch) for batch in order[:4]]
        for batch, split in zip(order, pieces, strict=False):  # every row once
            assert sorted(j for piece in split for j in piece) == sorted(batch)
        assert max(len(ps) for ps in pieces) == (2 if max_padding == 0.0 else 1)
        losses[max_padding] = [train_step(run, batch)["loss"] for batch in order[:4]]
        runs[max_padding] = run
    assert losses[0.0] == pytest.approx(losses[float("inf")], rel=1e-5)
    split, padded = runs[0.0].draft.state_dict(), runs[float("inf")].draft.state_dict()
    for name in split:
        torch.testing.assert_close(split[name], padded[name], rtol=1e-4, atol=1e-6, msg=name)


def test_bfloat16_autocast_trains_on_cpu(world, tmp_path):
    config = settings(epochs=2, log_every=2, precision="bfloat16")
    summary = train_draft(world / "hs", world / "target", tmp_path, config, AUX_IDS, CONVENTION)
    assert summary["precision"] == "bfloat16"
    assert summary["final_loss"] < 0.8 * summary["initial_loss"]
    _, saved = load_draft(tmp_path / "draft")
    assert saved["torch_dtype"] == "float32"  # weights stay fp32; only the matmuls ran in bf16


def test_lm_head_init_target_starts_the_draft_from_the_targets_rows(world, tmp_path):
    """`lm_head_init: target` copies the target's lm_head rows of the draft vocab (the draft
    then trains them); `random` does not."""
    data = HiddenStatesData(world / "hs", set(), 1024)
    target = TargetConfig(model=str(world / "target"))
    target_lm_head = load_file(str(world / "target" / "model.safetensors"))["lm_head.weight"]
    for init in ("target", "random"):
        config = settings(lm_head_init=init)
        run = setup(data, target, tmp_path / init, config, AUX_IDS, CONVENTION, resume=False)
        rows = target_lm_head[run.vocab.ids]  # [Vd, H]
        assert torch.equal(run.draft.lm_head.weight.detach(), rows) == (init == "target")


def test_the_learning_rate_falls_from_the_peak_to_lr_floor_times_it(world, tmp_path):
    """After warmup, a cosine from train.lr to train.lr_floor x train.lr at the last step."""
    data = HiddenStatesData(world / "hs", set(), 1024)
    target = TargetConfig(model=str(world / "target"))
    for floor in (0.0, 0.1):
        config = settings(epochs=2, lr_floor=floor)
        run = setup(data, target, tmp_path / str(floor), config, AUX_IDS, CONVENTION, False)
        lrs = []
        for _ in range(run.total_steps):
            lrs.append(run.schedule.get_last_lr()[0])
            run.optimizer.step()
            run.schedule.step()
        lrs.append(run.schedule.get_last_lr()[0])  # what a step after the last would take
        warmup = config.warmup_steps
        assert lrs[warmup - 1] == pytest.approx(config.lr)
        assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :], strict=False))
        assert lrs[-1] == pytest.approx(floor * config.lr, abs=1e-12)


def test_a_non_finite_loss_fails_the_step_naming_it_and_its_first_sample(
    world, tmp_path, monkeypatch
):
    """A NaN in a batch's features gives a NaN loss: the step is refused before the optimizer
    moves a weight, naming the step and the batch's first sample."""
    from eaglet.draft import train_data

    data = HiddenStatesData(world / "hs", set(), 1024)
    target = TargetConfig(model=str(world / "target"))
    run = setup(data, target, tmp_path, settings(epochs=1), AUX_IDS, CONVENTION, False)
    batch = epoch_order(run, 0)[0]
    real_collate = train_data.collate

    def poisoned(items):
        collated = real_collate(items)
        collated["aux_hidden_states"] = collated["aux_hidden_states"] * float("nan")
        return collated

    monkeypatch.setattr(train_data, "collate", poisoned)
    before = {k: v.clone() for k, v in run.draft.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"train step 1: the loss is not finite") as raised:
        train_step(run, batch)
    first = data.window_sample_ids[micro_batches(run, batch)[0][0]]
    assert f"first sample is {first}" in str(raised.value)
    for name, value in run.draft.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_non_finite_target_states_fail_the_hidden_states_stage_naming_the_sample():
    from eaglet.hidden_states.stage import encode_sample

    example = Example.model_validate(
        {"sample_id": "s7", "source": "t", "reasoning": "", "content": "",
         "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "finish_reason": "stop"}
    )  # fmt: skip
    aux, final = torch.zeros(3, 3 * HIDDEN), torch.zeros(3, HIDDEN)
    final[2, 5] = float("nan")
    features = {"aux_hidden_states": aux, "final_hidden_states": final}
    with pytest.raises(NonFiniteError, match=r"sample s7: .*final_hidden_states.* token 2 of 3"):
        encode_sample(example, features, "int8")


def test_a_target_with_nan_weights_never_scores_a_perfect_tau(trained, world, tmp_path):
    import shutil

    from safetensors.torch import save_file

    broken = tmp_path / "target"
    shutil.copytree(world / "target", broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights = {k: v * float("nan") if "mlp" in k else v for k, v in weights.items()}
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    args = (world / "run" / "draft", broken, random_prompts(2, seed=5))
    with pytest.raises(NonFiniteError, match=r"held-out prompt 0 of 2: the target's logits"):
        evaluate_draft(*args, num_speculative_tokens=4, max_new_tokens=8)
