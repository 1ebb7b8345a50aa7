"""The `eaglet` command: demo, run, doctor, inspect, fixture-model.

Prefect and the flows are imported only by the commands that run the pipeline, so `inspect`
and `fixture-model` start fast and the core stays free of Prefect.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from eaglet.config import STAGES, ConfigError, PipelineConfig, load_config
from eaglet.run_report import percent
from eaglet.storage import PARTIAL_SUFFIX, read_manifest


def _run_pipeline(
    config: PipelineConfig, until: str, refresh_from: str | None, retry_failed: bool = False
) -> dict:
    # Offline clusters are common: Prefect's usage telemetry would only log resolver errors.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.pipeline import pipeline

    return pipeline(
        config=config, until=until, refresh_from=refresh_from, retry_failed=retry_failed
    )


def _print_run(result: dict, seconds: float) -> None:
    for stage, figures in result["stages"].items():
        print(
            f"  {stage:<14} {figures['state']:<10} {figures['records']:>6} records  "
            f"{figures['seconds']:>7.1f} s  {figures['path']}"
        )
    print(f"pipeline finished in {seconds:.1f} s")


def demo_config(work_dir: Path, overrides: list[str] = ()) -> PipelineConfig:
    """The demo: the fixture target, the sample data, the embedded engine, all in work_dir."""
    return load_config(
        None,
        [
            f"work_dir={work_dir}",
            f"target.model={work_dir / 'models' / 'fixture'}",
            f"datasets=[{{source: arith, path: {work_dir / 'data' / 'arith.jsonl'}}}, "
            f"{{source: tools, path: {work_dir / 'data' / 'tools.jsonl'}}}, "
            f"{{source: mixed, path: {work_dir / 'data' / 'mixed.parquet'}}}]",
            # The fixture is a 2M-parameter model: on about one tool conversation in eight it
            # never closes its reasoning. Real targets keep the 0.9 default.
            "reasoning.min_capture_rate=0.8",
            *overrides,
        ],
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from eaglet.fixture.model import build_fixture_model
    from eaglet.fixture.sample_data import write_sample_data

    started = time.time()
    work_dir = Path(args.work_dir)
    model_dir = work_dir / "models" / "fixture"
    if not (model_dir / "config.json").exists():
        print(f"building the fixture target model in {model_dir} ...", flush=True)
        build_fixture_model(model_dir, seed=0)
    data_dir = work_dir / "data"
    if not (data_dir / "arith.jsonl").exists():
        written = write_sample_data(data_dir, seed=0)
        print(f"wrote sample data: {', '.join(str(p) for p in written.values())}")
    config = demo_config(work_dir, args.set)
    result = _run_pipeline(config, "evaluate", args.refresh_from)
    _print_run(result, time.time() - started)
    stages = result["stages"]
    print(f"draft model:  {Path(stages['train']['path']) / 'draft'}")
    print(f"report:       {Path(stages['evaluate']['path']) / 'report.json'}")
    evaluation = result["evaluation"]
    print(
        f"acceptance length tau = {evaluation['tau']:.3f} "
        f"(untrained draft: {evaluation['untrained_tau']:.3f})"
    )
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    started = time.time()
    config = load_config(args.config, args.set)
    result = _run_pipeline(config, args.until, args.refresh_from, args.retry_failed)
    _print_run(result, time.time() - started)
    if result["evaluation"]:
        print(f"acceptance length tau = {result['evaluation']['tau']:.3f}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Preflight: config, files, endpoints, one raw response, the reasoning split, disk."""
    import shutil

    from eaglet.canary import run_canary
    from eaglet.datasets import read_samples
    from eaglet.prompts import PromptError, render_prompt
    from eaglet.target import load_tokenizer

    config = load_config(args.config, args.set)
    print(f"config {args.config}: valid")
    problems = []
    for spec in config.datasets:
        if spec.path.endswith((".json", ".jsonl", ".parquet")) and not Path(spec.path).exists():
            problems.append(f"dataset {spec.source}: file {spec.path} not found")
    work_dir = Path(config.work_dir)
    existing = next((p for p in [work_dir, *work_dir.parents] if p.exists()), Path("."))
    free_gib = shutil.disk_usage(existing).free / 2**30
    print(f"disk: {free_gib:.1f} GiB free under {existing.resolve()}")
    if free_gib < 1:
        problems.append(f"less than 1 GiB free for {work_dir}")
    tokenizer = load_tokenizer(config.target)
    prompts = []
    wanted = config.generation.canary_requests
    for spec in config.datasets:
        if len(prompts) >= wanted or any(p.startswith(f"dataset {spec.source}") for p in problems):
            continue
        for sample in read_samples(spec.model_copy(update={"limit": wanted})):
            try:
                prompts.append(
                    render_prompt(sample, tokenizer, config.tokenize.chat_template_kwargs)
                )
            except PromptError as exc:
                problems.append(str(exc))
    api_key = None
    if config.generation.api_key_secret:
        from tasks.generate import secret_api_key  # Prefect blocks live outside the core

        api_key = secret_api_key(config)
    report = run_canary(config, tokenizer, prompts[:wanted], api_key=api_key)
    print(report.render())
    if not report.ok:
        problems.append("the canary failed (see above)")
    for problem in problems:
        print(f"problem: {problem}")
    print("doctor: ok" if not problems else f"doctor: {len(problems)} problem(s)")
    return 1 if problems else 0


def _stage_status(work_dir: Path, stage: str, run_keys: dict[str, str]) -> dict[str, Any]:
    folder = work_dir / stage
    if not folder.is_dir():
        return {"status": "missing", "key": "", "path": "", "records": 0}
    complete = [m for m in (read_manifest(p) for p in folder.iterdir() if p.is_dir()) if m]
    partials = [p for p in folder.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]
    chosen = next((m for m in complete if m.key == run_keys.get(stage)), None)
    if chosen is None and complete:
        chosen = max(complete, key=lambda m: m.finished)
    newest_partial = max(partials, key=lambda p: p.stat().st_mtime, default=None)
    if newest_partial is not None and (
        chosen is None or newest_partial.stat().st_mtime > chosen.finished
    ):
        key = newest_partial.name[: -len(PARTIAL_SUFFIX)]
        return {"status": "partial", "key": key, "path": str(newest_partial), "records": 0}
    if chosen is None:
        return {"status": "missing", "key": "", "path": "", "records": 0}
    return {
        "status": "complete",
        "key": chosen.key,
        "path": chosen.path,
        "records": chosen.counts.get("records", 0),
        "counts": chosen.counts,
        "finished": chosen.finished,
    }


def inspect_work_dir(work_dir: Path) -> dict[str, Any]:
    run_file = work_dir / "run.json"
    run_keys = {}
    if run_file.exists():
        run_keys = {s: v["key"] for s, v in json.loads(run_file.read_text())["stages"].items()}
    stages = {stage: _stage_status(work_dir, stage, run_keys) for stage in STAGES}
    quality: dict[str, Any] = {}
    if stages["extract"]["status"] == "complete":
        quality_file = Path(stages["extract"]["path"]) / "quality.json"
        if quality_file.exists():
            quality = json.loads(quality_file.read_text())
    evaluation: dict[str, Any] = {}
    if stages["evaluate"]["status"] == "complete":
        report = json.loads((Path(stages["evaluate"]["path"]) / "report.json").read_text())
        evaluation = {
            "tau": report["tau"],
            "untrained_tau": report["untrained_tau"],
            "prompts": report["prompts"],
            "per_position_acceptance": report["draft"].get("per_position_acceptance", []),
        }
    return {
        "work_dir": str(work_dir.resolve()),
        "stages": stages,
        "quality": quality,
        "evaluation": evaluation,
    }


def show_sample(report: dict[str, Any], sample_id: str) -> int:
    """Print one example with its loss mask: what the draft is trained on, span by span."""
    from eaglet.config import TargetConfig
    from eaglet.extract import render_loss_mask
    from eaglet.reasoning import detect_format
    from eaglet.records.examples import Example
    from eaglet.records.io import read_jsonl
    from eaglet.target import end_token_ids, load_tokenizer

    extract = report["stages"]["extract"]
    if extract["status"] != "complete":
        print("the extract stage is not complete in this work dir", file=sys.stderr)
        return 2
    manifest = read_manifest(Path(extract["path"]))
    example = next(
        (
            e
            for e in read_jsonl(Path(extract["path"]) / "examples.jsonl", Example)
            if e.sample_id == sample_id
        ),
        None,
    )
    if example is None:
        print(f"no example with sample_id {sample_id} in {extract['path']}", file=sys.stderr)
        return 2
    target = TargetConfig(model=manifest.info["target_model"])
    tokenizer = load_tokenizer(target)
    reasoning_format = detect_format(tokenizer, manifest.config["reasoning"]["format"])
    end_ids = set(end_token_ids(target, tokenizer))
    print(render_loss_mask(example, tokenizer, reasoning_format, end_ids, sys.stdout.isatty()))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    work_dir = Path(args.work_dir)
    if not work_dir.is_dir():
        print(f"no such work dir: {work_dir}", file=sys.stderr)
        return 2
    report = inspect_work_dir(work_dir)
    if args.sample:
        return show_sample(report, args.sample)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(f"work dir {report['work_dir']}")
    for stage, figures in report["stages"].items():
        print(
            f"  {stage:<14} {figures['status']:<9} {figures['records']:>6} records  "
            f"{figures['key'] or '-'}"
        )
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
    if report["evaluation"]:
        e = report["evaluation"]
        print(
            f"evaluation: tau {e['tau']:.3f} (untrained {e['untrained_tau']:.3f}) "
            f"on {e['prompts']} held-out prompts"
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from deployments.serve import main as serve

    serve()
    return 0


def cmd_fixture_model(args: argparse.Namespace) -> int:
    from eaglet.fixture.model import build_fixture_model

    started = time.time()
    path = build_fixture_model(Path(args.out_dir), seed=args.seed)
    print(f"fixture model written to {path} in {time.time() - started:.1f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglet", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="fixture model + sample data, then the whole pipeline")
    demo.add_argument("--work-dir", default="runs/demo")
    demo.add_argument("--refresh-from", choices=STAGES)
    demo.add_argument("--set", action="append", default=[], metavar="a.b=value")
    demo.set_defaults(handler=cmd_demo)

    run = commands.add_parser("run", help="run the pipeline from a YAML config")
    run.add_argument("config")
    run.add_argument("--until", choices=STAGES, default="evaluate")
    run.add_argument("--refresh-from", choices=STAGES)
    run.add_argument(
        "--retry-failed",
        action="store_true",
        help="send the samples the generate stage recorded as failed again, keeping the rest",
    )
    run.add_argument("--set", action="append", default=[], metavar="a.b=value")
    run.set_defaults(handler=cmd_run)

    doctor = commands.add_parser("doctor", help="preflight checks of a config")
    doctor.add_argument("config")
    doctor.add_argument("--set", action="append", default=[], metavar="a.b=value")
    doctor.set_defaults(handler=cmd_doctor)

    inspect = commands.add_parser("inspect", help="per stage: status, key, path, counts")
    inspect.add_argument("work_dir")
    inspect.add_argument("--json", action="store_true")
    inspect.add_argument("--sample", metavar="ID", help="show one example's loss mask")
    inspect.set_defaults(handler=cmd_inspect)

    serve = commands.add_parser("serve", help="serve the deployments for the Prefect UI")
    serve.set_defaults(handler=cmd_serve)

    fixture = commands.add_parser("fixture-model", help="build the tiny reasoning target model")
    fixture.add_argument("out_dir")
    fixture.add_argument("--seed", type=int, default=0)
    fixture.set_defaults(handler=cmd_fixture_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a failed stage: its message says what and where
        if args.command not in ("demo", "run"):
            raise
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(
            "finished stages are kept; fix the cause and run the same command again",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
