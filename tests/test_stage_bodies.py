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
from tests.conftest import ROOT, run_cli, small_run_overrides

RUN_WITHOUT_PREFECT = r"""
import json, sys
from eaglet.config import load_config
from eaglet.stage_context import PlainContext
from eaglet.stage_bodies.every_stage import run_stage_without_prefect
from eaglet.stages import STAGE_LIST

config = load_config(None, json.loads(sys.argv[1]))
passes = []
for _ in range(2):
    context, outputs, manifests = PlainContext(log=lambda line: None), {}, {}
    for spec in STAGE_LIST:
        if not spec.runs(config):
            continue
        inputs = {name: outputs[name] for name in spec.inputs(config)}
        outputs[spec.output] = run_stage_without_prefect(spec.name, config, inputs, context)
        manifests[spec.name] = outputs[spec.output].model_dump()
    passes.append({"manifests": manifests, "artifacts": [
        {k: a[k] for k in ("kind", "key", "description")}
        | ({"content": a["content"]} if a["kind"] == "markdown" else {})
        for a in context.artifacts]})
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
    # issue 38: a table of figures a person reads, not a dict dump of 15-digit floats
    training = next(a for a in first["artifacts"] if a["key"] == "draft-training")["content"]
    assert training.startswith("# Draft training\n\n| figure | value |"), training[:200]
    values = [line.split("|")[2].strip() for line in training.splitlines()[4:] if "|" in line]
    decimals = [v.split(".")[1] for v in values if v.replace(".", "", 1).isdigit() and "." in v]
    assert decimals and all(len(d) <= 3 for d in decimals), values


def test_each_stage_reads_only_outputs_of_earlier_stages():
    seen: set[str] = set()
    for spec in STAGE_LIST:
        for name in spec.reads + (spec.reads_online or ()):
            assert name in seen, (spec.name, name)
        seen.add(spec.output)
    assert set(PRODUCER) == seen and len(seen) == len(STAGE_LIST)


def test_the_flow_the_cli_and_the_form_take_the_stages_from_the_declarations():
    from eaglet_prefect.flows.pipeline import TASKS, pipeline

    assert tuple(TASKS) == STAGES
    assert all(TASKS[name].name == name for name in STAGES)
    assert StageName.__args__ == STAGES
    until = pipeline.parameters.properties["until"]
    assert set(json.dumps(until).split('"')) >= set(STAGES)


def test_the_flow_refuses_a_task_list_that_is_not_the_stage_list():
    """A stage without its task, or a task listed twice, is refused; the order is the stage
    list's, written once (`eaglet.stages.STAGE_LIST`), whatever order the tasks are listed in."""
    from eaglet_prefect.flows.pipeline import TASKS, task_of_each_stage

    tasks = list(TASKS.values())
    assert task_of_each_stage(*tasks) == TASKS
    reordered = task_of_each_stage(*(tasks[1:2] + tasks[:1] + tasks[2:]))
    assert list(reordered) == list(STAGES) == list(TASKS)
    for wrong in (tasks[:-1], tasks + tasks[:1]):
        with pytest.raises(ValueError, match="import each stage's task"):
            task_of_each_stage(*wrong)


def test_each_body_is_keyed_with_its_stage_and_another_stages_body_is_refused(tmp_path):
    """Flow → task → body are imports: each stage's body (the one its task module imports, and
    `every_stage`'s) is in the stage's code key, in no other stage's, and `run_stage_body`
    refuses a body its stage's key does not cover before it runs anything."""
    from eaglet.cache import stage_modules
    from eaglet.config import load_config
    from eaglet.stage_bodies.every_stage import BODIES
    from eaglet.stage_context import PlainContext
    from eaglet.stage_runner import run_stage_body
    from eaglet_prefect.flows.pipeline import TASKS

    assert tuple(BODIES) == STAGES
    config = load_config(None, [f"work_dir={tmp_path / 'work'}"])
    for stage in STAGES:
        task_globals = TASKS[stage].fn.__globals__
        assert BODIES[stage] in [getattr(v, "run", None) for v in task_globals.values()], stage
        keyed = [other for other in STAGES if BODIES[stage].__module__ in stage_modules(other)]
        assert keyed == [stage], stage
    assert "eaglet.stage_bodies.every_stage" not in {
        module for stage in STAGES for module in stage_modules(stage, config)
    }
    with pytest.raises(ValueError, match="is not part of the stage's code key"):
        run_stage_body("tokenize", BODIES["download"], config, {}, PlainContext())
    assert not (tmp_path / "work").exists()  # refused before anything was written


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


WORD_COUNT_STAGE = """    Stage(
        name="word_count",
        output="word_counts",
        reads=("samples",),
        files=("word_counts.jsonl",),
        keyed_by=("datasets",),
    ),
"""

WORD_COUNT_BODY = '''"""A throwaway stage: the words of each sample's messages."""

import json

from eaglet.stages import SAMPLES_FILE
from eaglet.storage import StageOutput, stage_dir


def run(ctx, config, inputs, folder):
    rows = 0
    source = stage_dir(config.work_dir, inputs["samples"]) / SAMPLES_FILE
    with open(source) as samples, open(folder / "word_counts.jsonl", "w") as out:
        for line in samples:
            sample = json.loads(line)
            words = sum(len(str(m.get("content") or "").split()) for m in sample["messages"])
            out.write(json.dumps({"sample_id": sample["sample_id"], "words": words}) + "\\n")
            rows += 1
    ctx.info(f"word_count: {rows} samples counted")
    return StageOutput(counts={"records": rows}, info={})
'''

WORD_COUNT_TASK = '''"""The word_count stage as a Prefect task."""

from eaglet.stage_bodies import word_count as word_count_body
from eaglet_prefect.tasks.caching import run_stage_task, stage_task


@stage_task("word_count")
def word_count(config, samples: dict, refresh: bool = False) -> dict:
    body = word_count_body.run
    return run_stage_task("word_count", body, config, {"samples": samples}, refresh=refresh)
'''


@pytest.mark.slow
def test_a_new_stage_is_its_declaration_and_its_own_modules(
    tmp_path, fixture_model_dir, sample_data_dir
):
    """Adding a stage, in a copy of the project: one entry in the stage list, its body, its
    task, and the task imported and listed in the flow, nothing else edited; it runs in the
    flow, is keyed (its body with it), and shows in inspect."""
    from tests.pipeline_helpers import copy_project, stage_states

    project = copy_project(tmp_path / "project")
    stages_py = project / "eaglet" / "stages.py"
    anchor = '        keyed_by=("datasets",),\n    ),\n'
    assert stages_py.read_text().count(anchor) == 1
    stages_py.write_text(stages_py.read_text().replace(anchor, anchor + WORD_COUNT_STAGE))
    (project / "eaglet" / "stage_bodies" / "word_count.py").write_text(WORD_COUNT_BODY)
    (project / "tasks" / "word_count.py").write_text(WORD_COUNT_TASK)
    flow_py = project / "flows" / "pipeline.py"
    listed = "TASKS = task_of_each_stage(download, tokenize,"
    imported = "from eaglet_prefect.tasks.train import train\n"
    assert flow_py.read_text().count(listed) == 1 and flow_py.read_text().count(imported) == 1
    flow_py.write_text(
        flow_py.read_text()
        .replace(listed, "TASKS = task_of_each_stage(download, word_count, tokenize,")
        .replace(imported, imported + "from eaglet_prefect.tasks.word_count import word_count\n")
    )

    work_dir = tmp_path / "work"
    overrides = small_run_overrides(work_dir, fixture_model_dir, sample_data_dir)
    args = ["run", "/dev/null", "--until", "word_count"]
    args += [item for o in overrides for item in ("--set", o)]
    first = run_cli(args, cwd=project)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert stage_states(work_dir) == {"download": "Completed", "word_count": "Completed"}
    (downloaded,) = (work_dir / "download").glob("*/manifest.json")
    samples = json.loads(downloaded.read_text())["counts"]["records"]
    assert samples > 0
    (folder,) = (work_dir / "word_count").glob("*/manifest.json")
    manifest = json.loads(folder.read_text())
    assert manifest["counts"]["records"] == samples
    assert "datasets" in manifest["config"]  # keyed by what it declared
    assert "eaglet.stage_bodies.word_count" in manifest["code_modules"]  # and by its body
    assert len((folder.parent / "word_counts.jsonl").read_text().splitlines()) == samples

    second = run_cli(args, cwd=project)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert stage_states(work_dir) == {"download": "Cached", "word_count": "Cached"}

    inspected = run_cli(["inspect", str(work_dir), "--json"], cwd=project)
    assert inspected.returncode == 0, inspected.stderr[-3000:]
    status = json.loads(inspected.stdout)["stages"]
    assert list(status)[:2] == ["download", "word_count"]
    assert status["word_count"]["records"] == samples, status["word_count"]


def test_the_readmes_pipeline_picture_is_drawn_from_the_stage_list():
    from eaglet.pipeline_picture import draw

    picture = draw()
    assert all(f">{stage}</text>" in picture for stage in STAGES)
    assert (ROOT / "docs" / "pipeline.svg").read_text() == picture, (
        "docs/pipeline.svg differs from the stage list: python -m eaglet.pipeline_picture "
        "docs/pipeline.svg"
    )
