"""Data eaglet must never falsify: a work dir inside the target's folder keys nothing, a
duplicate record is never sealed or trained, a sampling plan's effort that a template ignores
is refused. (Deleting only what eaglet wrote: `test_security.py`, the connector cases.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eaglet.config import load_config
from eaglet.fingerprints import model_fingerprint
from eaglet.records.io import repair_jsonl
from eaglet.stage_bodies.every_stage import run_stage_without_prefect
from eaglet.stage_context import PlainContext
from eaglet.storage import SealError, StageOutput, run_stage
from eaglet.work_dir_status import inspect_work_dir

# --- a work dir inside the target's folder -------------------------------------------------------


def test_a_work_dir_inside_the_model_folder_never_changes_the_targets_fingerprint(
    tmp_path, fixture_model_dir
):
    model = tmp_path / "model"
    shutil.copytree(fixture_model_dir, model)
    before = model_fingerprint(str(model), work_dir=str(model / "run"))
    (model / "run" / "generate" / "k.partial").mkdir(parents=True)
    (model / "run" / "generate" / "k.partial" / "generations.jsonl").write_text('{"a": 1}\n')
    assert model_fingerprint(str(model), work_dir=str(model / "run")) == before
    # another work dir in there (a run with another work_dir) is known by its lock file
    (model / "older-run" / "extract").mkdir(parents=True)
    (model / "older-run" / ".eaglet.lock").write_text("")
    (model / "older-run" / "extract" / "examples.jsonl").write_text("{}\n")
    assert model_fingerprint(str(model), work_dir=str(model / "run")) == before
    # ... while the model's own files still count
    (model / "generation_config.json").write_text("{}")
    assert model_fingerprint(str(model), work_dir=str(model / "run")) != before


def test_stages_of_a_work_dir_inside_the_model_folder_are_reused(
    tmp_path, fixture_model_dir, sample_data_dir
):
    """The issue's case: every run re-tokenized (and regenerated) because the target's key
    hashed the run's own outputs. Download and tokenize twice: the second pass reuses both."""
    model = tmp_path / "model"
    shutil.copytree(fixture_model_dir, model)
    config = load_config(
        None,
        [
            f"work_dir={model / 'run'}",
            f"target.model={model}",
            f"datasets=[{{source: arith, path: {sample_data_dir / 'arith.jsonl'}, limit: 4}}]",
        ],
    )
    passes = []
    for _ in range(2):
        outputs, manifests = {}, {}
        for stage, output in (("download", "samples"), ("tokenize", "prompts")):
            inputs = {"samples": outputs["samples"]} if stage == "tokenize" else {}
            outputs[output] = run_stage_without_prefect(
                stage, config, inputs, PlainContext(lambda _: None)
            )
            manifests[stage] = outputs[output]
        passes.append(manifests)
    for stage in ("download", "tokenize"):
        assert passes[1][stage].key == passes[0][stage].key, stage
        assert passes[1][stage].finished == passes[0][stage].finished, f"{stage} ran again"


# --- duplicates are never sealed -----------------------------------------------------------------


def test_duplicate_lines_in_a_partial_generations_file_are_set_aside_on_resume(tmp_path):
    path = tmp_path / "generations.jsonl"
    lines = [{"sample_id": s, "n": i} for i, s in enumerate(["a", "b", "a", "c", "b", "a"])]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    repair = repair_jsonl(path)
    assert repair.ids == {"a", "b", "c"}
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["n"] for x in kept] == [0, 1, 3]  # the first of each id
    aside = [json.loads(x) for x in (tmp_path / "generations.rejected-lines.jsonl").open()]
    assert [x["line"] for x in aside] == [3, 5, 6]
    assert aside[0]["why"] == "sample a again (first on line 1)"


def _seal(work_dir: Path, text: str, records: int):
    def body(folder: Path) -> StageOutput:
        (folder / "generations.jsonl").write_text(text)
        return StageOutput(counts={"records": records}, info={})

    return run_stage(
        work_dir=work_dir,
        stage="generate",
        key="k1",
        code_hash="c",
        config={},
        upstream=[],
        body=body,
        records_file="generations.jsonl",
    )


def test_a_stage_whose_records_repeat_an_id_is_not_sealed(tmp_path):
    text = '{"sample_id": "a"}\n{"sample_id": "b"}\n{"sample_id": "a"}\n'
    with pytest.raises(SealError, match=r"generations\.jsonl:3: sample a again") as raised:
        _seal(tmp_path, text, records=2)
    assert "--refresh-from generate" in str(raised.value)
    assert not (tmp_path / "generate" / "k1").exists()
    assert (tmp_path / "generate" / "k1.partial" / "generations.jsonl").read_text() == text


def test_a_stage_whose_count_differs_from_its_records_is_not_sealed(tmp_path):
    with pytest.raises(SealError, match="2 records, the manifest counts 3"):
        _seal(tmp_path, '{"sample_id": "a"}\n{"sample_id": "b"}\n', records=3)


def test_inspect_verify_finds_a_duplicate_record_in_a_sealed_folder(tmp_path):
    _seal(tmp_path, '{"sample_id": "a"}\n{"sample_id": "b"}\n', records=2)
    folder = tmp_path / "generate" / "k1"
    manifest = json.loads((folder / "manifest.json").read_text())
    path = folder / "generations.jsonl"
    path.write_text('{"sample_id": "a"}\n{"sample_id": "a"}\n')  # same size, other ids
    # the hash would catch this edit; a manifest sealed over it (older eaglet) would not
    manifest["files"]["generations.jsonl"]["sha256"] = (
        __import__("hashlib").sha256(path.read_bytes()).hexdigest()
    )
    manifest.pop("checksum")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    status = inspect_work_dir(tmp_path, "full")["stages"]["generate"]
    assert status["status"] == "corrupt"
    assert any("generations.jsonl:2: sample a again" in p for p in status["problems"])


# --- a sampling plan's effort that the template never reads -------------------------------------


def test_a_plan_effort_on_a_template_that_never_reads_it_is_refused(fixture_model_dir):
    from eaglet.preflight import preflight

    config = load_config(
        None,
        [
            f"target.model={fixture_model_dir}",
            "generation.sampling_plan=[{temperature: 0.6, reasoning_effort: high}, "
            "{temperature: 0.6, reasoning_effort: low}]",
        ],
    )
    problems = preflight(config).problems
    [problem] = [p for p in problems if p.startswith("generation.sampling_plan")]
    assert "never reads reasoning_effort" in problem and "(reasoning_effort high, low)" in problem


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("Reasoning: {{ reasoning_effort }}\n{{ messages[0].content }}", None),
        (
            "{% if reasoning_effort %}{% endif %}{{ messages[0].content }}",
            "renders the same prompt for reasoning_effort high and low",
        ),
    ],
)
def test_a_plan_effort_must_change_the_rendered_prompt(fixture_model_dir, template, problem):
    from transformers import AutoTokenizer

    from eaglet.preflight import PreflightReport, check_template

    tokenizer = AutoTokenizer.from_pretrained(fixture_model_dir)
    tokenizer.chat_template = template
    config = load_config(
        None,
        ["generation.sampling_plan=[{reasoning_effort: high}, {reasoning_effort: low}]"],
    )
    report = PreflightReport()
    check_template(config, tokenizer, report)
    found = [p for p in report.problems if p.startswith("generation.sampling_plan")]
    if problem is None:
        assert not found
    else:
        assert len(found) == 1 and problem in found[0]


# --- recovery that recovers ----------------------------------------------------------------------


def test_a_checkpoint_cut_in_half_names_its_folder_and_the_command_that_recovers(tmp_path):
    import torch

    from eaglet.draft.train import DamagedCheckpointError, resume_from
    from eaglet.errors import is_transient

    out = tmp_path / "train" / "k1.partial"
    (out / "state").mkdir(parents=True)
    (out / "state" / "state.json").write_text('{"step": 3}')
    (out / "state" / "model.safetensors").write_bytes(b'\x40\x00\x00\x00\x00\x00\x00\x00{"a')
    with pytest.raises(DamagedCheckpointError) as raised:
        resume_from(out, torch.nn.Linear(1, 1), None, "fingerprint", rank=0, total_steps=10)
    message = str(raised.value)
    assert str(tmp_path / "train" / "k1" / "state") in message
    assert "--refresh-from train" in message and not is_transient(raised.value)


def test_refresh_starts_a_stage_over_whatever_its_partial_folder_holds(tmp_path):
    partial = tmp_path / "train" / "k1.partial"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "model.safetensors").write_bytes(b"half a checkpoint")
    seen = []

    def body(folder: Path) -> StageOutput:
        seen.append(sorted(p.name for p in folder.rglob("*")))
        (folder / "done").write_text("1")
        return StageOutput(counts={}, info={})

    def run(refresh: bool):
        return run_stage(
            work_dir=tmp_path, stage="train", key="k1", code_hash="c", config={}, upstream=[],
            body=body, resume_partial=True, refresh=refresh,
        )  # fmt: skip

    run(refresh=True)
    assert seen == [[]]  # a fresh folder: the damaged checkpoint was not handed to the body
    [aside] = [p for p in (tmp_path / "train").iterdir() if "replaced-partial" in p.name]
    assert (aside / "state" / "model.safetensors").read_bytes() == b"half a checkpoint"
