"""The vllm backend against a real vLLM CPU server (extract_hidden_states + eaglet's CPU-safe
connector): its states equal the hf backend's at the same layer ids within fp32 tolerance,
which proves the layer-id convention (id i = HF hidden_states[i]) and the post-norm final
state; the stage writes the same shards through either backend; online training with served
features (fetched ahead through the bounded queue) trains the draft co-located features train.
One server for the module: starting one takes most of a minute on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eaglet.config import TrainConfig
from eaglet.draft.online import OnlineData
from eaglet.draft.train import train_draft
from eaglet.hidden_states.backends import hidden_states_backend
from eaglet.hidden_states.backends.base import Window
from eaglet.hidden_states.backends.hf import HFBackend
from eaglet.hidden_states.backends.vllm import VllmBackend, started_server
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION
from eaglet.hidden_states.shards import read_window
from eaglet.hidden_states.stage import stage_body
from tests.hidden_states_helpers import config_for, write_examples
from tests.vllm_server import vllm_python

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)"),
]


def processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


# The fixture target in float32, eager (no compile on CPU), its own 1024-token context.
SERVER_ARGS = ["--enforce-eager", "--max-model-len", "1024"]


def eaglet_started(config, vllm_python: Path):
    """`config` with the vllm backend and a server eaglet starts itself (vllm_python)."""
    server = {"vllm_python": str(vllm_python), "vllm_args": SERVER_ARGS, "concurrency": 4}
    settings = config.hidden_states.model_copy(
        update={"backend": "vllm", "vllm": config.hidden_states.vllm.model_copy(update=server)}
    )
    return config.model_copy(update={"hidden_states": settings})


@pytest.fixture(scope="module")
def served(fixture_model_dir, tmp_path_factory):
    """A vLLM server extracting the aux layers (2, 4, 5) and the last layer of the fixture,
    started by eaglet's own `started_server` (the command, the CPU connector on the server's
    PYTHONPATH, the served name)."""
    folder = tmp_path_factory.mktemp("vllm-hs")
    config = config_for(folder / "work", fixture_model_dir, aux_layer_ids=[2, 4, 5])
    with started_server(eaglet_started(config, vllm_python()), folder) as run:
        assert run.hidden_states.vllm.endpoints[0].startswith("http://127.0.0.1:")
        yield run, folder / "connector"
    assert not (folder / "connector").exists()  # removed with the server


def test_vllm_states_equal_hf_at_the_same_layer_ids(served, tmp_path):
    config, storage = served
    examples = write_examples(tmp_path / "examples.jsonl", 6, seed=4, max_len=80)
    for example in examples:  # the fixture's vocabulary is larger; keep ids in range
        assert max(example.input_ids) < 2042
    vllm = VllmBackend(config.target, config.hidden_states)
    hf = HFBackend(config.target, [2, 4, 5])
    got = vllm.features(examples)
    expected = hf.features(examples)
    for g, e in zip(got, expected, strict=True):
        for key in ("aux_hidden_states", "final_hidden_states"):
            assert g[key].shape == e[key].shape
            torch.testing.assert_close(g[key], e[key], rtol=1e-4, atol=1e-4)
    assert not list(storage.iterdir())  # every connector file read and deleted
    vllm.close()


def test_stage_starts_its_own_server_and_writes_the_shards_hf_writes(fixture_model_dir, tmp_path):
    """hidden_states.vllm_python: the stage starts a vLLM server on its first unfinished
    shard, stops it at the end (log kept, connector files removed), and writes the shards
    and index the hf backend writes."""
    examples_path = tmp_path / "examples.jsonl"
    write_examples(examples_path, 20, seed=5, max_len=80)
    config = config_for(tmp_path / "work", fixture_model_dir, aux_layer_ids=[2, 4, 5])
    config = config.model_copy(
        update={"hidden_states": config.hidden_states.model_copy(update={"shard_tokens": 256})}
    )
    vllm_config = eaglet_started(config, vllm_python())
    hf_config = config
    outputs = {}
    for name, cfg in (("vllm", vllm_config), ("hf", hf_config)):
        folder = tmp_path / name
        folder.mkdir()
        outputs[name] = stage_body(cfg, examples_path, report=lambda _: None)(folder)
    assert outputs["vllm"].info["backend"] == "vllm"
    assert outputs["vllm"].info["shards"] == outputs["hf"].info["shards"]
    assert (tmp_path / "vllm" / "vllm_server.log").stat().st_size > 0
    connector = str(tmp_path / "vllm" / "connector")
    assert not (tmp_path / "vllm" / "connector").exists()
    assert not processes_naming(connector), "the server outlived the stage"
    index = (tmp_path / "hf" / "index.jsonl").read_text()
    assert (tmp_path / "vllm" / "index.jsonl").read_text() == index
    for row in map(json.loads, index.splitlines()):
        windows = []
        for name in ("vllm", "hf"):
            with safe_open(str(tmp_path / name / row["shard"]), framework="pt") as f:
                windows.append(read_window(f, row["offset"], row["length"]))
        for key, value in windows[1].items():
            if value.is_floating_point():
                # int8 storage of the same float states: equal within one quantization step,
                # a token's absmax / 127 (a row of absmax 11 steps by 0.087)
                step = value.abs().amax(-1, keepdim=True) / 127  # [n, 1]
                assert ((windows[0][key] - value).abs() <= step * 1.001 + 1e-6).all(), key
            else:
                assert torch.equal(windows[0][key], value)


def test_the_registrys_source_gives_features_as_the_shards_hold_them(served, tmp_path):
    """The vllm backend opened from the registry, as the stage and online training open it:
    per sample (an example, or an online training window), float32 aux [n, 3H] and final
    [n, H], in the order given, whatever order the concurrent requests finish in."""
    config, _ = served
    examples = write_examples(tmp_path / "examples.jsonl", 5, seed=6)
    windows = [Window(f"{e.sample_id}[:7]", e.input_ids[:7]) for e in examples[:2]]
    source = hidden_states_backend("vllm").open(config.target, config.hidden_states, [2, 4, 5])
    done = []
    items = source.features([*examples, *windows], on_tokens=done.append)
    source.close()
    H = 128
    for item, sample in zip(items, [*examples, *windows], strict=True):
        n = len(sample.input_ids)
        assert item["aux_hidden_states"].shape == (n, 3 * H)
        assert item["final_hidden_states"].shape == (n, H)
        assert item["final_hidden_states"].dtype == torch.float32
    assert sum(done) == sum(len(s.input_ids) for s in [*examples, *windows])
    for window, item in zip(windows, items[len(examples) :], strict=True):  # a prefix's states
        whole = items[[e.sample_id for e in examples].index(window.sample_id[:-4])]
        torch.testing.assert_close(
            item["aux_hidden_states"], whole["aux_hidden_states"][:7], rtol=1e-4, atol=1e-4
        )


def test_served_online_draft_matches_colocated(served, tmp_path):
    config, storage = served
    aux = [2, 4, 5]
    examples_path = tmp_path / "examples.jsonl"
    write_examples(examples_path, 16, seed=6, max_len=80)
    train = TrainConfig(
        epochs=1, batch_size=4, draft_vocab_size=512, log_every=1, threads=1, device="cpu"
    )
    colocated = OnlineData(examples_path, config.target, aux, max_seq_len=train.max_seq_len)
    train_draft(colocated, config.target, tmp_path / "co", train, aux, AUX_LAYER_CONVENTION)

    served_data = OnlineData(
        examples_path,
        config.target,
        aux,
        max_seq_len=train.max_seq_len,
        hidden_states=config.hidden_states,  # the vllm backend, from the registry
        prefetch=2,
    )
    summary = train_draft(
        served_data, config.target, tmp_path / "served", train, aux, AUX_LAYER_CONVENTION
    )
    assert summary["steps"] == 4 and summary["hidden_states"] == "online"
    assert not list(storage.iterdir())  # nothing kept on disk beyond the queue
    a = load_file(str(tmp_path / "co" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "served" / "draft" / "model.safetensors"))
    for name in a:  # states equal within fp32 tolerance, so the weights after 4 steps too
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-3, msg=name)
