"""Hidden states: a sample's features are the same bytes whatever is extracted beside it,
storage forms read back as floats, the shard format train reads, the disk budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eaglet.draft.train_data import HiddenStatesData
from eaglet.hidden_states.backends.hf import HFBackend
from eaglet.hidden_states.budget import (
    DiskBudgetError,
    check_disk_budget,
    estimate_bytes,
)
from eaglet.hidden_states.feature_encoding import bytes_per_token, decode, encode
from eaglet.hidden_states.layers import resolve_aux_layer_ids
from eaglet.hidden_states.shards import read_window, write_safetensors_hashed
from eaglet.hidden_states.stage import plan_shards, stage_body
from eaglet.storage import sha256_file
from tests.hidden_states_helpers import config_for, tiny_target, write_examples


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return tiny_target(tmp_path_factory.mktemp("target") / "model")


def test_a_samples_features_are_the_same_bytes_alone_and_among_others(target_dir, tmp_path):
    """Computed alone or among longer samples, a sample's states are equal bit for bit: per-
    sample reuse copies what a fresh run computes (issue 46)."""
    config = config_for(tmp_path, target_dir)
    backend = HFBackend(config.target, [1, 3, 5])
    rng = torch.Generator().manual_seed(0)
    short = torch.randint(1, 300, (7,), generator=rng).tolist()
    longer = [torch.randint(1, 300, (n,), generator=rng).tolist() for n in (31, 45, 60)]

    class Sample:
        def __init__(self, ids: list[int]) -> None:
            self.input_ids = ids

    alone = backend.features([Sample(short)])[0]
    among = backend.features([Sample(ids) for ids in (*longer[:2], short, longer[2])])[2]
    assert alone["aux_hidden_states"].shape == (7, 3 * 64)
    assert alone["final_hidden_states"].shape == (7, 64)
    for key in ("aux_hidden_states", "final_hidden_states"):
        assert torch.equal(among[key], alone[key]), key


def test_states_are_hf_hidden_states_at_the_layer_ids(target_dir, tmp_path):
    from eaglet.target import load_model

    config = config_for(tmp_path, target_dir)
    ids = torch.randint(1, 300, (12,)).tolist()
    got = HFBackend(config.target, [1, 3, 5]).forward(ids)
    model = load_model(config.target)
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        logits = model.lm_head(got["final_hidden_states"])
    expected = torch.cat([out.hidden_states[i][0] for i in (1, 3, 5)], dim=-1)
    torch.testing.assert_close(got["aux_hidden_states"], expected)
    # The final state is post-norm: lm_head of it gives the target's logits.
    torch.testing.assert_close(logits, out.logits[0])


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8", "fp8"])
def test_storage_forms_round_trip_within_their_precision(storage, tmp_path):
    values = torch.randn(50, 3 * 64) * torch.logspace(-2, 2, 50)[:, None]  # per-token scales
    stored = encode("aux_hidden_states", values, storage, groups=3)
    back = decode(stored["aux_hidden_states"], stored.get("aux_hidden_states_scale"))
    relative = ((back - values).norm(dim=-1) / values.norm(dim=-1)).max().item()
    bound = {"float32": 0.0, "bfloat16": 5e-3, "int8": 2e-2, "fp8": 6e-2}[storage]
    assert relative <= bound
    # the shard layout matches safetensors' own writer, and the hash is of the bytes written
    written = write_safetensors_hashed(stored, tmp_path / "s.safetensors")
    assert written.sha256 == sha256_file(tmp_path / "s.safetensors")
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        for key, tensor in stored.items():
            assert torch.equal(f.get_tensor(key).view(torch.uint8), tensor.view(torch.uint8))


def test_compact_storage_is_4h_bytes_of_values_per_token():
    H = 7168
    assert bytes_per_token(H, "float32") - 9 == 16 * H
    assert bytes_per_token(H, "bfloat16") - 9 == 8 * H
    for storage in ("int8", "fp8"):  # values + 4 float32 scales, + id and mask
        assert bytes_per_token(H, storage) - 9 - 16 == 4 * H


def run_body(config, examples_path: Path, folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    return stage_body(config, examples_path, report=lambda _: None)(folder)


@pytest.mark.parametrize("storage", ["float32", "int8"])
def test_stage_writes_the_shards_train_reads(target_dir, tmp_path, storage):
    examples = write_examples(tmp_path / "examples.jsonl", 23)
    config = config_for(tmp_path / "work", target_dir, storage=storage, shard_tokens=256)
    folder = tmp_path / "work" / "hs"
    output = run_body(config, tmp_path / "examples.jsonl", folder)
    index = [json.loads(line) for line in (folder / "index.jsonl").read_text().splitlines()]
    assert [row["sample_id"] for row in index] == [e.sample_id for e in examples]
    assert len(output.info["shards"]) == len(plan_shards(tmp_path / "examples.jsonl", 256)) > 2
    for name, entry in output.files.items():  # hashes computed while writing are right
        assert sha256_file(folder / name) == entry["sha256"]
    backend = HFBackend(config.target, [1, 3, 5])
    data = HiddenStatesData(folder, max_seq_len=1024)
    row = index[5]
    expected = backend.forward(examples[5].input_ids)
    with safe_open(str(folder / row["shard"]), framework="pt") as f:
        window = read_window(f, row["offset"], row["length"])
    item = data[5]
    for got in (window, item):
        assert got["input_ids"].tolist() == examples[5].input_ids
        assert got["loss_mask"].tolist() == [bool(m) for m in examples[5].loss_mask]
        tol = 1e-5 if storage == "float32" else 2e-2
        for key in ("aux_hidden_states", "final_hidden_states"):
            assert got[key].dtype == torch.float32
            err = (got[key] - expected[key]).norm() / expected[key].norm()
            assert err <= tol, (key, err)
    assert output.info["storage"] == storage
    assert output.info["aux_layer_convention"] == "hf_hidden_states_index"


def test_budget_estimate_and_refusal_names_both_numbers(tmp_path):
    assert estimate_bytes(1000, 64, "int8") < estimate_bytes(1000, 64, "float32")
    with pytest.raises(DiskBudgetError) as error:
        check_disk_budget(tmp_path, num_tokens=10**12, hidden_size=7168, storage="float32")
    message = str(error.value)
    assert "free" in message and "hidden_states.storage=int8" in message
    assert "train.hidden_states: online" in message
    check_disk_budget(tmp_path, num_tokens=10, hidden_size=64, storage="int8")  # fits


def test_layer_ids_run_from_the_embeddings_to_the_last_layers_input():
    """Id 0 (the embeddings) is a layer vLLM can feed a draft; id num_layers is not (HF's is
    after the final norm, vLLM's before it), nor is anything below 0."""
    assert resolve_aux_layer_ids([0, 4, 7], num_layers=8) == [0, 4, 7]
    for wrong in ([2, 4, 8], [-1, 4, 5]):
        with pytest.raises(ValueError, match=r"must lie in 0\.\.7"):
            resolve_aux_layer_ids(wrong, num_layers=8)


def test_progress_moves_inside_a_shard_sample_by_sample(target_dir, tmp_path):
    """One shard of many samples: the progress fraction moves after each sample (a long shard
    of a large target used to show nothing for ten minutes), reaching 1 at the end."""
    write_examples(tmp_path / "examples.jsonl", 12)
    config = config_for(tmp_path / "work", target_dir, shard_tokens=1 << 20)
    folder = tmp_path / "work" / "hs"
    folder.mkdir(parents=True)
    fractions: list[float] = []
    body = stage_body(config, tmp_path / "examples.jsonl", lambda _: None, fractions.append)
    output = body(folder)
    assert len(output.info["shards"]) == 1
    assert len(fractions) >= 12 + 1  # twelve samples, then the shard's end
    assert fractions == sorted(fractions) and 0 < fractions[0] < 1 and fractions[-1] == 1.0


def test_the_removed_batch_keys_load_at_their_old_defaults_and_are_refused_otherwise():
    """Every WORK_DIR/config.yaml an earlier run wrote holds hidden_states.batch_size 8 and
    batch_tokens 16384: it still loads (the resume command works); another value, which would
    do nothing now, is refused saying why."""
    from eaglet.config import ConfigError, load_config

    config = load_config(None, ["hidden_states.batch_size=8", "hidden_states.batch_tokens=16384"])
    assert "batch_size" not in config.hidden_states.model_dump()
    with pytest.raises(ConfigError, match="batch_size is no longer a setting: the hf backend"):
        load_config(None, ["hidden_states.batch_size=32"])
