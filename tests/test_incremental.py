"""An incremental run equals a fresh run: after any change, the stages a work dir runs again
(reusing what it can) write the same bytes as a fresh work dir given the final state. Held by
a sampled sample's tokens being a function of (seed, sample id) alone, not of its batch
(`eaglet.engines.local`), a stage's record file in one order whatever was reused or finished
first (`eaglet.records.io.sort_jsonl`), and output hashes over what later stages read."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from eaglet import cache
from eaglet.config import TargetConfig
from eaglet.engines.base import SamplingParams
from eaglet.engines.local import LocalEngine
from eaglet.records.io import sort_jsonl
from eaglet.stages import REPORT_FILE, STAGES
from eaglet.storage import Manifest
from eaglet.target import load_tokenizer
from tests.engine_helpers import fixture_prompts
from tests.pipeline_helpers import run_every_stage, small_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_sampled_answer_is_the_same_in_any_batch_and_alone(fixture_model_dir):
    target = TargetConfig(model=str(fixture_model_dir))
    prompts = fixture_prompts(load_tokenizer(target), 6)
    params = SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=3)

    def answers(batch_size: int, chosen=prompts) -> dict[str, list[int]]:
        engine = LocalEngine(target, params, batch_size)
        return {g.sample_id: g.output_ids for g in engine.generate(chosen)}

    by_four = answers(4)
    assert answers(1) == by_four == answers(6)
    assert answers(1, prompts[2:3]) == {prompts[2].sample_id: by_four[prompts[2].sample_id]}
    other_seed = LocalEngine(target, SamplingParams(24, 0.7, 0.9, seed=4), 4)
    assert {g.sample_id: g.output_ids for g in other_seed.generate(prompts)} != by_four


def test_a_record_file_is_sorted_by_rank_keeping_each_lines_bytes(tmp_path):
    path = tmp_path / "generations.jsonl"
    lines = [json.dumps({"sample_id": i, "x": " " * n}) + "\n" for n, i in enumerate("cab")]
    path.write_text("".join(lines))
    order = {"a": 0, "b": 1, "c": 2}
    assert sort_jsonl(path, lambda sample_id: (order[sample_id],))
    assert path.read_text() == lines[1] + lines[2] + lines[0]
    stamp = path.stat().st_mtime_ns
    assert not sort_jsonl(path, lambda sample_id: (order[sample_id],))  # in order: untouched
    assert path.stat().st_mtime_ns == stamp
    (tmp_path / f".{path.name}.123.sorting").write_text("a copy cut short")
    sort_jsonl(path, lambda sample_id: (order[sample_id],))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


# The probe's classes of change (issue 46). Each takes (state, rng) and changes the state.
def edit_a_row(state: dict, rng: random.Random) -> str:
    path = state["data"] / "arith.jsonl"
    rows = path.read_text().splitlines()
    index = rng.randrange(min(len(rows), 8))
    row = json.loads(rows[index])
    for message in row.get("messages", row.get("conversations", [])):
        key = "content" if "content" in message else "value"
        if message.get("role", message.get("from")) in ("user", "human"):
            message[key] += f" (edited {rng.randrange(1000)})"
            break
    rows[index] = json.dumps(row)
    path.write_text("\n".join(rows) + "\n")
    return f"row {index} of arith.jsonl edited"


def edit_the_template(state: dict, rng: random.Random) -> str:
    path = state["target"] / "chat_template.jinja"
    text = path.read_text()
    if rng.random() < 0.5:  # renders the same: tokenize writes the same prompts
        path.write_text(text + "{# a comment #}\n")
        return "a comment added to the template"
    path.write_text(text.replace("You may call one or more functions", "You may call functions"))
    return "the tools' preamble of the template reworded (tool prompts change)"


def change_batch_size(state: dict, rng: random.Random) -> str:
    size = rng.choice([1, 2, 3, 8])
    state["overrides"]["generation.batch_size"] = size
    return f"generation.batch_size={size} (cache-neutral)"


def change_a_keyed_setting(state: dict, rng: random.Random) -> str:
    lr = rng.choice([0.001, 0.002, 0.004])
    state["overrides"]["train.lr"] = lr
    return f"train.lr={lr}"


def edit_code_keeping_output(state: dict, rng: random.Random) -> str:
    module = rng.choice(["eaglet.extract", "eaglet.hidden_states.stage", "eaglet.draft.train"])
    state["edited"][module] = f"edited-{rng.randrange(10**6)}"
    return f"{module} edited without changing what it writes"


CHANGES = [edit_a_row, edit_the_template, change_batch_size, change_a_keyed_setting]
CHANGES.append(edit_code_keeping_output)


def run_with(state: dict, work_dir: Path, monkeypatch) -> dict[str, Manifest]:
    """Every stage of the small pipeline on `state`, its code edits in place."""
    real_hash = cache.module_source_hash
    edited = dict(state["edited"])
    monkeypatch.setattr(
        cache, "module_source_hash",
        lambda module, root=cache.ROOT: edited.get(module) or real_hash(module, root),
    )  # fmt: skip
    overrides = [f"{key}={value}" for key, value in state["overrides"].items()]
    return run_every_stage(small_pipeline(work_dir, state["target"], state["data"], *overrides))


def figures(work_dir: Path, manifest: Manifest) -> dict:
    def without_timings(value):
        if isinstance(value, dict):
            return {
                k: without_timings(v) for k, v in value.items() if k not in ("seconds", "draft_dir")
            }
        return [without_timings(v) for v in value] if isinstance(value, list) else value

    return without_timings(json.loads((work_dir / manifest.path / REPORT_FILE).read_text()))


@pytest.mark.slow
def test_after_random_changes_an_incremental_run_writes_what_a_fresh_run_writes(
    tmp_path, fixture_model_dir, sample_data_dir, monkeypatch
):
    rng = random.Random(46)
    state = {
        "target": tmp_path / "target",
        "data": tmp_path / "data",
        "overrides": {},
        "edited": {},
    }
    shutil.copytree(fixture_model_dir, state["target"])
    shutil.copytree(sample_data_dir, state["data"])
    work = tmp_path / "incremental"
    run_with(state, work, monkeypatch)
    reused = 0
    for step, change in enumerate(rng.sample(CHANGES, len(CHANGES))):  # each, in a random order
        said = change(state, rng)
        incremental = run_with(state, work, monkeypatch)
        fresh = run_with(state, tmp_path / f"fresh-{step}", monkeypatch)
        differ = [
            stage
            for stage in incremental
            if incremental[stage].output_hash() != fresh[stage].output_hash()
            and stage != STAGES[-1]
        ]
        assert differ == [], f"after {said}: {differ} differ from a fresh run"
        keys = {stage: (incremental[stage].key, fresh[stage].key) for stage in incremental}
        assert all(a == b for a, b in keys.values()), (said, keys)  # every stage keyed alike
        # the report: every figure (not the seconds it took, nor the draft's absolute path)
        assert figures(work, incremental[STAGES[-1]]) == figures(
            tmp_path / f"fresh-{step}", fresh[STAGES[-1]]
        ), said
        reused += incremental["generate"].info.get("reused", 0)
    assert reused > 0  # some change made generate reuse records: reuse was exercised
