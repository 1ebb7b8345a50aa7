"""The `eaglet` command: demo, run, doctor, inspect, serve, fixture-model.

Prefect and the flow are imported only by the commands that run the pipeline, so `inspect`
and `fixture-model` start fast. The temporary Prefect server is `flows.prefect_server`; what
`inspect` reads is the core's `eaglet.work_dir_status`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from eaglet import work_dir_lock
from eaglet.config import ConfigError, PipelineConfig, load_config
from eaglet.draft.sampled import sampled_text
from eaglet.draft.segments import segments_text
from eaglet.eval_sets import EvalSetError
from eaglet.fixture.corpus import CORPORA
from eaglet.fixture.demo import ensure_demo_inputs
from eaglet.fixture.real_shape import SHAPES as REAL_SHAPES
from eaglet.fixture.real_tokenizers import TOKENIZERS as REAL_TOKENIZERS
from eaglet.preflight import PreflightError, run_preflight_ahead
from eaglet.run_report import percent, training_line
from eaglet.stages import DRAFT_FOLDER, PRODUCER, REPORT_FILE, STAGES
from eaglet.work_dir_status import inspect_work_dir, is_work_dir, show_sample
from eaglet_prefect.flows.prefect_server import (
    SERVER_WAIT_S,
    CredentialsRefused,
    TemporaryPrefectServer,
    check_credentials,
    profile_api_url,
    server_wait_s,
    wait_for_server,
)

# `eaglet run`/`demo` on a work dir another run holds: EX_TEMPFAIL, try again later.
WORK_DIR_LOCKED_EXIT = 75


class _WithoutTraceback(logging.Formatter):
    """Formats a record as `inner` does, leaving out its exception's traceback."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        if not record.exc_info and not record.exc_text:
            return self.inner.format(record)
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
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if type(handler).__name__ != "PrefectConsoleHandler":
                continue
            if not isinstance(handler.formatter, _WithoutTraceback):
                handler.setFormatter(_WithoutTraceback(handler.formatter or logging.Formatter()))


def _run_pipeline(
    config: PipelineConfig, until: str, refresh_from: str | None, retry_failed: bool = False
) -> dict:
    from eaglet import shutdown

    # Offline clusters are common: Prefect's usage telemetry would only log resolver errors.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A config pointing at the demo's model and data (`eaglet demo`'s): they are built first,
    # before the temporary server starts; the preflight below only checks.
    ensure_demo_inputs(config)
    server = None
    api_url = os.environ.get("PREFECT_API_URL") or profile_api_url()
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
    parameters = dict(
        config=config, until=until, refresh_from=refresh_from or "", retry_failed=retry_failed
    )
    if server is None:
        return pipeline(**parameters)
    server.wait()
    os.environ["PREFECT_API_URL"] = server.api_url  # for the processes the run starts
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            return pipeline(**parameters)
    finally:
        del os.environ["PREFECT_API_URL"]  # the server stops at exit, after Prefect's hooks


def _print_run(result: dict, seconds: float) -> None:
    for stage, figures in result["stages"].items():
        print(
            f"  {stage:<14} {figures['state']:<10} {figures['records']:>6} records  "
            f"{figures['seconds']:>7.1f} s  {figures['path']}"
        )
    print(f"pipeline finished in {seconds:.1f} s")


def demo_config(work_dir: Path = Path("runs/demo"), overrides: list[str] = ()) -> PipelineConfig:
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
            *overrides,
        ],
    )


def cmd_demo(args: argparse.Namespace) -> int:
    started = time.time()
    config = demo_config(Path(args.work_dir), args.set)
    with work_dir_lock.held(config.work_dir):  # a second run fails here, before any start-up
        result = _run_pipeline(config, STAGES[-1], args.refresh_from)  # builds the inputs
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
    from eaglet.preflight import preflight
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
    with work_dir_lock.held(config.work_dir):  # a second run fails here, before any start-up
        result = _run_pipeline(config, args.until, args.refresh_from, args.retry_failed)
    _print_run(result, time.time() - started)
    if result["evaluation"]:
        print(f"acceptance length tau = {result['evaluation']['tau']:.3f}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """τ of any draft folder (eaglet's exports, speculators' layout, a vLLM EAGLE-3, P-EAGLE or
    DFlash checkpoint) on the config's evaluation sets, without training: a published draft
    and your own side by side on the same prompts (the same sha256). A draft that cannot be
    scored (not a draft, weights cut short, NaN or inf in them) is refused in one line."""
    from eaglet.draft.set_evaluation import evaluate_sets
    from eaglet.preflight.train import draft_folder_problem
    from eaglet.target import end_token_ids, load_tokenizer

    config = load_config(args.config, args.set)
    draft = Path(args.draft)
    problem = draft_folder_problem(draft)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.config is None and not Path(config.target.model).exists():
        print(f"error: no --config, and the demo's target {config.target.model} is not "
              "here (run `eaglet demo` first, or give --config CONFIG.yaml)",
              file=sys.stderr)  # fmt: skip
        return 2
    if not config.evaluate.sets:
        print("error: no evaluate.sets to measure: --set 'evaluate.sets=[{name: gsm8k, "
              "path: gsm8k.jsonl}]' or a config with them", file=sys.stderr)  # fmt: skip
        return 2
    tokenizer = load_tokenizer(config.target)
    eos = end_token_ids(config.target, tokenizer)
    try:
        report = evaluate_sets(
            config.evaluate.sets, draft, config.target, tokenizer, config.evaluate,
            config.tokenize.chat_template_kwargs, eos, progress=print,
        )  # fmt: skip
    except (EvalSetError, KeyError, ValueError, RuntimeError, OSError) as exc:
        print(f"error: {draft} cannot be scored against {config.target.model}: "
              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc!r}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.json:
        print(json.dumps({"draft": str(draft.resolve()), "sets": report}, indent=2))
        return 0
    print(f"draft {draft.resolve()} ({next(iter(report.values()))['method']})")
    for name, figures in report.items():
        left_out = figures.get("skipped", [])
        skipped = f", {len(left_out)} over the context left out" if left_out else ""
        print(
            f"  {name:<12} τ {figures['tau']:.3f}  emitted τ {figures['emitted_tau']:.3f}  "
            f"{figures['rounds']} rounds, {figures['prompts']} prompts{skipped}, k "
            f"{figures['num_speculative_tokens']}, sha256 {figures['prompts_sha256'][:16]}"
        )
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Preflight checks of a config (eaglet/preflight/: files, target, layer ids, template,
    lengths, disk), then the canary against its servers with the canary's own limits. Every
    finding is one line naming the key or file and what to do; never a traceback."""
    from eaglet.preflight import preflight

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
    for problem in problems:
        print(f"problem: {problem}")
    print("doctor: ok" if not problems else f"doctor: {len(problems)} problem(s)")
    return 1 if problems else 0


def _doctor_canary(config: PipelineConfig, tokenizer: Any) -> list[str]:
    """Render the first `generation.canary_requests` samples and run the canary on them;
    the problems found (the canary's own report is printed)."""
    from eaglet.canary import run_canary
    from eaglet.datasets import read_samples
    from eaglet.prompt_rendering import render_prompt

    problems: list[str] = []
    prompts = []
    wanted = config.generation.canary_requests
    for i, spec in enumerate(config.datasets):
        if len(prompts) >= wanted:
            break
        try:
            for sample in read_samples(spec.model_copy(update={"limit": wanted})):
                prompts.append(
                    render_prompt(sample, tokenizer, config.tokenize.chat_template_kwargs)
                )
        except Exception as exc:  # DatasetError, PromptError, a template that raises
            problems.append(f"datasets[{i}] (source {spec.source!r}): {exc}")
    api_key = None
    if config.generation.api_key_secret:
        # Prefect blocks live outside the core
        from eaglet_prefect.tasks.generate import secret_api_key

        try:
            api_key = secret_api_key(config)
        except ValueError as exc:
            return [*problems, str(exc)]
    report = run_canary(config, tokenizer, prompts[:wanted], api_key=api_key)
    print(report.render())
    if not report.ok:
        problems.append("the canary failed (see above)")
    return problems


def cmd_gc(args: argparse.Namespace) -> int:
    """List the stage folders nothing uses any more and their sizes; remove them with --yes."""
    from eaglet.hidden_states.budget import human
    from eaglet.work_dir_gc import NothingKnownInUse, remove, survey

    work_dir = Path(args.work_dir)
    if not work_dir.is_dir() or not is_work_dir(work_dir):
        print(f"error: {work_dir} is not a work dir eaglet ran in", file=sys.stderr)
        return 2
    with work_dir_lock.held(work_dir):  # never while a run uses the work dir
        try:
            found = survey(work_dir)
        except NothingKnownInUse as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for line in found.notes + found.held:
            print(f"note: {line}")
        for line in found.not_followed:
            print(f"not followed (a symlink): {line}")
        folders = found.superseded
        total = sum(f.bytes for f in folders)
        for item in folders:
            print(f"  {human(item.bytes):>10}  {item.folder.relative_to(work_dir)}")
        kept = f"{found.kept} folders in use kept (the current config's keys, the last run's)"
        if not folders:
            print(f"nothing to free in {work_dir}: {kept}")
        elif not args.yes:
            print(f"{len(folders)} folders, {human(total)}, that nothing uses; {kept}. Run "
                  "again with --yes to remove them")  # fmt: skip
        else:
            print(f"removed {len(folders)} folders, freed {human(remove(folders, work_dir))}")
    return 0


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
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A run submitted in the UI starts within ~2 s, not Prefect's 10 s poll (its first sign
    # of life on the run page, issue 38); set the variable to choose otherwise.
    os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "2")
    api_url = os.environ.get("PREFECT_API_URL") or profile_api_url()
    wait_s = server_wait_s(api_url) if api_url else 0
    if api_url and not wait_for_server(api_url, wait_s):
        starting = "" if wait_s == SERVER_WAIT_S else " (and no process here is starting one)"
        print(
            f"error: no Prefect server answers at PREFECT_API_URL={api_url} after "
            f"{wait_s:.0f} s{starting}: start one (`prefect server start`) or fix the URL",
            file=sys.stderr,
        )
        return 2
    if api_url:
        check_credentials(api_url)  # a team's server without its credentials: exit 2
    if args.notify and cmd_notify(args) != 0:
        return 2
    from eaglet_prefect.deployments.serve import main as serve

    serve()
    return 0


def cmd_notify(args: argparse.Namespace) -> int:
    """Create (or update) the automations that notify through the block `args.notify` when a
    run fails or crashes, and when one completes with its τ."""
    from eaglet_prefect.deployments.notifications import (
        NoSuchNotificationBlock,
        ensure_notifications,
    )

    if not args.notify:
        print("error: name a notification block (or set EAGLET_NOTIFY_BLOCK)", file=sys.stderr)
        return 2
    try:
        lines = ensure_notifications(args.notify)
    except NoSuchNotificationBlock as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


def cmd_fixture_model(args: argparse.Namespace) -> int:
    from eaglet.fixture.model import build_fixture_model
    from eaglet.fixture.real_shape import build_real_shape_model
    from eaglet.fixture.real_tokenizers import MissingTokenizerPackage

    started = time.time()
    if args.shape is None:
        if args.layers is not None or args.vocab_size is not None or args.tokenizer is not None:
            print("error: --layers, --vocab-size and --tokenizer go with --shape", file=sys.stderr)
            return 2
        if args.corpus != "fixture" and args.continue_from is None:
            print("error: --corpus goes with --continue-from", file=sys.stderr)
            return 2
        if args.continue_from is not None and not (args.continue_from / "fixture.json").is_file():
            print(f"error: --continue-from {args.continue_from} is not a fixture model folder",
                  file=sys.stderr)  # fmt: skip
            return 2
        path = build_fixture_model(
            Path(args.out_dir), seed=args.seed, train_steps=args.steps,
            continue_from=args.continue_from, corpus=args.corpus,
        )  # fmt: skip
    else:
        try:
            path = build_real_shape_model(
                Path(args.out_dir),
                args.shape,
                args.layers,
                args.vocab_size,
                seed=args.seed,
                tokenizer_family=args.tokenizer or "qwen3",
            )
        except (MissingTokenizerPackage, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(f"fixture model written to {path} in {time.time() - started:.1f} s")
    return 0


NOTIFY_ARGS = ("--notify",)
NOTIFY_OPTIONS = {"metavar": "BLOCK", "default": os.environ.get("EAGLET_NOTIFY_BLOCK") or None}
NOTIFY_HELP = (
    "a Prefect notification block (<type>/<name>, e.g. slack-webhook/team, or its name) to "
    "tell when a run fails or crashes, and when one completes with its τ; default: "
    "$EAGLET_NOTIFY_BLOCK"
)


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

    doctor = commands.add_parser("doctor", help="preflight checks of a config")
    doctor.add_argument("config")
    doctor.add_argument("--set", action="append", default=[], metavar="a.b=value")
    doctor.set_defaults(handler=cmd_doctor)

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

    evaluate = commands.add_parser(
        "eval", help="tau of any draft folder on the evaluation sets, without training"
    )
    evaluate.add_argument("draft", help="a draft folder (any format eaglet reads)")
    evaluate.add_argument("--config", default=None, help="a config (default: the demo's)")
    evaluate.add_argument("--set", action="append", default=[], metavar="a.b=value")
    evaluate.add_argument("--json", action="store_true")
    evaluate.set_defaults(handler=cmd_eval)

    gc = commands.add_parser("gc", help="list (and with --yes remove) superseded stage folders")
    gc.add_argument("work_dir")
    gc.add_argument("--yes", action="store_true", help="remove what it lists")
    gc.set_defaults(handler=cmd_gc)

    serve = commands.add_parser("serve", help="serve the deployments for the Prefect UI")
    serve.add_argument(*NOTIFY_ARGS, **NOTIFY_OPTIONS, help=NOTIFY_HELP + " (optional)")
    serve.set_defaults(handler=cmd_serve)

    notify = commands.add_parser(
        "notify", help="notify through a Prefect block when a run fails, crashes or completes"
    )
    notify.add_argument("notify", nargs="?", **NOTIFY_OPTIONS, help=NOTIFY_HELP)
    notify.set_defaults(handler=cmd_notify)

    fixture = commands.add_parser(
        "fixture-model",
        help="build the tiny reasoning target model, or a random-weight one at a real shape",
    )
    fixture.add_argument("out_dir")
    fixture.add_argument("--seed", type=int, default=0)
    fixture.add_argument(
        "--shape",
        choices=REAL_SHAPES,
        help="a real model's shapes, random weights, its real tokenizer and chat template",
    )
    fixture.add_argument(
        "--continue-from", type=Path, metavar="FIXTURE",
        help="train a fixture model further (its tokenizer kept): a target that drifted",
    )  # fmt: skip
    fixture.add_argument(
        "--corpus", choices=CORPORA, default="fixture",
        help="what it trains on: the fixture's conversations, or 'restyled' (the same tasks, "
        "reasoning in other words; with --continue-from)",
    )  # fmt: skip
    fixture.add_argument("--steps", type=int, help="training steps (default 250; continued: 60)")
    fixture.add_argument("--layers", type=int, help="with --shape: fewer layers, same width")
    fixture.add_argument(
        "--vocab-size", type=int, help="with --shape: more embedding and lm_head rows"
    )
    fixture.add_argument(
        "--tokenizer",
        choices=REAL_TOKENIZERS,
        help="with --shape: the tokenizer family, its chat template and vocabulary "
        "(default qwen3; gpt-oss: o200k_harmony, 201,088 rows, the harmony format)",
    )
    fixture.set_defaults(handler=cmd_fixture_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in ("demo", "run"):
        return _run_command(args)
    from eaglet import shutdown

    # SIGINT/SIGTERM at any moment: a one-line message, exit 130/143 within seconds
    # (eaglet/shutdown.py); the stage interrupted resumes on the next run.
    with shutdown.handling():
        try:
            return _run_command(args)
        except shutdown.Interrupted as exc:
            return _interrupted(exc)


def _run_command(args: argparse.Namespace) -> int:
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PreflightError as exc:  # the config cannot run; nothing ran
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except work_dir_lock.WorkDirLocked as exc:  # nothing ran; the holder's run is untouched
        print(f"error: {exc}", file=sys.stderr)
        return WORK_DIR_LOCKED_EXIT
    except (work_dir_lock.WorkDirUnwritable, CredentialsRefused) as exc:  # nothing ran
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a failed stage: its message says what and where
        if args.command not in ("demo", "run"):
            raise
        print(f"error: {_failure_line(exc, args)}", file=sys.stderr)
        print(_after_failure(args), file=sys.stderr)
        return 1


def _failure_line(exc: BaseException, args: argparse.Namespace) -> str:
    """The last line of a failed run: the error as the stage said it; a full disk met outside
    a stage's folder (the run's records, Prefect's files) names the file and the work dir."""
    from eaglet.storage import DiskFullError, is_disk_full

    if is_disk_full(exc) and not isinstance(exc, DiskFullError):
        config = getattr(args, "loaded_config", None)
        where = getattr(exc, "filename", None) or (config.work_dir if config else "the work dir")
        return (
            f"DiskFullError: No space left on device while writing {where}: free space on its "
            "filesystem (or move work_dir), then run the same command again; finished stages "
            "are kept"
        )
    return f"{type(exc).__name__}: {exc}"


def _interrupted(exc: BaseException) -> int:
    """After SIGINT/SIGTERM (the flow run is already marked Crashed): Prefect's last logs sent,
    every process the run started stopped (the temporary Prefect server last), the one-line
    message, and the exit. The interpreter's own exit is skipped (`os._exit`): a stage's
    helper thread may still be inside torch, and finalizing the interpreter under it aborts
    the process ("terminate called without an active exception", SIGABRT)."""
    from eaglet import shutdown

    if "prefect" in sys.modules:
        try:
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=min(2.0, shutdown.time_left() / 4))
        except Exception:
            pass
    servers = {s.process.pid for s in TemporaryPrefectServer.running if s.process is not None}
    shutdown.stop_descendants(grace_s=min(2.0, shutdown.time_left() / 4), exclude=servers)
    for server in list(TemporaryPrefectServer.running):
        server.stop()
    shutdown.stop_descendants(grace_s=0.5)  # anything the server left
    code = exc.exit_code if isinstance(exc, shutdown.Interrupted) else 130
    print(str(exc), file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
    return code  # unreachable


def _after_failure(args: argparse.Namespace) -> str:
    """What a failed run left: the stages that finished in it (kept, reused by the next run),
    or that none did."""
    config = getattr(args, "loaded_config", None)
    if config is None:
        return "no stage ran; fix the cause and run the same command again"
    run_file = Path(config.work_dir) / "run.json"
    finished: list[str] = []
    try:
        if run_file.stat().st_mtime >= getattr(args, "run_started", 0):
            stages = json.loads(run_file.read_text())["stages"]
            finished = [s for s, e in stages.items() if e.get("state") in ("Completed", "Cached")]
    except (OSError, ValueError, KeyError, TypeError):
        finished = []
    if not finished:
        return "no stage finished; fix the cause and run the same command again"
    return (
        f"finished stages are kept ({', '.join(finished)}); fix the cause and run the same "
        "command again"
    )


if __name__ == "__main__":
    sys.exit(main())
