"""What a flow run shows when eaglet refuses it before any stage (a config that does not load,
the preflight, a work dir another run holds or that cannot be written): one plain log line
naming the problem, and the artifact `run-refused` that leads with it, says what to change in
the form, then the detail. And eaglet's own deliberate failures (`PermanentError`: refusals,
a failed canary or quality gate) log no traceback: their messages say what and where; a bug's
traceback stays."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from eaglet.config import ConfigError
from eaglet.errors import PermanentError
from eaglet.preflight import PreflightError
from eaglet.work_dir_lock import WorkDirLocked, WorkDirUnwritable

REFUSALS = (ConfigError, PreflightError, WorkDirLocked, WorkDirUnwritable)

CHANGE_A_FIELD = (
    "Change the setting it names in the form (in the full form, `train.device` is config → "
    "Draft training → Device; the short form's fields carry their own names) and start a new "
    "run: Retry sends the same parameters and is refused again."
)
WHAT_TO_DO = {
    "ConfigError": CHANGE_A_FIELD,
    "PreflightError": CHANGE_A_FIELD,
    "WorkDirLocked": (
        "Another run uses this work dir. Runs of one deployment queue by themselves "
        "(AwaitingConcurrencySlot); this one came from elsewhere (another deployment, or "
        "`eaglet run`). Retry once it has ended, or give this run another work_dir."
    ),
    "WorkDirUnwritable": (
        "Give the run a work_dir it can write (the machine that runs the flow must be able "
        "to), then start it again."
    ),
}


def problems_of(exc: BaseException) -> list[str]:
    """The problems a refusal names, one line each (the preflight's list, else the message)."""
    problems = getattr(exc, "problems", None)
    if problems:
        return list(problems)
    return [line.strip() for line in str(exc).strip().splitlines() if line.strip()][:1]


def refusal_markdown(exc: BaseException) -> str:
    """The `run-refused` artifact: the problem in one line, what to change, the detail."""
    problems = problems_of(exc)
    more = f" (and {len(problems) - 1} more below)" if len(problems) > 1 else ""
    lines = [
        f"# Refused before any stage: {problems[0]}{more}",
        "",
        f"**What to do:** {WHAT_TO_DO.get(type(exc).__name__, CHANGE_A_FIELD)}",
        "",
        "Nothing ran: no stage started and no stage folder changed.",
        "",
        f"## Detail ({type(exc).__name__})",
        "",
        *[f"- {problem}" for problem in problems],
    ]
    return "\n".join(lines) + "\n"


@contextmanager
def refusals_reported() -> Iterator[None]:
    """A refusal raised inside: logged once as one plain line, published as `run-refused`,
    raised on (the flow run fails with it)."""
    try:
        yield
    except REFUSALS as exc:
        problems = problems_of(exc)
        get_run_logger().error("refused before any stage: %s", problems[0])
        create_markdown_artifact(
            refusal_markdown(exc),
            key="run-refused",
            description="eaglet refused this run before any stage: why, and what to change",
        )
        raise


# Prefect's flow engine says these beside its "Finished in state Failed(<the error>)": for
# eaglet's deliberate failures they only repeat that line, so they are left out.
ENGINE_REPEATS = frozenset(
    {
        "Encountered exception during execution: %r",
        "Engine execution exited with unexpected exception",
    }
)


class WithoutPermanentTracebacks(logging.Filter):
    """Drops the traceback of a record whose exception is eaglet's own `PermanentError` (and
    the engine's repeat of such an error)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], PermanentError):
            if record.msg in ENGINE_REPEATS:
                return False
            record.exc_info, record.exc_text = None, None
        return True


RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # the engines' run loggers


def permanent_errors_without_tracebacks() -> None:
    """Install `WithoutPermanentTracebacks` on the loggers Prefect's engines log failures on
    (once): every handler, console and the UI's API alike, gets the plain line."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, WithoutPermanentTracebacks) for f in logger.filters):
            logger.addFilter(WithoutPermanentTracebacks())
