"""Every stage is one declaration (`eaglet.stages`) and its body runs without Prefect: the
whole pipeline through `eaglet.stage_runner` with `PlainContext`, in a process that never
imports Prefect; a second pass reuses every folder. Also what derives from the declarations:
upstreams, the flow's tasks, the CLI's choices, cache keys from the cache-neutral marks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eaglet.config import PipelineConfig
from eaglet.stages import PRODUCER, STAGE_LIST, STAGES, StageName
from tests.conftest import small_run_overrides

RUN_WITHOUT_PREFECT = r"""
import json, sys
from eaglet.config import load_config
from eaglet.stage_context import PlainContext
from eaglet.stage_runner import run_stage_body
from eaglet.stages import STAGE_LIST

config = load_config(None, json.loads(sys.argv[1]))
passes = []
for _ in range(2):
    context, outputs, manifests = PlainContext(log=lambda line: None), {}, {}
    for spec in STAGE_LIST:
        if not spec.runs(config):
            continue
        inputs = {name: outputs[name] for name in spec.inputs(config)}
        outputs[spec.output] = run_stage_body(spec.name, config, inputs, context)
        manifests[spec.name] = outputs[spec.output].model_dump()
    passes.append({"manifests": manifests, "artifacts": [
        {k: a[k] for k in ("kind", "key", "description")} for a in context.artifacts]})
print(json.dumps({"passes": passes, "prefect_imported": "prefect" in sys.modules}))
"""


@pytest.mark.slow
def test_every_stage_body_runs_without_prefect_and_a_second_pass_reuses_each_folder(
    tmp_path, fixture_model_dir, sample_data_dir
):
    overrides = small_run_overrides(tmp_path / "work", fixture_model_dir, sample_data_dir)
    out = subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_PREFECT, json.dumps(overrides)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["prefect_imported"] is False
    first, second = result["passes"]
    assert list(first["manifests"]) == list(STAGES)
    for stage, manifest in first["manifests"].items():
        assert manifest["counts"]["records"] > 0, stage
        folder = tmp_path / "work" / manifest["path"]
        for name in STAGE_LIST[STAGES.index(stage)].files[:1]:  # the records file
            assert (folder / name).is_file(), (stage, name)
    # The second pass ran no body: the same folders, manifests untouched, no artifact.
    assert second["manifests"] == first["manifests"]
    assert second["artifacts"] == []
    keys = {a["key"] for a in first["artifacts"]}
    assert {
        "data-quality",
        "data-quality-per-source",
        "generate-progress",
        "hidden-states-progress",
        "train-progress",
        "draft-training",
        "training-loss",
        "draft-evaluation",
        "acceptance-per-position",
        "acceptance-plot",
    } <= keys
    assert all(a["description"] for a in first["artifacts"])


def test_each_stage_reads_only_outputs_of_earlier_stages():
    seen: set[str] = set()
    for spec in STAGE_LIST:
        for name in spec.reads + (spec.reads_online or ()):
            assert name in seen, (spec.name, name)
        seen.add(spec.output)
    assert set(PRODUCER) == seen and len(seen) == len(STAGE_LIST)


def test_the_flow_the_cli_and_the_form_take_the_stages_from_the_declarations():
    from flows.pipeline import TASKS, pipeline

    assert tuple(TASKS) == STAGES
    assert all(TASKS[name].name == name for name in STAGES)
    assert StageName.__args__ == STAGES
    until = pipeline.parameters.properties["until"]
    assert set(json.dumps(until).split('"')) >= set(STAGES)


def test_a_cache_neutral_field_never_changes_a_key_and_a_keyed_one_does():
    from eaglet.cache import stage_config
    from eaglet.config import is_cache_neutral

    base = PipelineConfig()
    neutral = {"concurrency": 7, "endpoints": ["http://10.0.0.1:9"], "canary_requests": 2}
    for field in neutral:
        assert is_cache_neutral(type(base.generation).model_fields[field]), field
    faster = base.model_copy(update={"generation": base.generation.model_copy(update=neutral)})
    assert stage_config("generate", faster) == stage_config("generate", base)
    hotter = base.model_copy(
        update={"generation": base.generation.model_copy(update={"temperature": 0.6})}
    )
    assert stage_config("generate", hotter) != stage_config("generate", base)
    threads = base.model_copy(update={"train": base.train.model_copy(update={"threads": 1})})
    assert stage_config("train", threads) == stage_config("train", base)
    assert not is_cache_neutral(type(base.train).model_fields["epochs"])
