"""`eaglet doctor CONFIG`: the preflight's checks of a config, then the canary against its
servers with the canary's own limits; every finding one line naming the key or file."""

from __future__ import annotations

import argparse
from typing import Any

from eaglet.config import PipelineConfig, load_config
from eaglet.preflight import preflight


def cmd_doctor(args: argparse.Namespace) -> int:
    """Preflight checks of a config (eaglet/preflight/: files, target, layer ids, template,
    lengths, disk), then the canary against its servers with the canary's own limits. Every
    finding is one line naming the key or file and what to do; never a traceback."""
    config = load_config(args.config, args.set)
    print(f"config {args.config}: valid")
    problems: list[str] = []
    try:
        report = preflight(config)
        print(report.render())
        problems += report.problems
        tokenizer = report.tokenizer
    except Exception as exc:  # a check that itself broke: say so in one line
        problems.append(f"the preflight could not finish: {type(exc).__name__}: {exc}")
        tokenizer = None
    if tokenizer is None:
        print("canary: skipped (it needs the target's tokenizer; fix the problems above)")
    else:
        try:
            problems += _doctor_canary(config, tokenizer)
        except Exception as exc:
            problems.append(f"the canary could not run: {type(exc).__name__}: {exc}")
    from eaglet.draft.split_plan import doctor_lines  # online from servers: rates, split

    print("\n".join(doctor_lines(config)) or "split: not planned (no served online training)")
    for problem in problems:
        print(f"problem: {problem}")
    print("doctor: ok" if not problems else f"doctor: {len(problems)} problem(s)")
    return 1 if problems else 0


def _doctor_canary(config: PipelineConfig, tokenizer: Any) -> list[str]:
    """Run the canary on the datasets' first `generation.canary_requests` samples; the
    problems found (the canary's own report is printed)."""
    from eaglet.canary import dataset_prompts, run_canary

    prompts, problems = dataset_prompts(config, tokenizer)
    api_key = None
    if config.generation.api_key_secret:
        from eaglet.stage_context import generation_api_key
        from eaglet_prefect.blocks import prefect_secret  # Prefect blocks: not the core's

        try:
            api_key = generation_api_key(config.generation.api_key_secret, prefect_secret)
        except ValueError as exc:
            return [*problems, str(exc)]
    report = run_canary(config, tokenizer, prompts, api_key=api_key)
    print(report.render())
    if not report.ok:
        problems.append("the canary failed (see above)")
    return problems


def register(commands: argparse._SubParsersAction) -> None:
    doctor = commands.add_parser("doctor", help="preflight checks of a config")
    doctor.add_argument("config")
    doctor.add_argument("--set", action="append", default=[], metavar="a.b=value")
    doctor.set_defaults(handler=cmd_doctor)
