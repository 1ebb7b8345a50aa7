"""The record of one pipeline run in its work dir, and the report built from it.

`WORK_DIR/run.json` is written by the flow as the run goes: the config name, the config file
to run it again (`WORK_DIR/config.yaml`, written at the start, unless the run was given its own
file), `until`, `refresh_from`, and one entry per stage (state, key, path, records, seconds; a
failed stage also has its error and what its `.partial` folder holds). `render_run_report`
turns that record and the stage manifests into markdown; `write_run_report` writes it to
`WORK_DIR/run_report.md`. `failure_note` says what failed, where the partial outputs are and
the exact command that resumes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Required, TypedDict

import yaml

from eaglet.config import PipelineConfig, resolve_paths
from eaglet.failure_advice import RunOrigin, key_line, what_to_do
from eaglet.report_figures import FIGURES
from eaglet.stages import FAILED_FILE, STAGE_LIST, STAGES
from eaglet.storage import ManifestError, read_manifest, write_json_atomic

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
REPORT_FILE = "run_report.md"
# In a stage folder of another work dir: the work dirs whose runs reach it through a symlink
# (`record_links`), so that gc there keeps what they use (`eaglet.work_dir_gc`).
LINKS_FILE = ".eaglet-linked-work-dirs"

# What a rerun does with a stage's `.partial` folder (see `eaglet.storage.run_stage` and the
# `resume_partial` argument of each task): a resumable stage's own note (`Stage.resume_note`),
# or it rebuilds the folder.
RESUMES_PARTIAL = {spec.name: spec.resume_note for spec in STAGE_LIST if spec.resumes}
RESTARTS_PARTIAL = "rebuilds this partial folder from the stage's inputs"

# How each place a run starts from redoes finished stages (`failure_note`).
REFRESH_FROM = {
    "short form": "start a new run with this form's `refresh_from` set to the stage (e.g. "
    "`{stage}`).",
    "full form": "start a new run (*Run* → *Custom run*) with the same config and the "
    "`refresh_from` parameter set to the stage (e.g. `{stage}`).",
    "shell": "add `--refresh-from {stage}` to the command.",
}

# The states of a stage that finished (its folder is whole): a later run reuses it.
FINISHED_STATES = ("Completed", "Cached")


class StageEntry(TypedDict, total=False):
    """A stage's entry in `run.json`: its state (Completed, Cached, Failed, Crashed), key,
    folder, records and seconds; a failed stage's error, whether a retry can succeed and what
    its `.partial` folder holds (`describe_partial`)."""

    state: Required[str]
    key: str
    path: str
    records: int
    seconds: float
    error: str
    retry_can_succeed: bool
    partial: dict[str, Any]


class RunRecord(TypedDict, total=False):
    """`run.json`: the run's config name, work dir and config file, `until`, `refresh_from`,
    where it started (`eaglet.failure_advice.RunOrigin`), its Prefect flow run, the stage
    running now and each stage's entry."""

    name: str
    work_dir: str
    config_file: str
    until: str
    refresh_from: str | None
    started_from: str
    config_path: str | None
    set_keys: list[str]
    flow_run: str | None
    running: str | None
    stages: Required[dict[str, StageEntry]]


_LISTED_FILES = 12
_LISTED_IDS = 10


def start_run_record(
    config: PipelineConfig,
    config_path: str | None,
    until: str,
    refresh_from: str | None,
    origin: RunOrigin | None = None,
    flow_run: str | None = None,
) -> RunRecord:
    """Write `WORK_DIR/config.yaml` (the config this run uses) and a fresh `run.json`;
    `origin` (the UI's short or full form, or a shell; the YAML file the settings came from;
    the keys the short form set) words the failure advice, `flow_run` is the Prefect flow run
    (a crash report reads the record only when it is its own)."""
    origin = origin or RunOrigin("shell", config_path)
    work_dir = Path(config.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    own_file = work_dir / CONFIG_FILE
    # Absolute paths (relative ones mean the directory this run started in), so the resume
    # command `eaglet run WORK_DIR/config.yaml` works from anywhere.
    absolute = resolve_paths(config, Path.cwd())
    own_file.write_text(yaml.safe_dump(absolute.model_dump(mode="json"), sort_keys=False))
    run: RunRecord = {
        "name": config.name,
        "work_dir": str(work_dir),
        "config_file": str(Path(config_path).resolve()) if config_path else str(own_file),
        "until": until,
        "refresh_from": refresh_from,
        "started_from": origin.started_from,
        "config_path": origin.config_file,
        "set_keys": sorted(origin.set_keys),
        "flow_run": flow_run,
        "running": None,  # the stage running now (a crash report names it)
        "stages": {},
    }
    write_run_record(work_dir, run)
    record_links(work_dir)
    for stray in work_dir.glob(f".{RUN_FILE}.*.tmp"):  # a writer killed before its rename
        pid = stray.name[len(RUN_FILE) + 2 : -len(".tmp")]
        if pid.isdigit() and not process_alive(int(pid)):
            stray.unlink(missing_ok=True)
    return run


def linked_users(stage_folder: Path) -> list[Path]:
    """The work dirs whose runs reached `stage_folder` through a symlink (`record_links`)."""
    try:
        lines = (Path(stage_folder) / LINKS_FILE).read_text().splitlines()
    except OSError:
        return []
    return sorted({Path(line) for line in lines if line.strip()})


def record_links(work_dir: Path) -> None:
    """Name `work_dir` in `.eaglet-linked-work-dirs` of every stage folder of another work dir
    it reaches through a symlink (the stage folder itself, or a key's folder in it), so that
    gc of that work dir keeps what this one's run uses."""
    real = Path(work_dir).resolve()
    for stage in STAGES:
        root = Path(work_dir) / stage
        targets = set()
        if root.is_symlink():
            targets.add(root.resolve())
        elif root.is_dir():
            targets |= {e.resolve().parent for e in root.iterdir() if e.is_symlink()}
        for target in targets:
            if (
                real in target.parents
                or not target.is_dir()
                or str(real) in map(str, linked_users(target))
            ):
                continue
            try:
                with open(target / LINKS_FILE, "a", encoding="utf-8") as out:
                    out.write(f"{real}\n")
            except OSError:  # a read-only share: its owner's gc cannot know of us
                pass


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def write_run_record(work_dir: Path, run: RunRecord) -> None:
    write_json_atomic(Path(work_dir) / RUN_FILE, run)


def read_run_record(work_dir: Path) -> RunRecord | None:
    """The work dir's `run.json`, the one reader of it; None when there is none or it cannot
    be read as one (a file cut short by a crash: every caller then knows no run's stages)."""
    try:
        run = json.loads((Path(work_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(run, dict) or not isinstance(run.get("stages"), dict):
        return None
    if not all(isinstance(entry, dict) for entry in run["stages"].values()):
        return None
    return run  # type: ignore[return-value]  # a RunRecord as far as its readers go, above


def finished_stages(run: RunRecord | None) -> list[str]:
    """The stages a run record says finished, in the stages' order."""
    stages = run["stages"] if run else {}
    return [s for s in STAGES if s in stages and stages[s]["state"] in FINISHED_STATES]


def failed_stages(run: RunRecord) -> list[str]:
    """The stages of a run record that did not finish (failed, crashed), as recorded."""
    return [s for s, e in run["stages"].items() if e["state"] not in FINISHED_STATES]


def recorded_keys(run: RunRecord | None) -> dict[str, str]:
    """stage -> the key a run record names for it."""
    stages = run["stages"] if run else {}
    return {s: str(e["key"]) for s, e in stages.items() if e.get("key")}


def resume_command(run: RunRecord | None) -> str:
    """The shell command that runs the same pipeline again; finished stages come back Cached."""
    if not run:
        return "eaglet run CONFIG.yaml"
    command = f"eaglet run {run['config_file']}"
    if run.get("until", STAGES[-1]) != STAGES[-1]:
        command += f" --until {run['until']}"
    return command


def _complete_lines(path: Path) -> int:
    """Newline-terminated lines (a torn last line is not a record); fast on a 10 GB file."""
    count = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            count += chunk.count(b"\n")
    return count


def describe_partial(folder: Path, counted: bool = True) -> dict[str, Any]:
    """What a stage's `.partial` folder holds: files, records per JSONL file, failed ids (not
    `counted`: its files only, for a run stopping by a signal: a 10 GB file would take longer
    than the exit may)."""
    folder = Path(folder)
    if not folder.is_dir():
        return {"exists": False}
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    records = {
        path.name: _complete_lines(path)
        for path in files
        if counted and path.suffix == ".jsonl" and path.parent == folder
    }
    failed_ids = []
    failed = folder / FAILED_FILE
    if counted and failed.is_file():
        for line in failed.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                failed_ids.append(json.loads(line)["sample_id"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed run
    return {
        "exists": True,
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "listed": [str(p.relative_to(folder)) for p in files[:_LISTED_FILES]],
        "records": records,
        "failed_sample_ids": failed_ids,
    }


def failure_entry(
    key: str, partial: Path, error: str, seconds: float, retry_can_succeed: bool = False,
    counted: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """The `run.json` entry of a stage that failed; `retry_can_succeed` for a passing fault
    (`eaglet.errors.is_transient`); `counted`: see `describe_partial`."""
    return {
        "state": "Failed",
        "key": key,
        "path": str(partial),
        "records": 0,
        "seconds": round(seconds, 2),
        "error": error,
        "retry_can_succeed": retry_can_succeed,
        "partial": describe_partial(partial, counted),
    }


def failure_note(stage: str, entry: StageEntry, run: RunRecord | None) -> str:
    """Markdown: what failed, on which samples/files, where the partial folder is, how to resume."""
    partial = entry.get("partial", {})
    # The key line as text first (it wraps; a long line in the code block below is clipped).
    lines = [f"## `{stage}` failed", "", f"**Error:** {plain(key_line(entry['error']))}", ""]
    lines += ["```", entry["error"].strip(), "```", ""]
    if partial.get("exists"):
        lines.append(
            f"Partial outputs, kept: `{entry['path']}` ({partial['files']} files, "
            f"{partial['bytes']:,} bytes)."
        )
        for name, count in partial["records"].items():
            lines.append(f"- `{name}`: {count} records")
        shown = partial["listed"]
        more = partial["files"] - len(shown)
        if shown:
            lines.append("- files: " + ", ".join(f"`{f}`" for f in shown))
            if more > 0:
                lines[-1] += f" and {more} more"
        ids = partial["failed_sample_ids"]
        if ids:
            lines.append(
                f"- {len(ids)} failed samples (in `{FAILED_FILE}`): "
                + ", ".join(ids[:_LISTED_IDS])
                + (" ..." if len(ids) > _LISTED_IDS else "")
            )
    else:
        lines.append(f"No partial folder was left (expected at `{entry['path']}`).")
    started_from = run.get("started_from", "shell") if run else "shell"
    lines += [
        "",
        f"**Resume**: finished stages come back Cached; this stage "
        f"{RESUMES_PARTIAL.get(stage, RESTARTS_PARTIAL)}.",
        "",
        *what_to_do(stage, entry, resume_command(run), RunOrigin.of_run(run)),
        "",
        "To redo a finished stage and everything after it (a server flag or a dataset revision "
        "changed; a fix to eaglet's code needs nothing, the stage's key changes): "
        + REFRESH_FROM[started_from].format(stage=stage),
    ]
    return "\n".join(lines)


def plain(text: str) -> str:
    """`text` shown as written in markdown (its `*`, `_`, backticks... escaped)."""
    return re.sub(r"([\\`*_\[\]<>#|])", r"\\\1", text)


def _in_work_dir(entry: StageEntry, run: RunRecord) -> str:
    path = Path(entry.get("path", ""))
    work_dir = Path(run.get("work_dir", "/nonexistent"))
    return str(path.relative_to(work_dir)) if path.is_relative_to(work_dir) else str(path)


def render_run_report(run: RunRecord, manifests: dict[str, dict[str, Any]]) -> str:
    """The run report as markdown: a table of the stages (Cached or ran, records, seconds,
    folder), then each stage's key figures as a list below it (a table cell that long was
    clipped in the Prefect UI), then, for a failed stage, its error and how to resume.
    `manifests` maps a stage to its manifest (as a dict); stages without one show no figures."""
    stages = run["stages"]
    failed = failed_stages(run)
    until = run.get("until", STAGES[-1])
    outcome = f"**failed** at `{failed[0]}`" if failed else "completed"
    lines = [
        f"# Run report: {run.get('name', '?')}",
        "",
        f"Run {outcome}; stages up to `{until}`"
        + (f", refreshed from `{run['refresh_from']}`" if run.get("refresh_from") else "")
        + f". Config: `{run.get('config_file', '?')}`. Work dir: `{run.get('work_dir', '?')}`.",
        "",
        "| stage | state | records | seconds | folder (in the work dir) |",
        "|---|---|---|---|---|",
    ]
    figures_lines, why_lines = [], []
    for stage in STAGES:
        entry = stages.get(stage)
        if entry is None:
            state = "not requested" if STAGES.index(stage) > STAGES.index(until) else "not run"
            lines.append(f"| {stage} | {state} | | | |")
            continue
        key_figures = FIGURES.get(stage)
        figures = key_figures(manifests[stage]) if key_figures and stage in manifests else ""
        lines.append(
            f"| {stage} | {entry['state']} | {entry.get('records', 0)} | "
            f"{entry.get('seconds', 0):.1f} | `{_in_work_dir(entry, run)}` |"
        )
        if figures:
            figures_lines.append(f"- **{stage}**: {figures}")
        why = manifests.get(stage, {}).get("why") if entry["state"] == "Completed" else None
        if why:
            why_lines.append(f"- **{stage}**: {'; '.join(why)}")
    if figures_lines:
        lines += ["", "## Key figures", "", *figures_lines]
    if why_lines:
        lines += ["", "## Why stages ran", "", *why_lines]
    checks = next(
        (
            manifests[stage]["info"]["engine_checks"]
            for stage in reversed(STAGES)
            if manifests.get(stage, {}).get("info", {}).get("engine_checks")
        ),
        None,
    )  # the evaluate stage's rows (vLLM's parse, served tau), else the train stage's
    if checks:
        from eaglet.draft.engine_check import rows_text

        lines += ["", "## Engine check", "", *[f"- {plain(line)}" for line in rows_text(checks)]]
    calibration = manifests.get(STAGES[-1], {}).get("info", {}).get("calibration")
    if calibration:
        bands = ", ".join(f"batch {a}-{b}: k = {k}" for a, b, k in calibration["bands"])
        lines += ["", "## Serving calibration", "",
                  f"Best k per band of batch sizes: {bands} ({plain(calibration['schedule'])}).",
                  "", f"![calibration]({calibration['plot']})"]  # fmt: skip
    for stage in failed:
        lines += ["", failure_note(stage, stages[stage], run)]
    return "\n".join(lines) + "\n"


def write_run_report(work_dir: Path) -> str:
    """Render the report of the run recorded in `WORK_DIR/run.json` into `run_report.md`."""
    work_dir = Path(work_dir)
    run: RunRecord = read_run_record(work_dir) or {"stages": {}}
    manifests = {}
    for stage, entry in run["stages"].items():
        try:
            # Absolute in run.json; relative (to the work dir) as manifests hold it.
            folder = work_dir / entry["path"] if entry.get("path") else None
            manifest = read_manifest(folder) if folder is not None else None
        except ManifestError:  # the failed stage's own error says so; the report still renders
            manifest = None
        if manifest is not None:
            manifests[stage] = manifest.model_dump()
    report = render_run_report(run, manifests)
    (work_dir / REPORT_FILE).write_text(report, encoding="utf-8")
    return report
