"""Offline evaluation: the KV-cache path gives exactly what the full-recompute path gives, tau is
reported for every k, and a trained draft is evaluated from its folder alone, in every export.

Uses the trained draft of tests/train_helpers.py's world (a tiny target whose greedy continuation
a draft learns in seconds, trained with the convention label the pipeline writes)."""

from __future__ import annotations

import pytest

from eaglet.config import TargetConfig
from eaglet.draft.evaluate import evaluate_draft, greedy_generate, load_target, speculative_generate
from eaglet.draft.methods.eagle3_checkpoint import load_draft
from eaglet.draft.methods.eagle3_exports import SGLANG_FOLDER, SPECULATORS_FOLDER, write_exports
from eaglet.draft.rejection import Sampling
from tests.train_helpers import AUX_IDS, random_prompts

# the trained draft and its target, built once for this module by the fixtures `world` and
# `trained` (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


def test_kv_cache_path_equals_full_recompute(trained, world):
    draft, _ = load_draft(world / "run" / "draft")
    target = load_target(world / "target", device="cpu")
    embed = target.get_input_embeddings().weight
    rounds_seen = []
    for prompt in random_prompts(4, seed=5):
        plain = greedy_generate(target, prompt, 40, set(), use_cache=False)
        assert greedy_generate(target, prompt, 40, set(), use_cache=True) == plain
        for k in (1, 3, 5):
            args = (target, draft, embed, prompt, k, 40, set(), AUX_IDS)
            cached = speculative_generate(*args, use_cache=True)
            full = speculative_generate(*args, use_cache=False)
            assert cached == full, (prompt, k)
            assert cached[0] == plain
            rounds_seen += cached[1]
    # both accepted and rejected drafts happened, so cache roll-back was exercised
    assert max(rounds_seen) >= 3 and min(rounds_seen) < 3


def test_no_round_runs_once_the_targets_own_token_stops_the_output(trained, world):
    """vLLM runs no verification round after the token that ends a request (a stop token, or
    the max_tokens-th token), even when the target chose it alone: the evaluator neither."""
    draft, _ = load_draft(world / "run" / "draft")
    target = load_target(world / "target", device="cpu")
    embed = target.get_input_embeddings().weight
    for prompt in random_prompts(3, seed=5):
        plain = greedy_generate(target, prompt, 12, set())
        args = (target, draft, embed, prompt, 3)
        # the target's first token is the stop: the prefill emits it, no round follows
        assert speculative_generate(*args, 12, {plain[0]}, AUX_IDS)[:2] == ([plain[0]], [])
        # one token asked for: the prefill's
        assert speculative_generate(*args, 1, set(), AUX_IDS)[:2] == ([plain[0]], [])
        # a stop that is some round's bonus token (the target's, not a draft's) ends the output
        # there: no round after it, so every round but the last emits its n + 1 tokens
        stop = plain[5]
        out, rounds, _ = speculative_generate(*args, 12, {stop}, AUX_IDS)
        assert out == plain[: plain.index(stop) + 1]
        assert sum(n + 1 for n in rounds[:-1]) < len(out) - 1 <= sum(n + 1 for n in rounds)


def test_emitted_tau_leaves_out_the_drafts_accepted_past_the_stop(trained, world):
    """tau credits a last round's drafts past the stop, as vLLM's counters do; emitted_tau is
    the output tokens per round (the prefill's first token apart)."""
    prompts = random_prompts(4, seed=99)
    report = evaluate_draft(
        world / "run" / "draft", world / "target", prompts, num_speculative_tokens=4,
        max_new_tokens=10, untrained_seed=None, device="cpu",
    )  # fmt: skip
    assert report["new_tokens"] == 4 * 10
    assert report["emitted_tau"] == pytest.approx((4 * 10 - 4) / report["num_rounds"])
    # the 10th token cuts the last round of each prompt short: tau counts its whole n + 1
    assert report["emitted_tau"] < report["tau"]


def test_pipeline_draft_evaluates_from_its_folder_alone_in_every_export(trained, world):
    """No layer ids passed: they come from each export's config and its convention label."""
    draft_dir = world / "run" / "draft"
    write_exports(draft_dir, TargetConfig(model=str(world / "target")), num_speculative_tokens=4)
    prompts = random_prompts(3, seed=99)  # the prompts test_train_eval evaluates on
    reports = {
        name: evaluate_draft(
            world / "run" / name,
            world / "target",
            prompts,
            num_speculative_tokens=3,
            max_new_tokens=24,
            untrained_seed=None,
            device="cpu",
            every_k=True,
        )
        for name in ("draft", SGLANG_FOLDER, SPECULATORS_FOLDER)
    }
    vllm = reports["draft"]
    assert vllm["aux_layer_ids"] == AUX_IDS and vllm["outputs_match_greedy"]
    assert vllm["tau"] > 2.5
    assert set(vllm["tau_by_k"]) == {"1", "2", "3"} and vllm["tau_by_k"]["3"] == vllm["tau"]
    assert 1.0 <= vllm["tau_by_k"]["1"] <= 2.0 < vllm["tau_by_k"]["2"] < vllm["tau"]
    for name, report in reports.items():
        for key in ("tau", "tau_by_k", "aux_layer_ids", "accepted_tokens", "num_rounds"):
            assert report[key] == vllm[key], (name, key)


def test_cached_and_uncached_reports_match(trained, world):
    args = (world / "run" / "draft", world / "target", random_prompts(2, seed=3))
    kwargs = dict(num_speculative_tokens=4, max_new_tokens=24, device="cpu")
    cached = evaluate_draft(*args, **kwargs, use_cache=True)
    full = evaluate_draft(*args, **kwargs, use_cache=False)
    for key in ("tau", "num_rounds", "accepted_tokens", "per_position_acceptance"):
        assert cached[key] == pytest.approx(full[key], abs=0), key
        assert cached["untrained"][key] == pytest.approx(full["untrained"][key], abs=0), key


def test_progress_counts_every_pass_to_its_total_with_an_eta(trained, world):
    updates = []
    prompts = random_prompts(3, seed=5)
    report = evaluate_draft(
        world / "run" / "draft", world / "target", prompts, num_speculative_tokens=3,
        max_new_tokens=16, device="cpu", every_k=True, progress=updates.append,
    )  # fmt: skip
    # references, k=3, k=1, k=2, untrained: five passes over three prompts
    assert [u["done"] for u in updates] == list(range(1, 16))
    assert {u["total"] for u in updates} == {15} and updates[-1]["eta_s"] == 0
    passes = list(dict.fromkeys(u["pass"] for u in updates))
    assert passes == [
        "greedy references", "draft at k=3", "draft at k=1", "draft at k=2", "untrained draft"
    ]  # fmt: skip
    assert updates[5]["tau"] == pytest.approx(report["tau"])  # the k=3 pass's last prompt


def test_the_untrained_drafts_pass_runs_once_per_shape_target_and_prompts(trained, world, tmp_path):
    """Issue 47: every evaluate scored the untrained draft again, most of its time. With a
    cache folder its pass runs once; a second evaluation of a draft of the same shape reads it
    back (one pass fewer) and reports the same figures; other prompts score it again."""
    args = (world / "run" / "draft", world / "target")
    kwargs = dict(num_speculative_tokens=3, max_new_tokens=16, device="cpu")
    prompts = random_prompts(2, seed=11)
    cache = tmp_path / "untrained"
    runs = []
    for _ in range(2):
        updates = []
        report = evaluate_draft(
            *args, prompts, **kwargs, untrained_cache=cache, progress=updates.append
        )
        runs.append((report, [u["pass"] for u in updates]))
    (first, first_passes), (second, second_passes) = runs
    assert "untrained draft" in first_passes and "untrained draft" not in second_passes
    assert second["untrained"] == first["untrained"] and len(list(cache.iterdir())) == 1
    uncached = evaluate_draft(*args, prompts, **kwargs)
    assert uncached["untrained"]["tau"] == first["untrained"]["tau"]
    evaluate_draft(*args, random_prompts(2, seed=12), **kwargs, untrained_cache=cache)
    assert len(list(cache.iterdir())) == 2  # other prompts: another pass, kept beside


def test_sampling_at_a_vanishing_temperature_is_greedy_and_at_one_accepts_less(trained, world):
    """Sampled at T -> 0 the target's draws are its argmax: the same rounds as greedy. At T = 1
    a draft trained on greedy answers is accepted less; the realised and the expected accepted
    counts agree, and a seed repeats its draws."""
    args = (world / "run" / "draft", world / "target", random_prompts(4, seed=7))
    kwargs = dict(num_speculative_tokens=3, max_new_tokens=32, device="cpu", untrained_seed=None)
    cold = evaluate_draft(*args, **kwargs, sampling=Sampling(1e-4))
    sampled = cold["sampled"]
    for key in ("tau", "num_rounds", "new_tokens", "per_position_acceptance"):
        assert sampled[key] == cold[key], key
    assert sampled["expected_tau"] == pytest.approx(cold["tau"], abs=1e-3)
    assert sampled["outputs_match_greedy"] is None and cold["outputs_match_greedy"]
    assert sampled["temperature"] == 1e-4 and "rejection sampling" in sampled["draft_sampling"]

    warm = evaluate_draft(*args, **kwargs, sampling=Sampling(1.0), sampling_seed=1)["sampled"]
    print(f"greedy {cold['tau']:.3f}; T=1 {warm['tau']:.3f} (expected {warm['expected_tau']:.3f})")
    assert 1.0 <= warm["tau"] < cold["tau"]
    assert warm["tau"] == pytest.approx(warm["expected_tau"], abs=0.3)
    again = evaluate_draft(*args, **kwargs, sampling=Sampling(1.0), sampling_seed=1)["sampled"]
    assert again["tau"] == warm["tau"] and again["new_tokens"] == warm["new_tokens"]
