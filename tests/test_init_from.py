"""`train.init_from`: training continues from a draft someone already trained, read from any of
the formats users fine-tune (eaglet's three exports, speculators', a vLLM/EAGLE-3 or SpecForge
checkpoint), and a draft that does not fit the target or the run is refused naming why.

The target and its feature shards are tests/train_helpers.py's (a tiny Qwen3 whose greedy
continuation a draft learns in seconds). The speculators draft is written in the format
speculators 0.9.0's trainer writes (its config keys as recorded from a real run in
tests/test_draft_variants.py, bf16 weights, a frozen copy of the target's embeddings): no
speculators install is needed to read it.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from eaglet.cache import stage_key
from eaglet.config import PipelineConfig, TargetConfig, load_config
from eaglet.draft.init_from import StartingDraftError, read_starting_draft
from eaglet.draft.methods.eagle3_checkpoint import load_draft
from eaglet.draft.methods.eagle3_exports import SGLANG_FOLDER, SPECULATORS_FOLDER, write_exports
from eaglet.draft.train import train_draft
from eaglet.preflight import PreflightReport, check_init_from
from tests.train_helpers import AUX_IDS, CONVENTION, HIDDEN, VOCAB, make_target, settings

# `world`: tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def base(world):
    """A draft trained from scratch on the world's shards, and its three exports."""
    summary = train_draft(
        world / "hs", world / "target", world / "base", settings(epochs=6), AUX_IDS, CONVENTION
    )
    exports = write_exports(world / "base" / "draft", TargetConfig(model=str(world / "target")), 3)
    assert set(exports) == {"vllm", "sglang", "speculators"}
    return summary


def fine_tune(world, out, folder, **overrides):
    config = settings(epochs=1, init_from=str(folder), **overrides)
    return train_draft(world / "hs", world / "target", out, config, AUX_IDS, CONVENTION)


@pytest.mark.parametrize("export", ["draft", SGLANG_FOLDER, SPECULATORS_FOLDER])
def test_training_continues_from_each_of_eaglets_exports(world, base, tmp_path, export):
    fresh = train_draft(
        world / "hs", world / "target", tmp_path / "fresh", settings(epochs=1), AUX_IDS, CONVENTION
    )
    tuned = fine_tune(world, tmp_path / "tuned", world / "base" / export)
    # It starts where the base draft ended, far below a fresh draft's first loss.
    assert tuned["initial_loss"] < 0.5 * fresh["initial_loss"], (tuned, fresh)
    assert tuned["initial_loss"] < 2 * base["final_loss"] + 0.5, (tuned, base)
    # Its vocabulary, shape and layer ids are the base draft's, whatever the export's spelling.
    start, _ = load_draft(world / "base" / "draft")
    after, config = load_draft(tmp_path / "tuned" / "draft")
    assert torch.equal(after.d2t, start.d2t) and torch.equal(after.t2d, start.t2d)
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert config["draft_vocab_size"] == start.config.draft_vocab_size
    # and it trained on: the weights moved.
    moved = load_file(str(tmp_path / "tuned" / "draft" / "model.safetensors"))
    assert not torch.equal(moved["fc.weight"], start.fc.weight.detach())


def speculators_trainer_folder(world, folder):
    """The base draft as speculators' trainer saves one: `layers.0.*`, bf16, a frozen copy of
    the embeddings, its own config keys and no eaglet label."""
    draft, config = load_draft(world / "base" / "draft")
    tensors = {
        k.replace("midlayer.", "layers.0."): v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in draft.state_dict().items()
    }
    tensors["embed_tokens.weight"] = torch.randn(VOCAB, HIDDEN).to(torch.bfloat16)
    keys = (
        "head_dim", "hidden_size", "intermediate_size", "max_position_embeddings",
        "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "vocab_size",
    )  # fmt: skip
    layer = {k: config[k] for k in keys}
    speculators = {
        "architectures": ["Eagle3DraftModel"],
        "draft_vocab_size": config["draft_vocab_size"],
        "dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": AUX_IDS,
        "embed_requires_grad": False,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "transformer_layer_config": {**layer, "model_type": "llama", "rope_theta": 10000.0},
    }
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(speculators))
    return folder


def test_a_draft_in_speculators_trainers_format_continues_training(world, base, tmp_path):
    folder = speculators_trainer_folder(world, tmp_path / "speculators-ckpt")
    start = read_starting_draft(folder)
    assert start.format == "speculators" and start.aux_layer_ids == AUX_IDS
    tuned = fine_tune(world, tmp_path / "tuned", folder)
    assert tuned["initial_loss"] < 2 * base["final_loss"] + 0.5, (tuned, base)


def vllm_checkpoint(world, folder, ids=None):
    """The base draft as a peer's vLLM/EAGLE-3 or SpecForge checkpoint: no eaglet label."""
    shutil.copytree(world / "base" / "draft", folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("eaglet")
    for where in (config, config["eagle_config"]):
        where.pop("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            where["eagle_aux_hidden_state_layer_ids"] = ids
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_peers_checkpoint_needs_its_layer_convention_said_when_it_names_ids(
    world,
    base,
    tmp_path,
):
    sglang_ids = [i - 1 for i in AUX_IDS]  # as a SpecForge config names AUX_IDS
    folder = vllm_checkpoint(world, tmp_path / "specforge", ids=sglang_ids)
    with pytest.raises(StartingDraftError, match="train.init_from_layer_convention"):
        read_starting_draft(folder)
    assert read_starting_draft(folder, "sglang").aux_layer_ids == AUX_IDS
    assert read_starting_draft(folder, "vllm").aux_layer_ids == sglang_ids
    tuned = fine_tune(world, tmp_path / "tuned", folder, init_from_layer_convention="sglang")
    assert tuned["initial_loss"] < 2 * base["final_loss"] + 0.5
    # Read the other way, it was trained on other layers than this run extracts: refused.
    with pytest.raises(StartingDraftError, match=r"hidden_states.aux_layer_ids: \[0, 2, 4\]"):
        fine_tune(world, tmp_path / "wrong", folder, init_from_layer_convention="vllm")


def test_a_checkpoint_naming_no_ids_takes_eagle3s_default(world, base, tmp_path):
    folder = vllm_checkpoint(world, tmp_path / "eagle", ids=None)
    start = read_starting_draft(folder, num_layers=6)
    assert start.aux_layer_ids == [2, 3, 3]  # (2, N//2, N-3) for the 6-layer target
    assert "default" in start.ids_said


def test_a_draft_of_another_target_is_refused_before_training(world, base, tmp_path):
    other = tmp_path / "other-target"
    make_target(other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = VOCAB + 10
    (other / "config.json").write_text(json.dumps(config))
    report = PreflightReport()
    pipeline = PipelineConfig(
        target=TargetConfig(model=str(other)),
        train=settings(init_from=str(world / "base" / "draft")),
        hidden_states={"aux_layer_ids": AUX_IDS},
    )
    check_init_from(pipeline, AutoConfig.from_pretrained(other), report)
    assert any("vocab_size is 300, the target's 310" in p for p in report.problems), report

    # The world's own target fits; the settings the draft overrides are named.
    report = PreflightReport()
    pipeline = pipeline.model_copy(update={"target": TargetConfig(model=str(world / "target"))})
    check_init_from(pipeline, AutoConfig.from_pretrained(world / "target"), report)
    assert not report.problems and any("train.init_from" in p for p in report.passed), report
    assert not report.warnings  # settings() match the base draft's

    # Other layers than the draft's: refused, naming the setting to change.
    report = PreflightReport()
    moved = PipelineConfig.model_validate(
        {**pipeline.model_dump(), "hidden_states": {"aux_layer_ids": [1, 2, 5]}}
    )
    check_init_from(moved, AutoConfig.from_pretrained(world / "target"), report)
    assert report.problems == [
        f"train.init_from {world / 'base' / 'draft'}: the draft was trained on target layers "
        f"{AUX_IDS} (vLLM's convention, from eaglet's label); this run extracts [1, 2, 5]: set "
        f"hidden_states.aux_layer_ids: {AUX_IDS}"
    ]


def test_the_train_key_holds_the_starting_drafts_content(world, base, tmp_path):
    folder = tmp_path / "start"
    shutil.copytree(world / "base" / "draft", folder)
    same = tmp_path / "same-elsewhere"
    shutil.copytree(world / "base" / "draft", same)

    def key(init_from):
        overrides = [f"work_dir={tmp_path / 'work'}", f"target.model={world / 'target'}"]
        if init_from:
            overrides.append(f"train.init_from={init_from}")
        return stage_key("train", load_config(None, overrides), [])

    assert key(folder) != key(None)
    assert key(folder) == key(same)  # by content, not by path
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert key(folder) != key(same)


@pytest.mark.parametrize("damage", ["cut", "garbage", "nan"])
def test_a_damaged_starting_draft_is_refused_by_the_preflight_naming_the_file(
    world,
    base,
    tmp_path,
    damage,
):
    """It passed the preflight and died in train with a SafetensorError naming no file (cut,
    garbage), or trained on NaN and was told to lower the learning rate (nan)."""
    folder = tmp_path / "start"
    shutil.copytree(world / "base" / "draft", folder)
    weights = folder / "model.safetensors"
    if damage == "cut":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + b"\0" * 64)
    else:
        tensors = load_file(weights)
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].clone().float()
        tensors[name].view(-1)[0] = float("nan")
        save_file(tensors, weights)
    pipeline = PipelineConfig(
        target=TargetConfig(model=str(world / "target")),
        train=settings(init_from=str(folder)),
        hidden_states={"aux_layer_ids": AUX_IDS},
    )
    report = PreflightReport()
    check_init_from(pipeline, AutoConfig.from_pretrained(world / "target"), report)
    [problem] = report.problems
    assert problem.startswith("train.init_from weights: ") and str(weights) in problem
    expected = {"cut": "cut short", "garbage": "not valid JSON", "nan": "NaN or infinite"}
    assert expected[damage] in problem


def test_a_grown_vocabulary_keeps_the_drafts_rows_and_takes_the_targets_for_new_tokens(
    world, base, tmp_path
):
    """`train.init_from_vocab: grow` (a refresh's): the tokens this run's data holds that the
    starting draft cannot propose join its vocabulary (most frequent first, up to
    draft_vocab_size), their lm_head rows the target's; its own rows are kept, and training
    goes on from it."""
    from eaglet.draft.init_from import grown_vocab, with_vocab
    from eaglet.draft.target_head import load_target_head
    from eaglet.draft.vocab import DraftVocab

    start, _ = load_draft(world / "base" / "draft")
    brought = DraftVocab.from_d2t(start.d2t.clone(), VOCAB)
    missing = [t for t in range(VOCAB) if t not in set(brought.token_ids)][:3]
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    counts[list(brought.token_ids)] = 5
    counts[missing] = torch.tensor([9, 7, 1])
    grown = grown_vocab(brought, counts, brought.size + 2)  # room for two of the three
    assert set(grown.token_ids) == set(brought.token_ids) | set(missing[:2])
    assert grown.coverage < 1.0  # the third is still out

    head = load_target_head(TargetConfig(model=str(world / "target")))
    draft = with_vocab(start, grown, head.lm_head)
    assert draft.config.draft_vocab_size == grown.size == draft.lm_head.weight.shape[0]
    assert torch.equal(draft.d2t, grown.d2t) and torch.equal(draft.t2d, grown.t2d)
    row = {t: i for i, t in enumerate(grown.token_ids)}
    old_row = {t: i for i, t in enumerate(brought.token_ids)}
    for token in brought.token_ids:
        assert torch.equal(draft.lm_head.weight[row[token]], start.lm_head.weight[old_row[token]])
    for token in missing[:2]:
        assert torch.equal(draft.lm_head.weight[row[token]], head.lm_head[token])
    assert start.lm_head.weight.shape[0] == brought.size  # the starting draft is untouched

    tuned = fine_tune(world, tmp_path / "grown", world / "base" / "draft",
                      init_from_vocab="grow")  # fmt: skip
    assert tuned["initial_loss"] < 2 * base["final_loss"] + 0.5, tuned
