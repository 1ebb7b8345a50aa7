"""Borrow, don't load: the trainer reads embed_tokens and lm_head by tensor name from the
target's safetensors (one file or a sharded index; tied or not), never the whole model."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eaglet.config import TargetConfig
from eaglet.draft.target_head import load_target_head
from tests.train_helpers import HIDDEN, VOCAB, make_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("head") / "target"
    model = make_target(path)
    return path, model


def test_reads_both_matrices_without_loading_the_model(target, monkeypatch):
    path, model = target

    def no_model(*args, **kwargs):
        raise AssertionError("the trainer must not load the whole target")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_model)
    head = load_target_head(TargetConfig(model=str(path)))
    assert torch.equal(head.embed, model.model.embed_tokens.weight.detach())
    assert torch.equal(head.lm_head, model.lm_head.weight.detach())
    assert head.config["hidden_size"] == HIDDEN and head.config["vocab_size"] == VOCAB
    assert head.config["num_key_value_heads"] == 1 and head.config["head_dim"] == 32


def test_sharded_checkpoint_is_read_through_its_index(target, tmp_path):
    path, model = target
    tensors = load_file(str(path / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((path / "config.json").read_text())
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(sharded / file))
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    head = load_target_head(TargetConfig(model=str(sharded)))
    assert torch.equal(head.embed, model.model.embed_tokens.weight.detach())
    assert torch.equal(head.lm_head, model.lm_head.weight.detach())


def test_tied_model_uses_the_embedding_for_both(target, tmp_path):
    path, model = target
    tied = tmp_path / "tied"
    tied.mkdir()
    config = json.loads((path / "config.json").read_text()) | {"tie_word_embeddings": True}
    (tied / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("lm_head.weight")
    save_file(tensors, str(tied / "model.safetensors"))
    head = load_target_head(TargetConfig(model=str(tied)))
    assert torch.equal(head.lm_head, model.model.embed_tokens.weight.detach())
    assert torch.equal(head.embed, head.lm_head)


def test_missing_safetensors_says_what_to_do(target, tmp_path):
    (tmp_path / "config.json").write_text((target[0] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_target_head(TargetConfig(model=str(tmp_path)))
