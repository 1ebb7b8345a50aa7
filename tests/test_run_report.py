"""The run report, without Prefect: built from `run.json` and the stage manifests, it says per
stage Cached or ran, records, seconds, key figures and folder; after a failure it marks the
stage, quotes its error, describes the partial folder and gives the command that resumes."""

from __future__ import annotations

import json
import os
from pathlib import Path

from eaglet.config import load_config
from eaglet.report_figures import training_line
from eaglet.run_report import (
    describe_partial,
    failure_entry,
    failure_note,
    read_run_record,
    render_run_report,
    resume_command,
    start_run_record,
    write_run_record,
    write_run_report,
)
from eaglet.storage import StageOutput, run_stage

FIGURES = {
    "download": StageOutput({"records": 24, "duplicates": 2}, {"per_source": {"arith": 16}}),
    "tokenize": StageOutput({"records": 24, "rejected": 1, "too_long": 0}, {}),
    "generate": StageOutput(
        {"records": 24, "failed": 3, "truncated": 6}, {"engine": "vllm", "written": 24}
    ),
    "extract": StageOutput(
        {"records": 24},
        {
            "quality": {
                "reasoning_format": "qwen3",
                "reasoning_capture_rate": 0.875,
                "truncation_rate": 0.25,
            }
        },
    ),
    "hidden_states": StageOutput({"records": 24, "tokens": 4096}, {}),
    "train": StageOutput(
        {"records": 19},
        {
            "final_loss": 2.5,
            "initial_loss": 6.25,
            "steps": 12,
            "hidden_states_mode": "online",
            "feature_bytes_stored": 0,
            "feature_bytes_saved": 3 << 20,
            "feature_bytes_saved_storage": "int8",
        },
    ),
    "evaluate": StageOutput(
        {"records": 2},
        {
            "tau": 2.25,
            "untrained_tau": 1.0,
            "sampled": {
                "temperature": 0.6,
                "top_p": 0.95,
                "tau": 1.875,
                "expected_tau": 1.9,
                "emitted_tau": 1.8,
                "num_rounds": 40,
                "draft_sampling": "greedy draft",
            },
        },
    ),
}


def finished_stage(work_dir: Path, stage: str, state: str) -> dict:
    """A real stage folder with a manifest, and the run.json entry the flow writes for it."""
    manifest = run_stage(
        work_dir=work_dir,
        stage=stage,
        key=f"{stage}-key",
        code_hash="c",
        config={},
        upstream=[],
        body=lambda folder: FIGURES[stage],
    )
    return {
        "state": state,
        "key": manifest.key,
        "path": manifest.path,
        "records": manifest.counts["records"],
        "seconds": 1.25,
    }


def config_for(work_dir: Path):
    return load_config(None, [f"work_dir={work_dir}", "name=arith"])


def table_row(report: str, stage: str) -> list[str]:
    row = next(line for line in report.splitlines() if line.startswith(f"| {stage} |"))
    return [cell.strip() for cell in row.strip("|").split("|")]


def figures(report: str, stage: str) -> str:
    """The stage's key figures, listed below the table."""
    return next(line for line in report.splitlines() if line.startswith(f"- **{stage}**: "))


def test_report_of_a_finished_run_gives_state_records_seconds_figures_and_folder(tmp_path):
    work_dir = tmp_path / "work"
    run = start_run_record(config_for(work_dir), None, "evaluate", None)
    for stage in ("download", "tokenize", "generate"):
        run["stages"][stage] = finished_stage(work_dir, stage, "Cached")
    for stage in ("extract", "hidden_states", "train", "evaluate"):
        run["stages"][stage] = finished_stage(work_dir, stage, "Completed")
    write_run_record(work_dir, run)

    report = write_run_report(work_dir)

    assert (work_dir / "run_report.md").read_text() == report
    assert report.startswith("# Run report: arith")
    assert "Run completed" in report
    generate = table_row(report, "generate")
    assert generate[:4] == ["generate", "Cached", "24", "1.2"]
    assert len(generate) == 5  # figures are listed below the table: a wide cell was clipped
    assert "3 failed samples" in figures(report, "generate")
    assert "6 truncated (25.0%)" in figures(report, "generate")
    assert generate[4] == "`generate/generate-key`"  # in the work dir, named in the header
    assert f"Work dir: `{work_dir.resolve()}`" in report
    assert table_row(report, "extract")[1] == "Completed"
    assert "reasoning captured 87.5%" in figures(report, "extract")
    assert "final loss 2.5000 (first 6.2500)" in figures(report, "train")
    assert "online hidden states, 0 B stored (3.0 MiB of int8 shards saved)" in report
    assert "τ 2.250 (eagle3) trained vs 1.000 untrained" in figures(report, "evaluate")
    assert "sampled at T=0.6, top_p 0.95: τ 1.875 (expected 1.900, 40 rounds)" in figures(
        report, "evaluate"
    )
    assert "2 duplicates dropped" in figures(report, "download")
    assert "failed" not in report.split("\n", 3)[2]  # the summary line


def test_report_after_a_failure_marks_the_stage_and_says_how_to_resume(tmp_path):
    work_dir = tmp_path / "work"
    config_file = tmp_path / "arith.yaml"
    run = start_run_record(config_for(work_dir), str(config_file), "train", None)
    for stage in ("download", "tokenize"):
        run["stages"][stage] = finished_stage(work_dir, stage, "Completed")
    partial = work_dir / "generate" / "k1.partial"
    partial.mkdir(parents=True)
    (partial / "generations.jsonl").write_text('{"sample_id": "a"}\n{"sample_id": "b"}\n')
    (partial / "failed.jsonl").write_text(
        '{"sample_id": "s-400", "message": "bad request"}\n{"sample_id": "s-'
    )  # a torn last line, as a killed run leaves it
    run["stages"]["generate"] = failure_entry(
        "k1", partial, "TooManyFailuresError: 1 of 3 samples failed", 4.0
    )
    write_run_record(work_dir, run)

    report = write_run_report(work_dir)

    assert "Run **failed** at `generate`" in report
    assert table_row(report, "generate")[:2] == ["generate", "Failed"]
    assert table_row(report, "generate")[4] == "`generate/k1.partial`"
    assert table_row(report, "extract")[1] == "not run"
    assert table_row(report, "evaluate")[1] == "not requested"
    assert "TooManyFailuresError: 1 of 3 samples failed" in report
    assert f"Partial outputs, kept: `{partial}`" in report
    assert "`generations.jsonl`: 2 records" in report
    assert "1 failed samples (in `failed.jsonl`): s-400" in report
    assert f"`eaglet run {config_file.resolve()} --until train`" in report
    assert "sends only the prompts not written yet" in report
    assert "--refresh-from generate" in report
    assert partial.is_dir()  # reporting never touches the partial folder


def test_stages_that_restart_their_partial_folder_say_so():
    entry = {"error": "QualityGateError: quality gate failed", "path": "/w/extract/k.partial"}
    note = failure_note("extract", entry, None)
    assert "this stage rebuilds this partial folder from the stage's inputs" in note
    assert "No partial folder was left (expected at `/w/extract/k.partial`)" in note
    assert "`eaglet run CONFIG.yaml`" in note


def test_the_resume_advice_follows_each_stages_declaration():
    """A stage declared resumable (`eaglet.stages`) is never told it rebuilds its partial
    folder (hidden_states was, though it keeps every finished shard), and one that restarts is."""
    from eaglet.stages import STAGE_LIST

    for spec in STAGE_LIST:
        entry = {"error": "RuntimeError: x", "path": f"/w/{spec.name}/k.partial"}
        rebuilds = "rebuilds this partial folder" in failure_note(spec.name, entry, None)
        assert rebuilds != spec.resumes, spec.name


def test_a_resumable_stage_declares_what_a_rerun_keeps_and_the_report_says_it():
    """`Stage.resume_note` is required of a stage that resumes (and only of one), and its
    failure note is that note, word for word."""
    import pytest

    from eaglet.stages import STAGE_LIST, Stage

    for spec in STAGE_LIST:
        entry = {"error": "RuntimeError: x", "path": f"/w/{spec.name}/k.partial"}
        note = failure_note(spec.name, entry, None)
        if spec.resumes:
            assert spec.resume_note and f"this stage {spec.resume_note}." in note, spec.name
    declared = {"output": "o", "reads": (), "files": (), "keyed_by": ()}
    with pytest.raises(ValueError, match="resume_note"):
        Stage(name="s", resumes=True, **declared)
    with pytest.raises(ValueError, match="resume_note"):
        Stage(name="s", resume_note="keeps everything", **declared)


def test_rewording_the_report_or_the_plan_never_changes_a_stages_code_hash():
    """The modules of the report's figures and the plan's reuse estimates are in no stage's
    code (`eaglet.cache.stage_modules`): a new sentence in the report re-runs nothing."""
    from eaglet.cache import stage_modules
    from eaglet.report_figures import FIGURES
    from eaglet.stage_reasons import REUSE_ESTIMATES
    from eaglet.stages import STAGES

    named = {f.__module__ for f in (*FIGURES.values(), *REUSE_ESTIMATES.values())}
    assert named
    for stage in STAGES:
        assert named.isdisjoint(stage_modules(stage)), stage


def test_every_figures_and_reuse_estimate_is_of_a_stage():
    """Each is keyed by its stage's name: a renamed stage or function fails here, not in a
    user's run report or plan."""
    from eaglet.report_figures import FIGURES
    from eaglet.stage_reasons import REUSE_ESTIMATES
    from eaglet.stages import STAGES

    assert set(FIGURES) == set(STAGES)
    assert set(REUSE_ESTIMATES) < set(STAGES)


def test_the_report_says_why_each_stage_ran(tmp_path):
    run = start_run_record(config_for(tmp_path), None, "evaluate", None)
    manifest = run_stage(
        work_dir=tmp_path, stage="extract", key="k", code_hash="c", config={}, upstream=[],
        body=lambda folder: FIGURES["extract"], why=["code changed: eaglet.extract"],
    )  # fmt: skip
    run["stages"]["extract"] = {"state": "Completed", "key": "k", "path": manifest.path}
    write_run_record(tmp_path, run)
    report = write_run_report(tmp_path)
    assert "## Why stages ran" in report
    assert "- **extract**: code changed: eaglet.extract" in report


def test_a_run_without_a_config_file_resumes_from_the_config_it_wrote(tmp_path):
    work_dir = tmp_path / "work"
    config = config_for(work_dir)
    run = start_run_record(config, None, "evaluate", "extract")

    written = work_dir.resolve() / "config.yaml"
    assert resume_command(run) == f"eaglet run {written}"
    assert load_config(written) == config
    assert read_run_record(work_dir) == json.loads(json.dumps(run))
    assert "refreshed from `extract`" in render_run_report(run, {})


def test_describe_partial_counts_records_and_lists_files(tmp_path):
    assert describe_partial(tmp_path / "missing") == {"exists": False}
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "step-4.pt").write_bytes(b"1234")
    (tmp_path / "examples.jsonl").write_text('{}\n{}\n{"torn')
    described = describe_partial(tmp_path)
    assert described["files"] == 2 and described["bytes"] == 4 + 12
    assert described["records"] == {"examples.jsonl": 2}
    assert described["listed"] == ["examples.jsonl", "state/step-4.pt"]
    assert described["failed_sample_ids"] == []


def test_offline_training_line_names_the_shards_it_read():
    info = {"hidden_states_mode": "offline", "feature_bytes_stored": 5 << 30}
    assert training_line(info) == "offline hidden states, 5.0 GiB of shards"
    kept = info | {"best_epoch": 6.0}  # train.keep_best exported an earlier epoch
    assert training_line(kept) == (
        "offline hidden states, 5.0 GiB of shards; draft of epoch 6 (lowest held-out loss)"
    )


def test_a_new_run_clears_the_run_json_temporary_a_killed_writer_left(tmp_path):
    """SIGKILL between writing run.json's temporary sibling and renaming it leaves
    `.run.json.<pid>.tmp`; the next run removes it once that process is gone, and leaves the
    file of a writer still running."""
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    dead = work_dir / ".run.json.999999999.tmp"  # above any pid_max: no such process
    live = work_dir / f".run.json.{os.getppid()}.tmp"
    dead.write_text("{")
    live.write_text("{")
    start_run_record(config_for(work_dir), None, "evaluate", None)
    assert json.loads((work_dir / "run.json").read_text())["stages"] == {}
    assert not dead.exists() and live.exists()


def _advice(stage: str, error: str, started_from: str, retry_can_succeed: bool) -> str:
    entry = {
        "error": error,
        "path": f"/w/{stage}/k.partial",
        "retry_can_succeed": retry_can_succeed,
    }
    run = {"config_file": "/w/config.yaml", "started_from": started_from}
    return failure_note(stage, entry, run)


def test_a_passing_fault_in_the_short_form_offers_retry_and_names_the_forms_own_field():
    note = _advice(
        "generate", "ConnectError: ConnectError on GET http://127.0.0.1:9/v1/models",
        "short form", retry_can_succeed=True,
    )  # fmt: skip
    assert "**Retry can succeed**" in note
    assert "the **Retry** button on this flow run's page" in note
    assert "change `endpoints` (a field of this form)" in note
    assert "this form's `refresh_from`" in note
    assert "eaglet run" not in note and "--refresh-from" not in note  # no shell in the UI


def test_a_deterministic_failure_says_retry_fails_the_same_way_and_which_setting_to_change():
    error = "CanaryError: every answer hit generation.max_tokens=8: raise generation.max_tokens"
    short = _advice("generate", error, "short form", retry_can_succeed=False)
    assert "Retry" not in short.split("Retry would send the same parameters")[0]
    assert "**Change** `generation.max_tokens` (not a field of the short form" in short
    assert "Retry would send the same parameters and fail the same way" in short
    full = _advice("generate", error, "full form", retry_can_succeed=False)
    assert "**Change** `generation.max_tokens` (config → Generation → Max Tokens)" in full
    shell = _advice("generate", error, "shell", retry_can_succeed=False)
    assert "`--set generation.max_tokens=...`" in shell
    assert "run `eaglet run /w/config.yaml` again" in shell
    assert "add `--refresh-from generate`" in shell


def test_a_method_switch_is_a_config_change_not_a_code_change():
    """Issue 47: switching train.method brings the new method's modules into the train key's
    code and drops the old one's; "Why stages ran" said "code changed: eaglet.draft.methods
    .dflash, ..." though no code changed. It names the config key, and an edited module
    still reads as a code change."""
    from eaglet.cache import code_hash, code_modules, stage_config
    from eaglet.config import load_config
    from eaglet.stage_reasons import code_reason, config_reason, plug_in_reason
    from eaglet.storage import Manifest

    eagle3 = load_config(None, ["train.method=eagle3"])
    dflash = load_config(None, ["train.method=dflash"])

    def folder_of(stage: str, config) -> Manifest:
        return Manifest(
            stage=stage, key="k", path=f"{stage}/k", code_hash=code_hash(stage, config),
            config=stage_config(stage, config), code_modules=code_modules(stage, config),
            started=0.0, finished=1.0,
        )  # fmt: skip

    before = folder_of("train", eagle3)
    modules = code_modules("train", dflash)
    assert modules.keys() != before.code_modules.keys()  # the method's module came in
    config = config_reason(stage_config("train", dflash), before.config)
    assert config is not None and config.startswith("config changed: ")
    assert "train.method 'eagle3' -> 'dflash'" in config, config
    assert code_reason(modules, before, code_hash("train", dflash), config is not None) is None
    edited = dict(modules, **{"eaglet.draft.train": "0" * 64})  # a module both runs share
    reason = code_reason(edited, before, "another hash", config is not None)
    assert reason == "code changed: eaglet.draft.train", reason
    # evaluate is keyed by the draft it reads, not train.method: the plugged-in method says it
    before = folder_of("evaluate", eagle3)
    keyed = stage_config("evaluate", dflash)
    assert config_reason(keyed, before.config) is None
    assert plug_in_reason("evaluate", dflash, keyed, before) == (
        "config changed: train.method, now 'dflash'"
    )
    assert plug_in_reason("evaluate", eagle3, stage_config("evaluate", eagle3), before) is None


def test_the_advice_names_where_a_setting_came_from():
    """Issue 47: a refusal of a run started with `config_path` said to change the setting "in
    the form" when it was in the YAML file. The advice names the form's field, the YAML file
    and key, or `--set`, by where the run's settings came from."""
    from eaglet.failure_advice import RunOrigin, failure_headline, field_for

    short = RunOrigin("short form", "/b/base.yaml", frozenset({"generation.endpoints"}))
    assert field_for("generation.endpoints", short) == "`endpoints` (a field of this form)"
    assert field_for("target.model", short) == (
        "`target.model` in `/b/base.yaml` (the base config `config_path` names), or this "
        "form's `target_model`"
    )
    assert field_for("train.device", short).startswith("`train.device` in `/b/base.yaml` (")
    assert "not a field of the short form" in field_for("train.device", RunOrigin("short form"))
    assert field_for("train.device", RunOrigin("full form", "/b/x.yaml")).startswith(
        "`train.device` in `/b/x.yaml` (the file `config_path` names"
    )
    assert field_for("train.device", RunOrigin("full form")) == (
        "`train.device` (config → Draft training → Device)"
    )
    assert field_for("train.device", RunOrigin("shell", "/b/x.yaml")) == (
        "`train.device` in `/b/x.yaml` (or `--set train.device=...`)"
    )
    # the run record keeps the origin for a stage's failure later
    run = {"started_from": "short form", "config_path": "/b/base.yaml", "set_keys": ["work_dir"]}
    assert RunOrigin.of_run(run) == RunOrigin("short form", "/b/base.yaml", frozenset({"work_dir"}))
    entry = {"error": "CanaryError: preflight canary failed:\n  endpoint http://h:9 is not "
                      "reachable: start the server, or fix generation.endpoints"}  # fmt: skip
    headline = failure_headline("generate", entry, short)
    assert headline == (
        "generate failed: CanaryError: preflight canary failed: endpoint http://h:9 is not "
        "reachable: start the server, or fix generation.endpoints. Retry would send the same "
        "parameters and fail the same way: change `endpoints` (a field of this form)"
    )
    passing = {"error": "ConnectError: [Errno 111]", "retry_can_succeed": True}
    assert failure_headline("generate", passing, short).endswith(
        "Retry can succeed once the passing fault is gone"
    )
