"""The split planned (`eaglet.draft.split_plan`): the calibration measures each capture server
alone and one training rank of the real trainer, and the plan says what the configured
servers and ranks give, which side bounds the run and the best split of the same devices."""

from __future__ import annotations

import pytest

from eaglet.config import PipelineConfig
from eaglet.draft.split_plan import Calibration, SplitPlan, calibrate, doctor_lines
from tests.fake_servers import CaptureServer, serve


def plan(servers: int, ranks: int, server_rate: float, rank_rate: float) -> SplitPlan:
    rates = {f"http://s{i}": server_rate for i in range(servers)}
    return SplitPlan(Calibration(rates, rank_rate, 100, "cpu"), servers, ranks)


def test_the_plan_names_the_bounding_side_and_the_best_split():
    slow_capture = plan(2, 6, server_rate=10.0, rank_rate=5.0)  # 20 supplied, 30 consumed
    assert slow_capture.bound == "capture" and slow_capture.ranks_per_server == 2.0
    assert slow_capture.best_split(8) == (3, 5, 25.0)  # 3 x 10 = 30 > 5 x 5 = 25
    text = "\n".join(slow_capture.lines())
    assert "the 6 rank(s) configured need 3 server(s), the 2 configured keep 4 rank(s)" in text
    assert "bound by capture (the ranks wait for features)" in text
    assert "suggested for 8 devices: 3 server(s) + 5 rank(s), 25.0 samples/s" in text
    slow_training = plan(4, 2, server_rate=10.0, rank_rate=5.0)
    assert slow_training.bound == "training"
    assert slow_training.best_split(6) == (2, 4, 20.0)


def online_config(tmp_path, model, urls) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "work_dir": str(tmp_path / "work"),
        "target": {"model": str(model), "device": "cpu"},
        "generation": {"max_tokens": 24},
        "tokenize": {"max_prompt_tokens": 16},
        "hidden_states": {"backend": "vllm", "aux_layer_ids": [2, 4, 6], "vllm": {
            "endpoints": urls, "connector_path": str(tmp_path), "concurrency": 2}},
        "train": {"hidden_states": "online", "batch_size": 4, "threads": 1,
                  "nproc_per_node": 2, "draft_vocab_size": 256},
    })  # fmt: skip


def test_the_calibration_measures_each_server_and_a_rank(fixture_model_dir, tmp_path):
    fast, slow = CaptureServer(tmp_path), CaptureServer(tmp_path, delay_s=0.1)
    with serve(fast) as a, serve(slow) as b:
        config = online_config(tmp_path, fixture_model_dir, [a, b])
        calibration = calibrate(config)
        lines = doctor_lines(config)
    assert calibration.sample_tokens == 24 + 8
    rates = calibration.server_rates
    assert set(rates) == {a, b} and rates[a] > rates[b] > 0  # each measured alone
    assert rates[b] < 2 / 0.1 * 1.01  # two in flight, 0.1 s each, at most
    assert calibration.rank_rate > 0
    assert len(fast.served) == 1 + 3 * 2 + 1 + 3 * 2  # warm-up + 3 per slot, twice
    assert any(line.startswith(f"split: capture server {a}:") for line in lines)
    assert any("2 servers + 2 ranks" in line for line in lines)
    assert any(line.startswith("split: suggested for 4 devices") for line in lines)


@pytest.mark.parametrize("train", [{"hidden_states": "offline"}])
def test_no_split_for_a_run_without_served_features(tmp_path, fixture_model_dir, train):
    config = PipelineConfig.model_validate(
        {"work_dir": str(tmp_path), "target": {"model": str(fixture_model_dir)}, "train": train}
    )
    assert doctor_lines(config) == []
