"""Online training with served features: a real vLLM CPU server (extract_hidden_states and
eaglet's connector) computes each micro-batch's states, fetched ahead through the bounded
queue; the draft matches the one trained on co-located features."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from eaglet.config import TrainConfig
from eaglet.draft.online import OnlineData, Served
from eaglet.draft.train import train_draft
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION
from eaglet.hidden_states.vllm import server_args
from eaglet.target import load_config
from tests.hidden_states_helpers import config_for, write_examples
from tests.vllm_server import ROOT, vllm_python, vllm_server

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)"),
]
AUX = [2, 4, 5]


def test_served_online_draft_matches_colocated(fixture_model_dir, tmp_path):
    storage = tmp_path / "connector"
    storage.mkdir()
    config = config_for(tmp_path / "work", fixture_model_dir, aux_layer_ids=AUX)
    examples_path = tmp_path / "examples.jsonl"
    write_examples(examples_path, 16, seed=6, max_len=80)
    train = TrainConfig(
        epochs=1, batch_size=4, draft_vocab_size=512, log_every=1, threads=1, device="cpu"
    )
    colocated = OnlineData(examples_path, config.target, AUX, max_seq_len=train.max_seq_len)
    train_draft(colocated, config.target, tmp_path / "co", train, AUX, AUX_LAYER_CONVENTION)

    num_layers = load_config(config.target).num_hidden_layers
    args = server_args(AUX, num_layers, str(storage), cpu=True)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + old if old else "")
    try:
        with vllm_server(fixture_model_dir, tmp_path / "vllm.log", extra_args=args) as url:
            settings = config.hidden_states.model_copy(
                update={"endpoints": [url], "backend": "vllm", "concurrency": 4}
            )
            served = OnlineData(
                examples_path,
                config.target,
                AUX,
                max_seq_len=train.max_seq_len,
                source=Served(config.target, settings),
                prefetch=2,
            )
            summary = train_draft(
                served, config.target, tmp_path / "served", train, AUX, AUX_LAYER_CONVENTION
            )
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    assert summary["steps"] == 4 and summary["hidden_states"] == "online"
    assert not list(storage.iterdir())  # nothing kept on disk beyond the queue
    a = load_file(str(tmp_path / "co" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "served" / "draft" / "model.safetensors"))
    for name in a:  # states equal within fp32 tolerance, so the weights after 4 steps too
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-3, msg=name)
