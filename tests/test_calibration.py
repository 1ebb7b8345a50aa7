"""Serving calibration's arithmetic (eaglet/draft/calibration.py): the table from served figures,
the best k per band of batch sizes (k = 0 where no k beats serving without the draft), vLLM
0.32's `num_speculative_tokens_per_batch_size`, whether a server ran the schedule, the plot.
The served runs themselves are in tests/test_serving_vllm.py."""

from __future__ import annotations

from eaglet.draft.calibration import (
    bands,
    calibration_table,
    plot_calibration,
    schedule_applied,
    schedule_to_check,
    scheduled_config,
)


def served(tokens_per_s: dict[int, float], per_draft: float | None = None) -> dict[int, dict]:
    return {
        c: {"output_tokens_per_s": t, "served_tau": 2.0, "draft_tokens_per_draft": per_draft}
        for c, t in tokens_per_s.items()
    }


# without the draft: 10 tokens/s at 1 request, 40 at 4, 100 at 16
WITHOUT = served({1: 10.0, 4: 40.0, 16: 100.0})
BY_K = {
    1: served({1: 14.0, 4: 50.0, 16: 90.0}, 1.0),  # 1.4x, 1.25x, 0.9x
    2: served({1: 18.0, 4: 44.0, 16: 80.0}, 2.0),  # 1.8x, 1.1x, 0.8x
}


def test_each_band_gets_the_k_that_was_fastest_at_its_load_and_none_where_none_wins():
    table = calibration_table(BY_K, WITHOUT)
    assert [(r["k"], r["concurrency"], round(r["speedup"], 2)) for r in table] == [
        (1, 1, 1.4), (1, 4, 1.25), (1, 16, 0.9), (2, 1, 1.8), (2, 4, 1.1), (2, 16, 0.8),
    ]  # fmt: skip
    chosen = bands(table)
    assert [(b["first_batch_size"], b["last_batch_size"], b["k"]) for b in chosen] == [
        (1, 3, 2), (4, 15, 1), (16, 256, 0),
    ]  # fmt: skip
    assert "no k beats serving without the draft" in chosen[2]["note"]
    spec = scheduled_config({"method": "eagle3", "model": "/d"}, chosen)
    assert spec["num_speculative_tokens"] == 2  # vLLM caps each band's k at it
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 3, 2], [4, 15, 1], [16, 256, 0]]


def test_the_schedule_check_reads_the_tokens_each_draft_held():
    chosen = bands(calibration_table(BY_K, WITHOUT))
    applied = schedule_applied(chosen, {1: {"draft_tokens_per_draft": 2.0},
                                        4: {"draft_tokens_per_draft": 1.0},
                                        16: {"draft_tokens_per_draft": None}})  # fmt: skip
    assert applied["verdict"].startswith("applied")
    static = schedule_applied(chosen, {c: {"draft_tokens_per_draft": 2.0} for c in (1, 4, 16)})
    assert static["verdict"].startswith("not applied: the server drafted the static k = 2")


def test_the_plot_is_written(tmp_path):
    table = calibration_table(BY_K, WITHOUT)
    path = plot_calibration(table, bands(table), tmp_path / "calibration.png")
    assert path.stat().st_size > 1000


def test_a_calibration_that_would_not_run_is_refused_not_ignored():
    """The calibration runs by default wherever a served check starts its servers; calibration:
    true or calibration_k where it would not run (no served check, a serving endpoint, no
    concurrencies, calibration: false) is an error before any stage."""
    import pytest
    from pydantic import ValidationError

    from eaglet.config import EvaluateConfig

    started = dict(serving="vllm", vllm_python="/venv/bin/python")
    assert EvaluateConfig(**started).calibrates  # by default wherever it can run
    assert not EvaluateConfig(**started, calibration=False).calibrates
    assert not EvaluateConfig(**started, speedup_concurrency=[]).calibrates  # cannot: not asked
    runs = dict(started, calibration=True)
    assert EvaluateConfig(**runs, calibration_k=[1, 2]).calibration_k == [1, 2]
    for bad in (
        dict(calibration_k=[2]),  # no served check: calibration_k would do nothing
        dict(started, calibration=False, calibration_k=[2]),
        dict(calibration=True),  # no served check at all
        dict(runs, speedup_concurrency=[]),
        dict(runs, serving_endpoint="http://127.0.0.1:8000"),
    ):
        with pytest.raises(ValidationError, match="evaluate.calibration"):
            EvaluateConfig(**bad)


def test_a_schedule_whose_bands_draft_one_k_is_not_served_to_check():
    """Every band at k = 3: the schedule is the static k, and its check could not decide;
    bands of two k, or bands of none, are checked."""
    same = [{"k": 3, "measured_at_concurrency": c} for c in (1, 4)]
    assert not schedule_to_check(same)
    assert schedule_applied(same, {})["verdict"] == "not decidable: every band chose the same k"
    assert schedule_to_check([{"k": 3}, {"k": 2}])
    assert schedule_to_check([{"k": 0}, {"k": 0}])
