"""The `eaglet` command: demo, run, doctor, inspect, eval, gc, serve, notify, fixture-model.

Its parser is built from each subcommand's module (`flows/commands/`); this module holds the
exit codes and a failed run's last words.

Prefect and the flow are imported only by the commands that run the pipeline, so `inspect`
and `fixture-model` start fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from eaglet import shutdown, work_dir_lock
from eaglet.config import ConfigError, DeprecatedSpelling
from eaglet.preflight import PreflightError
from eaglet.run_report import RUN_FILE, finished_stages, read_run_record
from eaglet.storage import DiskFullError, is_disk_full
from eaglet_prefect.flows.commands import COMMANDS
from eaglet_prefect.flows.commands.run import WORK_DIR_LOCKED_EXIT
from eaglet_prefect.flows.prefect_server import CredentialsRefused, TemporaryPrefectServer

__all__ = ["WORK_DIR_LOCKED_EXIT", "build_parser", "main"]
# What stops a command before anything ran: a config that cannot run, a work dir or server
# that cannot be used (exit 2; a work dir another run holds: WORK_DIR_LOCKED_EXIT).
NOTHING_RAN = (ConfigError, PreflightError, work_dir_lock.WorkDirUnwritable, CredentialsRefused)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eaglet", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(commands)
    return parser


def _eaglets_warnings_in_one_line() -> None:
    """A warning eaglet itself gives (an older config key's spelling) prints as one
    `warning:` line, as errors do; any other keeps Python's format."""
    python_format = warnings.formatwarning

    def one_line(message, category, filename, lineno, line=None) -> str:
        if issubclass(category, DeprecatedSpelling):
            return f"warning: {message}\n"
        return python_format(message, category, filename, lineno, line)

    warnings.formatwarning = one_line


def main(argv: list[str] | None = None) -> int:
    _eaglets_warnings_in_one_line()
    args = build_parser().parse_args(argv)
    if args.command not in ("demo", "run"):
        return _run_command(args)
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
    except (*NOTHING_RAN, work_dir_lock.WorkDirLocked) as exc:  # the holder's run is untouched
        print(f"error: {exc}", file=sys.stderr)
        return WORK_DIR_LOCKED_EXIT if isinstance(exc, work_dir_lock.WorkDirLocked) else 2
    except Exception as exc:  # a failed stage: its message says what and where
        if args.command not in ("demo", "run"):
            raise
        print(f"error: {_failure_line(exc, args)}", file=sys.stderr)
        print(_after_failure(args), file=sys.stderr)
        return 1


def _failure_line(exc: BaseException, args: argparse.Namespace) -> str:
    """The last line of a failed run: the error as the stage said it; a full disk met outside
    a stage's folder (the run's records, Prefect's files) names the file and the work dir."""
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


def _after_failure(args: argparse.Namespace) -> str:
    """What a failed run left: the stages that finished in it (kept, reused by the next run),
    or that none did."""
    config = getattr(args, "loaded_config", None)
    if config is None:
        return "no stage ran; fix the cause and run the same command again"
    work_dir = Path(config.work_dir)
    try:  # this run's record, not an earlier run's
        recent = (work_dir / RUN_FILE).stat().st_mtime >= getattr(args, "run_started", 0)
    except OSError:
        recent = False
    finished = finished_stages(read_run_record(work_dir)) if recent else []
    if not finished:
        return "no stage finished; fix the cause and run the same command again"
    return (
        f"finished stages are kept ({', '.join(finished)}); fix the cause and run the same "
        "command again"
    )


if __name__ == "__main__":
    sys.exit(main())
