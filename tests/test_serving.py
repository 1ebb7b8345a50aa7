"""Reading vLLM's spec-decode counters and the serving-gap check, without a server (the real
server is in tests/test_serving_vllm.py)."""

from __future__ import annotations

import pytest

from eaglet.config import ConfigError, load_config
from eaglet.draft.serving import ServingGapError, check_gap, parse_counters

# the shape of vLLM 0.32's /metrics (two engines, per-position counters, a histogram around)
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 200.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="tiny"} 100.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 600.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="tiny"} 300.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 250.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="tiny"} 50.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 150.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="tiny",position="0"} 50.0
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="tiny"} 1.7e9
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 12.0
"""


def test_counters_sum_engines_and_keep_positions():
    counters = parse_counters(METRICS)
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (300, 900, 300)
    assert counters.per_position == {0: 200, 1: 70, 2: 30}
    assert counters.tau == pytest.approx(2.0)  # 1 + accepted / drafts


def test_deltas_measure_only_what_was_sent_between_two_reads():
    before = parse_counters(METRICS)
    drafts = 'vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"}'
    after = parse_counters(
        METRICS.replace(f"{drafts} 200.0", f"{drafts} 210.0")
        .replace('model_name="tiny"} 250.0', 'model_name="tiny"} 265.0')
        .replace('position="0"} 150.0', 'position="0"} 160.0')
    )
    delta = after - before
    assert (delta.drafts, delta.accepted) == (10, 15)
    assert delta.per_position == {0: 10, 1: 0, 2: 0}
    assert delta.tau == pytest.approx(2.5)


def test_a_server_without_speculative_decoding_has_no_counters():
    assert parse_counters('vllm:request_success_total{engine="0"} 3.0\n') is None


def test_gap_above_the_limit_fails_with_both_numbers():
    served = {"tau": 1.05, "num_drafts": 300, "accepted_tokens": 15, "num_speculative_tokens": 3}
    assert check_gap(served, 1.1, 0.25, "report.json") == pytest.approx(0.05)
    with pytest.raises(ServingGapError, match=r"served tau 1\.050 .* offline tau 2\.400"):
        check_gap(served, 2.4, 0.25, "report.json")


def test_serving_vllm_needs_an_endpoint_or_a_vllm_python():
    with pytest.raises(ConfigError, match="serving_endpoint .* or .*vllm_python"):
        load_config(None, ["evaluate.serving=vllm"])
    config = load_config(None, ["evaluate.serving=vllm", "evaluate.serving_endpoint=http://h:8000"])
    assert config.evaluate.serving == "vllm"
