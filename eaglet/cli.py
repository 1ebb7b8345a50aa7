"""The `eaglet` command: demo, run, doctor, inspect, fixture-model.

Prefect and the flows are imported only by the commands that run the pipeline, so `inspect`
and `fixture-model` start fast and the core stays free of Prefect.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import ctypes.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from eaglet import work_dir_lock
from eaglet.config import ConfigError, PipelineConfig, load_config
from eaglet.fixture.real_shape import SHAPES as REAL_SHAPES
from eaglet.preflight import PreflightError, run_preflight_ahead
from eaglet.run_report import percent, training_line
from eaglet.stages import STAGES
from eaglet.storage import PARTIAL_SUFFIX, Manifest, ManifestError, read_manifest, verify_files

# `eaglet run`/`demo` on a work dir another run holds: EX_TEMPFAIL, try again later.
WORK_DIR_LOCKED_EXIT = 75


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGKILL when `parent` dies, even by kill -9 (Linux's
    PR_SET_PDEATHSIG; elsewhere a no-op)."""

    def preexec() -> None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class TemporaryPrefectServer:
    """The Prefect API server of a run started without PREFECT_API_URL: Prefect's own temporary
    server (uvicorn serving `prefect.server.api.server:create_app`, no UI, the database in
    PREFECT_HOME), started by eaglet so that

    - it starts first, before eaglet imports Prefect, the flows and torch (tens of seconds on
      a loaded machine), and comes up while they load (Prefect's own starts after them, and
      only when the flow is called);
    - it is in its own session: a signal to eaglet's process group (Ctrl-C, `timeout`,
      scancel) leaves it up, so the interrupted flow run is still marked Crashed, and eaglet
      stops it at exit, after Prefect has sent its last logs;
    - it dies with eaglet even on kill -9 (PR_SET_PDEATHSIG, set from the main thread: the
      hook follows the thread that forked).

    The run uses it as any server at PREFECT_API_URL (set for this process and its children)."""

    STARTUP_TIMEOUT_S = 120  # Prefect's 20 s default is short for a busy machine
    running: ClassVar[list[TemporaryPrefectServer]] = []

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.started = 0.0

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> None:
        import importlib.util
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        spec = importlib.util.find_spec("prefect")  # its folder, without importing it
        assert spec is not None and spec.origin is not None
        app_dir = str(Path(spec.origin).parent.parent)
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "uvicorn", "--app-dir", app_dir,
                "--factory", "prefect.server.api.server:create_app",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "error", "--lifespan", "on",
            ],
            env={
                **os.environ,
                "PREFECT_UI_ENABLED": "0",
                "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1",
            },
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )  # fmt: skip
        if self not in self.running:
            self.running.append(self)
            atexit.register(self.stop)  # before Prefect's exit hooks, so it runs after them

    def wait(self) -> None:
        """Until the server answers /health; a server that exits at start (its port taken
        meanwhile) is started again on another port."""
        import httpx

        configured = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "0")
        timeout = max(float(configured or 0), self.STARTUP_TIMEOUT_S)
        restarts = 0
        with httpx.Client(timeout=5) as client:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    if restarts >= 3:
                        raise RuntimeError(
                            f"the temporary Prefect server exited with {self.process.returncode}"
                            " while starting; set PREFECT_API_URL to a running server instead"
                        )
                    restarts += 1
                    self.start()
                    continue
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() - self.started > timeout:
                    raise RuntimeError(
                        f"the temporary Prefect server did not answer within {timeout:.0f} s; "
                        "set PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher, or "
                        "PREFECT_API_URL to a running server"
                    )
                time.sleep(0.1)

    def stop(self, grace_s: float = 5.0) -> None:
        from eaglet import shutdown

        grace_s = min(grace_s, max(0.5, shutdown.time_left() - 1.5))  # after SIGINT/SIGTERM
        process, self.process = self.process, None
        if self in self.running:
            self.running.remove(self)
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _run_pipeline(
    config: PipelineConfig, until: str, refresh_from: str | None, retry_failed: bool = False
) -> dict:
    from eaglet import shutdown

    # Offline clusters are common: Prefect's usage telemetry would only log resolver errors.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    server = None
    # From the main thread only: PR_SET_PDEATHSIG would fire when another thread exits.
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread and not os.environ.get("PREFECT_API_URL") and not _profile_api_url():
        server = TemporaryPrefectServer()
        server.start()  # it comes up while the imports below run
    shutdown.set_stage("the preflight")
    try:
        run_preflight_ahead(config)  # a problem fails here in seconds, no flow run started
    except PreflightError:
        if server is not None:
            server.stop()
        raise
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import pipeline

    if server is not None and PREFECT_API_URL.value():  # a server set elsewhere (prefect.toml)
        server.stop()
        server = None
    if server is None:
        return pipeline(
            config=config, until=until, refresh_from=refresh_from, retry_failed=retry_failed
        )
    server.wait()
    os.environ["PREFECT_API_URL"] = server.api_url  # for the processes the run starts
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            return pipeline(
                config=config, until=until, refresh_from=refresh_from, retry_failed=retry_failed
            )
    finally:
        del os.environ["PREFECT_API_URL"]  # the server stops at exit, after Prefect's hooks


def _profile_api_url() -> str | None:
    """PREFECT_API_URL set in the active Prefect profile (`prefect config set`), read without
    importing Prefect: a running server the run uses instead of a temporary one."""
    import tomllib

    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return None
    name = os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
    url = profiles.get("profiles", {}).get(name, {}).get("PREFECT_API_URL")
    return str(url) if url else None


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
    return load_config(
        None,
        [
            f"work_dir={work_dir}",
            f"target.model={moved(defaults.target.model)}",
            f"datasets=[{datasets}]",
            *overrides,
        ],
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from eaglet.fixture.demo import ensure_demo_inputs

    started = time.time()
    config = demo_config(Path(args.work_dir), args.set)
    with work_dir_lock.held(config.work_dir):  # a second run fails here, before any start-up
        ensure_demo_inputs(config)
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
    args.run_started, args.loaded_config = started, config  # for main's error report
    with work_dir_lock.held(config.work_dir):  # a second run fails here, before any start-up
        result = _run_pipeline(config, args.until, args.refresh_from, args.retry_failed)
    _print_run(result, time.time() - started)
    if result["evaluation"]:
        print(f"acceptance length tau = {result['evaluation']['tau']:.3f}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Preflight checks of a config (eaglet/preflight.py: files, target, layer ids, template,
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
    from eaglet.prompts import render_prompt

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
        from tasks.generate import secret_api_key  # Prefect blocks live outside the core

        try:
            api_key = secret_api_key(config)
        except ValueError as exc:
            return [*problems, str(exc)]
    report = run_canary(config, tokenizer, prompts[:wanted], api_key=api_key)
    print(report.render())
    if not report.ok:
        problems.append("the canary failed (see above)")
    return problems


def _stage_status(
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
    # The folder the last run used wins; a newer partial folder only where no run names one.
    used = chosen is not None and chosen.key == wanted
    if newest_partial is not None and (
        chosen is None or (not used and newest_partial.stat().st_mtime > chosen.finished)
    ):
        key = newest_partial.name[: -len(PARTIAL_SUFFIX)]
        return {
            "status": "partial",
            "key": key,
            "path": str(newest_partial.resolve()),
            "records": 0,
        }
    if chosen is None and unreadable:
        key, problem = next(iter(sorted(unreadable.items())))
        path = str((folder / key).resolve())
        return {"status": "corrupt", "key": key, "path": path, "records": 0, "problems": [problem]}
    if chosen is None:
        return {"status": "missing", "key": "", "path": "", "records": 0}
    stage_path = chosen.folder_in(work_dir).resolve()
    problems = verify_files(stage_path, chosen, verify)
    return {
        "status": "corrupt" if problems else "complete",
        "key": chosen.key,
        "path": str(stage_path),
        "records": chosen.counts.get("records", 0),
        "counts": chosen.counts,
        "finished": chosen.finished,
        **({"problems": problems} if problems else {}),
    }


def inspect_work_dir(work_dir: Path, verify: str = "size") -> dict[str, Any]:
    """Per stage: status, key, absolute path, counts; quality and evaluation figures.
    `verify` = "size" checks file sizes against each manifest, "full" their sha256 too."""
    run_file = work_dir / "run.json"
    run_keys = {}
    try:
        stages_run = json.loads(run_file.read_text())["stages"] if run_file.exists() else {}
        run_keys = {s: v["key"] for s, v in stages_run.items() if "key" in v}
    except (ValueError, KeyError, TypeError, AttributeError):
        pass  # a run.json cut short by a crash: every stage shows its newest folder
    stages = {stage: _stage_status(work_dir, stage, run_keys, verify) for stage in STAGES}
    quality: dict[str, Any] = {}
    if stages["extract"]["status"] == "complete":
        quality_file = Path(stages["extract"]["path"]) / "quality.json"
        if quality_file.exists():
            quality = json.loads(quality_file.read_text())
    training: dict[str, Any] = {}
    if stages["train"]["status"] == "complete":
        info = read_manifest(Path(stages["train"]["path"])).info
        training = {
            key: info[key]
            for key in (
                "hidden_states_mode",
                "feature_bytes_stored",
                "feature_bytes_saved",
                "feature_bytes_saved_storage",
                "best_epoch",  # train.keep_best: the exported draft's epoch
            )
            if info.get(key) is not None
        }
    evaluation: dict[str, Any] = {}
    if stages["evaluate"]["status"] == "complete":
        report = json.loads((Path(stages["evaluate"]["path"]) / "report.json").read_text())
        evaluation = {
            "tau": report["tau"],
            "untrained_tau": report["untrained_tau"],
            **({"emitted_tau": report["emitted_tau"]} if "emitted_tau" in report else {}),
            "prompts": report["prompts"],
            "per_position_acceptance": report["draft"].get("per_position_acceptance", []),
        }
    return {
        "work_dir": str(work_dir.resolve()),
        "stages": stages,
        "quality": quality,
        "training": training,
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
    if not (work_dir / "run.json").exists() and not any(
        (work_dir / stage).is_dir() for stage in STAGES
    ):
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
        for problem in figures.get("problems", []):
            print(f"      {problem}")
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
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    api_url = os.environ.get("PREFECT_API_URL") or _profile_api_url()
    if api_url and not _wait_for_server(api_url, SERVER_WAIT_S):
        print(
            f"error: no Prefect server answers at PREFECT_API_URL={api_url} after "
            f"{SERVER_WAIT_S} s: start one (`prefect server start`) or fix the URL",
            file=sys.stderr,
        )
        return 2
    from deployments.serve import main as serve

    serve()
    return 0


# `eaglet serve` right after `prefect server start --background`: the server needs seconds.
SERVER_WAIT_S = 120


def _wait_for_server(api_url: str, timeout_s: float) -> bool:
    """True once `api_url/health` answers 200 (saying once that it waits), False at the end
    of `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            if httpx.get(f"{api_url.rstrip('/')}/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return False
        if not said:
            print(f"waiting for the Prefect server at {api_url} ...", flush=True)
            said = True
        time.sleep(1)


def cmd_fixture_model(args: argparse.Namespace) -> int:
    from eaglet.fixture.model import build_fixture_model
    from eaglet.fixture.real_shape import MissingTokenizerPackage, build_real_shape_model

    started = time.time()
    if args.shape is None:
        if args.layers is not None or args.vocab_size is not None:
            print("error: --layers and --vocab-size go with --shape", file=sys.stderr)
            return 2
        path = build_fixture_model(Path(args.out_dir), seed=args.seed)
    else:
        try:
            path = build_real_shape_model(
                Path(args.out_dir), args.shape, args.layers, args.vocab_size, seed=args.seed
            )
        except (MissingTokenizerPackage, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
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
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="check every file's sha256 against its manifest (sizes are always checked)",
    )
    inspect.set_defaults(handler=cmd_inspect)

    serve = commands.add_parser("serve", help="serve the deployments for the Prefect UI")
    serve.set_defaults(handler=cmd_serve)

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
    fixture.add_argument("--layers", type=int, help="with --shape: fewer layers, same width")
    fixture.add_argument(
        "--vocab-size", type=int, help="with --shape: more embedding and lm_head rows"
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
    except Exception as exc:  # a failed stage: its message says what and where
        if args.command not in ("demo", "run"):
            raise
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(_after_failure(args), file=sys.stderr)
        return 1


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
