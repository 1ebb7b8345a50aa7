"""What a work dir holds, read without running anything: per stage its status (complete,
partial, missing, corrupt), key, folder and counts, the quality and evaluation figures, and one
example's loss mask (`eaglet inspect`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from eaglet.draft.methods.registry import DEFAULT_METHOD
from eaglet.draft.sampled import sampled_summary
from eaglet.records.io import record_file_problems
from eaglet.run_report import RUN_FILE, read_run_record, recorded_keys
from eaglet.stages import (
    EXAMPLES_FILE,
    FAILED_FILE,
    GENERATIONS_FILE,
    PRODUCER,
    QUALITY_FILE,
    REJECTED_FILE,
    REPORT_FILE,
    STAGE,
    STAGES,
    writer_of,
    writers_of,
)
from eaglet.storage import PARTIAL_SUFFIX, Manifest, ManifestError, read_manifest, verify_files


def is_work_dir(work_dir: Path) -> bool:
    """A folder eaglet ran in: it has a run record or a stage folder."""
    return (work_dir / RUN_FILE).exists() or any((work_dir / s).is_dir() for s in STAGES)


def stage_status(
    work_dir: Path, stage: str, run_keys: dict[str, str], verify: str = "size"
) -> dict[str, Any]:
    """One stage's line of `eaglet inspect`: missing, partial, complete, or corrupt (a
    manifest that cannot be read, or files that differ from it: sizes always, sha256 with
    `--verify`). `path` is absolute, resolved from the work dir (the manifest holds it
    relative)."""
    folder = work_dir / stage
    if not folder.is_dir():
        return {"status": "missing", "key": "", "path": "", "records": 0}
    complete: list[Manifest] = []
    unreadable: dict[str, str] = {}
    for entry in folder.iterdir():
        if not entry.is_dir() or entry.name.endswith(PARTIAL_SUFFIX) or ".replaced-" in entry.name:
            continue
        try:
            manifest = read_manifest(entry)
        except ManifestError as exc:
            unreadable[entry.name] = str(exc)
            continue
        if manifest is not None:
            complete.append(manifest)
    partials = [p for p in folder.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]
    wanted = run_keys.get(stage)
    if wanted in unreadable:
        return {
            "status": "corrupt",
            "key": wanted,
            "path": str((folder / wanted).resolve()),
            "records": 0,
            "problems": [unreadable[wanted]],
        }
    chosen = next((m for m in complete if m.key == wanted), None)
    if chosen is None and complete:
        chosen = max(complete, key=lambda m: m.finished)
    newest_partial = max(partials, key=lambda p: p.stat().st_mtime, default=None)
    wanted_partial = next((p for p in partials if p.name == f"{wanted}{PARTIAL_SUFFIX}"), None)
    # The folder the last run used wins: complete, or partial where it stopped in this stage.
    # A partial folder no run names (a stray one) never hides a complete folder: it is listed.
    used = chosen is not None and chosen.key == wanted
    shown_partial = wanted_partial if not used else None
    if chosen is None and shown_partial is None:
        shown_partial = newest_partial
    if shown_partial is not None:
        key = shown_partial.name.removesuffix(PARTIAL_SUFFIX)
        return {"status": "partial", "key": key, "path": str(shown_partial.resolve()), "records": 0}
    if chosen is None and unreadable:
        key, problem = next(iter(sorted(unreadable.items())))
        path = str((folder / key).resolve())
        return {"status": "corrupt", "key": key, "path": path, "records": 0, "problems": [problem]}
    if chosen is None:
        return {"status": "missing", "key": "", "path": "", "records": 0}
    stage_path = chosen.folder_in(work_dir).resolve()
    problems = verify_files(stage_path, chosen, verify)
    records = STAGE[stage].records_file
    if verify == "full" and not problems and records and (stage_path / records).is_file():
        problems = record_file_problems(stage_path / records, chosen.counts.get("records"))
    others = sorted(str(p.resolve()) for p in partials)
    return {
        "status": "corrupt" if problems else "complete",
        "key": chosen.key,
        "path": str(stage_path),
        "records": chosen.counts.get("records", 0),
        "counts": chosen.counts,
        "finished": chosen.finished,
        **({"problems": problems} if problems else {}),
        **({"partial_folders": others} if others else {}),
    }


def inspect_work_dir(work_dir: Path, verify: str = "size") -> dict[str, Any]:
    """Per stage: status, key, absolute path, counts; quality and evaluation figures.
    `verify` = "size" checks file sizes against each manifest, "full" their sha256 too."""
    # no record, or one cut short by a crash: every stage shows its newest folder
    run_keys = recorded_keys(read_run_record(work_dir))
    stages = {stage: stage_status(work_dir, stage, run_keys, verify) for stage in STAGES}
    quality: dict[str, Any] = {}
    if (extract := stages[writer_of(QUALITY_FILE)])["status"] == "complete":
        quality_file = Path(extract["path"]) / QUALITY_FILE
        if quality_file.exists():
            quality = json.loads(quality_file.read_text())
    training: dict[str, Any] = {}
    # one row per export and engine: the evaluate stage's (vLLM's parse, served tau) when it
    # ran, else the train stage's (conventions only)
    engine_checks: list[dict[str, Any]] = []
    if (train := stages[PRODUCER["draft"]])["status"] == "complete":
        info = read_manifest(Path(train["path"])).info
        engine_checks = info.get("engine_checks") or []
        training = {
            key: info[key]
            for key in (
                "method",
                "exports",  # engine -> folder beside the draft
                "hidden_states_mode",
                "feature_bytes_stored",
                "feature_bytes_saved",
                "feature_bytes_saved_storage",
                "best_epoch",  # train.keep_best: the exported draft's epoch
            )
            if info.get(key) is not None
        }
    evaluation: dict[str, Any] = {}
    if (evaluate := stages[writer_of(REPORT_FILE)])["status"] == "complete":
        report = json.loads((Path(evaluate["path"]) / REPORT_FILE).read_text())
        evaluation = {
            "method": report["draft"].get("method", DEFAULT_METHOD),
            "tau": report["tau"],
            "untrained_tau": report["untrained_tau"],
            **({"emitted_tau": report["emitted_tau"]} if "emitted_tau" in report else {}),
            "prompts": report["prompts"],
            "per_position_acceptance": report["draft"].get("per_position_acceptance", []),
            "segments": report.get("segments", {}),
            **({"sampled": sampled_summary(report["sampled"])} if "sampled" in report else {}),
            **({"served_tau": report["served_tau"]} if "served_tau" in report else {}),
            **({"sets": report["sets"]} if "sets" in report else {}),
        }
        engine_checks = report.get("engine_checks") or engine_checks
    return {
        "work_dir": str(work_dir.resolve()),
        "stages": stages,
        "quality": quality,
        "training": training,
        "evaluation": evaluation,
        "engine_checks": engine_checks,
    }


def _lines_about(path: Path, sample_id: str) -> list[dict[str, Any]]:
    """The JSON lines of `path` whose sample_id is `sample_id` (none when it is missing)."""
    if not path.is_file():
        return []
    found = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if sample_id in line:  # cheap filter before parsing
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and entry.get("sample_id") == sample_id:
                    found.append(entry)
    return found


def why_no_example(report: dict[str, Any], sample_id: str) -> str:
    """Why the extract stage holds no example for `sample_id`: which stage left it out and the
    reason it recorded, read from that stage's files."""
    stages = report["stages"]
    generate, extract = writer_of(GENERATIONS_FILE), writer_of(EXAMPLES_FILE)

    def folder(stage: str) -> Path | None:
        status = stages[stage]
        return Path(status["path"]) if status["status"] == "complete" else None

    for stage in writers_of(REJECTED_FILE):
        if (where := folder(stage)) is not None:
            for entry in _lines_about(where / REJECTED_FILE, sample_id):
                return (
                    f"the {stage} stage left it out ({entry.get('kind', 'rejected')}): "
                    f"{entry.get('why', '')} (see {where / REJECTED_FILE})"
                )
    if (where := folder(generate)) is not None:
        for entry in _lines_about(where / FAILED_FILE, sample_id):
            return (
                f"the {generate} stage gave up on it after {entry.get('attempts', 1)} attempts: "
                f"{entry.get('message', '')} (see {where / FAILED_FILE}; `eaglet run CONFIG "
                "--retry-failed` sends it again)"
            )
        for entry in _lines_about(where / GENERATIONS_FILE, sample_id):
            if entry.get("finish_reason") == "loop":
                return (
                    f"the loop guard stopped its answer (finish_reason loop) and {extract} drops "
                    "such rows (reasoning.looped_rows: drop)"
                )
            return f"it is in {where / GENERATIONS_FILE} but {extract} wrote no example for it"
        return f"no sample with this id reached the {generate} stage ({where / GENERATIONS_FILE})"
    return "no sample with this id in this work dir's finished stages"


def show_sample(report: dict[str, Any], sample_id: str, as_json: bool = False) -> int:
    """Print one example with its loss mask (what the draft is trained on, span by span), or
    why there is none; `as_json` prints one JSON object either way."""
    from eaglet.config.target import TargetConfig
    from eaglet.extract import loss_mask_spans, render_loss_mask
    from eaglet.reasoning import detect_format
    from eaglet.records.examples import Example
    from eaglet.records.io import read_jsonl
    from eaglet.target import end_token_ids, load_tokenizer

    def refuse(why: str) -> int:
        if as_json:
            print(json.dumps({"sample_id": sample_id, "found": False, "why": why}, indent=2))
        else:
            print(why, file=sys.stderr)
        return 2

    stage = writer_of(EXAMPLES_FILE)
    extract = report["stages"][stage]
    if extract["status"] != "complete":
        return refuse(f"the {stage} stage is not complete in this work dir")
    examples_path = Path(extract["path"]) / EXAMPLES_FILE
    examples = read_jsonl(examples_path, Example)
    example = next((e for e in examples if e.sample_id == sample_id), None)
    if example is None:
        why = why_no_example(report, sample_id)
        return refuse(f"no example with sample_id {sample_id} in {examples_path}: {why}")
    manifest = read_manifest(Path(extract["path"]))
    target = TargetConfig(model=manifest.info["target_model"])
    tokenizer = load_tokenizer(target)
    reasoning_format = detect_format(tokenizer, manifest.config["reasoning"]["format"])
    end_ids = set(end_token_ids(target, tokenizer))
    if as_json:
        spans = loss_mask_spans(example, tokenizer, reasoning_format, end_ids)
        shown = {
            "sample_id": sample_id, "found": True, "source": example.source,
            "finish_reason": example.finish_reason, "flags": example.flags,
            "tokens": len(example.input_ids), "trained_tokens": sum(example.loss_mask),
            "spans": spans,
        }  # fmt: skip
        print(json.dumps(shown, indent=2, ensure_ascii=False))
        return 0
    print(render_loss_mask(example, tokenizer, reasoning_format, end_ids, sys.stdout.isatty()))
    return 0
