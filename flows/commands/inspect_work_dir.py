"""`eaglet inspect WORK_DIR`: per stage its status, key, counts, and the run's quality, training
and evaluation figures (`eaglet.work_dir_status`); `--json` for checks outside the repo,
`--sample ID` for one example's loss mask."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eaglet.draft.engine_check import rows_text
from eaglet.draft.sampled import sampled_text
from eaglet.draft.segments import segments_text
from eaglet.report_figures import percent, training_line
from eaglet.stages import STAGES
from eaglet.work_dir_status import inspect_work_dir, is_work_dir, show_sample


def cmd_inspect(args: argparse.Namespace) -> int:
    work_dir = Path(args.work_dir)
    if not work_dir.is_dir():
        print(f"no such work dir: {work_dir}", file=sys.stderr)
        return 2
    if not is_work_dir(work_dir):
        print(
            f"{work_dir} is not an eaglet work dir (no run.json and no stage folder: "
            f"{', '.join(STAGES)}); pass the config's work_dir",
            file=sys.stderr,
        )
        return 2
    if args.sample is not None and not args.sample.strip():
        print("--sample needs a sample id (e.g. arith-00001)", file=sys.stderr)
        return 2
    report = inspect_work_dir(work_dir, "full" if args.verify else "size")
    if args.sample is not None:
        return show_sample(report, args.sample, args.json)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(f"work dir {report['work_dir']}")
    for stage, figures in report["stages"].items():
        print(
            f"  {stage:<14} {figures['status']:<9} {figures['records']:>6} records  "
            f"{figures['key'] or '-'}"
        )
        for problem in figures.get("problems", []):
            print(f"      {problem}")
        for other in figures.get("partial_folders", []):
            print(f"      also an unfinished folder no finished run used: {other}")
        if figures["status"] == "corrupt":
            print(f"      rebuild it: eaglet run CONFIG --refresh-from {stage}")
    quality = report["quality"]
    if quality:
        print(
            f"quality ({quality['reasoning_format']}): capture "
            f"{percent(quality['reasoning_capture_rate'])}, "
            f"truncated {quality['truncation_rate']:.1%}"
        )
        for source, figures in quality["per_source"].items():
            print(
                f"  {source:<10} {figures['records']:>5} records, reasoning captured "
                f"{percent(figures['reasoning_capture_rate'])}, thinking in content "
                f"{figures['thinking_in_content']}, truncated {figures['truncation_rate']:.1%}"
            )
    if report["training"]:
        print(f"training: {training_line(report['training'])}")
    if report["evaluation"]:
        e = report["evaluation"]
        print(
            f"evaluation: tau {e['tau']:.3f} (untrained {e['untrained_tau']:.3f}) "
            f"on {e['prompts']} held-out prompts"
            + (f", {e['emitted_tau']:.3f} output tokens per round" if "emitted_tau" in e else "")
        )
        if e.get("segments"):
            print(f"  by segment: {segments_text(e['segments'])}")
        if e.get("sampled"):
            print(f"  {sampled_text(e['sampled'])}")
    if report.get("engine_checks"):
        print("engine check:")
        for line in rows_text(report["engine_checks"]):
            print(f"  {line}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    inspect = commands.add_parser("inspect", help="per stage: status, key, path, counts")
    inspect.add_argument("work_dir")
    inspect.add_argument("--json", action="store_true")
    inspect.add_argument("--sample", metavar="ID", help="show one example's loss mask")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="check every file's sha256 against its manifest (sizes are always checked)",
    )
    inspect.set_defaults(handler=cmd_inspect)
