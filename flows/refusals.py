"""What a flow run shows when eaglet refuses it before any stage (a config that does not load,
the preflight, a work dir another run holds or that cannot be written): one plain log line
naming the problem, the artifact `run-refused` that leads with it and says where to change the
setting it names (the form's field, the YAML file and key `config_path` names, or `--set`),
then the detail, and a Failed state whose message is that problem (`refused_state`; the
notification's first line). And eaglet's own deliberate failures (`PermanentError`: refusals,
a failed canary or quality gate) log no traceback: their messages say what and where; a bug's
traceback stays."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Failed, State

from eaglet.config import ConfigError
from eaglet.errors import PermanentError
from eaglet.failure_advice import RunOrigin, config_keys_named, field_for
from eaglet.preflight import PreflightError
from eaglet.work_dir_lock import WorkDirLocked, WorkDirUnwritable

REFUSALS = (ConfigError, PreflightError, WorkDirLocked, WorkDirUnwritable)

REFUSED_AGAIN = "start a new run: Retry sends the same parameters and is refused again."
WHAT_TO_DO = {
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


def where_to_change(exc: BaseException, origin: RunOrigin) -> str | None:
    """Where the settings a config or preflight refusal names are set for a run of `origin`
    (None when it names none)."""
    keys = config_keys_named(" ".join(problems_of(exc)))
    return ", ".join(field_for(key, origin) for key in keys) or None


def what_to_do(exc: BaseException, origin: RunOrigin) -> str:
    """The refusal's advice: where to change what it names, in the terms of `origin`."""
    name = type(exc).__name__
    if name in WHAT_TO_DO:
        return WHAT_TO_DO[name]
    where = where_to_change(exc, origin)
    if where:
        return f"Change {where}, then {REFUSED_AGAIN}"
    if origin.config_file:
        source = f"the file `config_path` names (`{origin.config_file}`)"
    elif origin.started_from == "shell":
        source = "the config file or `--set`"
    else:
        source = "the form"
    return f"Change the setting it names in {source}, then {REFUSED_AGAIN}"


def refusal_markdown(exc: BaseException, origin: RunOrigin) -> str:
    """The `run-refused` artifact: the problem in one line, where to change it, the detail."""
    problems = problems_of(exc)
    more = f" (and {len(problems) - 1} more below)" if len(problems) > 1 else ""
    lines = [
        f"# Refused before any stage: {problems[0]}{more}",
        "",
        f"**What to do:** {what_to_do(exc, origin)}",
        "",
        "Nothing ran: no stage started and no stage folder changed.",
        "",
        f"## Detail ({type(exc).__name__})",
        "",
        *[f"- {problem}" for problem in problems],
    ]
    return "\n".join(lines) + "\n"


def refused_state(exc: BaseException, origin: RunOrigin) -> State:
    """The flow run's Failed state for a refusal: its message leads with the problem (the run
    page's state and the failure notification say it first), the error kept as its result."""
    message = f"refused before any stage: {problems_of(exc)[0]}"
    where = where_to_change(exc, origin)
    if where:
        message += f". Change {where}"
    return Failed(message=message, data=exc)


@contextmanager
def refusals_reported(origin: RunOrigin) -> Iterator[None]:
    """A refusal raised inside: logged once as one plain line, published as `run-refused`,
    raised on (the flow returns `refused_state` for it)."""
    try:
        yield
    except REFUSALS as exc:
        get_run_logger().error("refused before any stage: %s", problems_of(exc)[0])
        create_markdown_artifact(
            refusal_markdown(exc, origin),
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
