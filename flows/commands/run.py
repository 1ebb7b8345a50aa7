"""`eaglet demo` and `eaglet run` (with `--plan`): the pipeline flow run from the shell, under
the work dir's lock, on the Prefect server `PREFECT_API_URL` names or a temporary one the
command starts; the preflight first, in seconds, before Prefect loads."""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from eaglet import shutdown, work_dir_lock
from eaglet.config import PipelineConfig, load_config
from eaglet.preflight import PreflightError, preflight, run_preflight_ahead
from eaglet.stages import DRAFT_FOLDER, PRODUCER, REPORT_FILE, STAGES
from eaglet_prefect.flows.prefect_server import (
    TemporaryPrefectServer,
    check_credentials,
    profile_setting,
)

# `eaglet run`/`demo` on a work dir another run holds: EX_TEMPFAIL, try again later.
WORK_DIR_LOCKED_EXIT = 75
# `make vllm-venv`'s python, in the checkout the demo runs in
VLLM_VENV_PYTHON = ".vllm-venv/bin/python"


class _WithoutTraceback(logging.Formatter):
    """Formats a record as `inner` does, leaving out its exception's traceback."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def console_without_tracebacks() -> None:
    """Prefect's console lines without tracebacks: a failed stage logs its error in one line,
    and the CLI ends on eaglet's own `error:` line with what to do. The tracebacks stay in
    the run's logs in the Prefect UI (its API handler is untouched); EAGLET_TRACEBACKS=1 shows
    them here too."""
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", []):
            if type(handler).__name__ != "PrefectConsoleHandler":
                continue
            if not isinstance(handler.formatter, _WithoutTraceback):
                handler.setFormatter(_WithoutTraceback(handler.formatter or logging.Formatter()))


def _run_pipeline(
    config: PipelineConfig, until: str, refresh_from: str | None, retry_failed: bool = False
) -> dict:
    # Offline clusters are common: Prefect's usage telemetry would only log resolver errors.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    server = None
    api_url = os.environ.get("PREFECT_API_URL") or profile_setting("PREFECT_API_URL")
    if api_url:  # a server that wants credentials this client lacks: said now, nothing ran
        check_credentials(api_url)
    # From the main thread only: PR_SET_PDEATHSIG would fire when another thread exits.
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread and not api_url:
        server = TemporaryPrefectServer()
        server.start()  # it comes up while the imports below run
    shutdown.set_stage("the preflight")
    try:
        run_preflight_ahead(config, until)  # a problem fails here in seconds, no flow run started
    except PreflightError:
        if server is not None:
            server.stop()
        raise
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from eaglet_prefect.flows.pipeline import pipeline

    if not os.environ.get("EAGLET_TRACEBACKS"):
        console_without_tracebacks()

    if server is not None and PREFECT_API_URL.value():  # a server set elsewhere (prefect.toml)
        server.stop()
        server = None

    def run() -> dict:  # the flow returns a State; called, it gives the State's data
        return pipeline(  # type: ignore[return-value]
            config=config, until=until, refresh_from=refresh_from or "", retry_failed=retry_failed
        )

    if server is None:
        return run()
    server.wait()
    os.environ["PREFECT_API_URL"] = server.api_url  # for the processes the run starts
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            return run()
    finally:
        del os.environ["PREFECT_API_URL"]  # the server stops at exit, after Prefect's hooks


def _print_run(result: dict, seconds: float) -> None:
    for stage, figures in result["stages"].items():
        print(
            f"  {stage:<14} {figures['state']:<10} {figures['records']:>6} records  "
            f"{figures['seconds']:>7.1f} s  {figures['path']}"
        )
    print(f"pipeline finished in {seconds:.1f} s")


def demo_config(
    work_dir: Path = Path("runs/demo"), overrides: Sequence[str] = ()
) -> PipelineConfig:
    """The demo is the defaults: `PipelineConfig()` (the UI form's defaults too), with its
    folders moved under `work_dir` when that is not the default `runs/demo`. One config, so a
    Quick run after `eaglet demo` finds every stage Cached."""
    defaults = PipelineConfig()
    base = Path(defaults.work_dir)

    def moved(path: str) -> Path:
        return Path(work_dir) / Path(path).relative_to(base)

    datasets = ", ".join(
        f"{{source: {d.source}, path: {moved(d.path)}}}" for d in defaults.datasets
    )
    sets = ", ".join(f"{{name: {s.name}, path: {moved(s.path)}}}" for s in defaults.evaluate.sets)
    return load_config(
        None,
        [
            f"work_dir={work_dir}",
            f"target.model={moved(defaults.target.model)}",
            f"datasets=[{datasets}]",
            f"evaluate.sets=[{sets}]",
            *_demo_vllm(overrides),
            *overrides,
        ],
    )


def _demo_vllm(overrides: Sequence[str]) -> list[str]:
    """`eaglet demo --set evaluate.serving=vllm` in a checkout where `make test` (or `make
    vllm-venv`) made the vLLM venv: the served check starts its servers with that venv's
    python, unless the overrides name a python or an endpoint."""
    settings = dict(o.split("=", 1) for o in overrides if "=" in o)
    venv_python = Path(VLLM_VENV_PYTHON)
    if settings.get("evaluate.serving", "").strip() != "vllm" or not venv_python.exists():
        return []
    if {"evaluate.vllm_python", "evaluate.serving_endpoint"} & set(settings):
        return []
    return [f"evaluate.vllm_python={venv_python.absolute()}"]  # not resolved: the venv's link


def cmd_demo(args: argparse.Namespace) -> int:
    started = time.time()
    config = demo_config(Path(args.work_dir), args.set)
    with work_dir_lock.held(config.work_dir):  # a second run fails here, before any start-up
        result = _run_pipeline(config, STAGES[-1], args.refresh_from)
    _print_run(result, time.time() - started)
    stages = result["stages"]
    print(f"draft model:  {Path(stages[PRODUCER['draft']]['path']) / DRAFT_FOLDER}")
    print(f"report:       {Path(stages[PRODUCER['report']]['path']) / REPORT_FILE}")
    evaluation = result["evaluation"]
    print(
        f"acceptance length tau = {evaluation['tau']:.3f} "
        f"(untrained draft: {evaluation['untrained_tau']:.3f})"
    )
    return 0


def print_plan(config: PipelineConfig, until: str, refresh_from: str | None) -> int:
    """`eaglet run --plan`: the preflight and the lock first, as the run meets them, then per
    stage Cached or why it runs; nothing runs, no lock taken. 2 when the preflight would
    refuse the run (then no stage would run, and none is listed)."""
    from eaglet.stage_reasons import plan_run

    print(f"plan for {config.work_dir} (nothing runs):")
    report = preflight(config, until)
    if report.problems:
        print("preflight: the run would be refused before any stage:")
        for problem in report.problems:
            print(f"  problem: {problem}")
        return 2
    print("preflight: ok")
    if work_dir_lock.is_held(config.work_dir):
        holder = work_dir_lock.describe(work_dir_lock.read_holder(config.work_dir))
        print(f"lock: another run holds the work dir now ({holder}): `eaglet run` would exit "
              f"{WORK_DIR_LOCKED_EXIT} at once, a run from the UI would wait for it")  # fmt: skip
    for stage in plan_run(config, until, refresh_from):
        print(stage.line())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    started = time.time()
    config = load_config(args.config, args.set)
    if args.plan:
        return print_plan(config, args.until, args.refresh_from)
    args.run_started, args.loaded_config = started, config  # for main's error report
    from eaglet.draft.launch import held_or_joined

    with held_or_joined(config) as joined:  # a second run fails here (or joins: train.nnodes)
        if joined is not None:
            return joined
        result = _run_pipeline(config, args.until, args.refresh_from, args.retry_failed)
    _print_run(result, time.time() - started)
    if result["evaluation"]:
        print(f"acceptance length tau = {result['evaluation']['tau']:.3f}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help="fixture model + sample data, then the whole pipeline")
    demo.add_argument("--work-dir", default="runs/demo")
    demo.add_argument("--refresh-from", choices=STAGES)
    demo.add_argument("--set", action="append", default=[], metavar="a.b=value")
    demo.set_defaults(handler=cmd_demo)

    run = commands.add_parser("run", help="run the pipeline from a YAML config")
    run.add_argument("config")
    run.add_argument("--until", choices=STAGES, default=STAGES[-1])
    run.add_argument("--refresh-from", choices=STAGES)
    run.add_argument(
        "--retry-failed",
        action="store_true",
        help="send the samples the generate stage recorded as failed again, keeping the rest",
    )
    run.add_argument("--set", action="append", default=[], metavar="a.b=value")
    run.add_argument(
        "--plan",
        action="store_true",
        help="print per stage whether it is Cached or why it would run, and run nothing",
    )
    run.set_defaults(handler=cmd_run)
