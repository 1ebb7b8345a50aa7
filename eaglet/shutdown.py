"""SIGINT and SIGTERM: a prompt, clean exit of a long run, whatever it is doing.

`eaglet run` and `eaglet demo` run inside `handling()`. The first SIGINT or SIGTERM (Ctrl-C,
`timeout`, systemd, Slurm's scancel; to the process or to its whole process group):

- raises `Interrupted` (a `KeyboardInterrupt`) in the main thread, so every `finally` runs and
  Prefect marks the task and flow runs Crashed; inside a `deferred()` section (the training
  loop) it only sets a flag, which the section checks between optimizer steps: it saves a
  checkpoint and raises `Interrupted` itself (`raise_if_requested`), or, if it has not within
  `GRACE_S`, is interrupted like any other code;
- arms a watchdog: `DEADLINE_S` after the signal, whatever the main thread is doing (a
  server that no longer answers, a child that does not stop), it prints the one-line message,
  SIGKILLs every process this one started (children and their children, in any session) and
  exits with 128 + the signal's number; an interval timer (the kernel's SIGALRM) ends the
  process `BACKSTOP_S` after the signal should even that thread never run again;
- after `FORWARD_AFTER_S`, sends the signal to the children still alive in this process
  group (torchrun, Dask workers): what a signal to the group would have done, for a signal
  sent to this process alone;
- removes the tracebacks from log records from then on: an interrupt is not an error;
- never raises where Python would drop it: a signal that lands while the garbage collector
  runs a finalizer (`__del__` of an asyncio transport, say) would raise `Interrupted` there,
  and Python only reports an exception from a finalizer (`sys.unraisablehook`) and carries
  on. Inside a `__del__` the handler does not raise; the signal is sent to the main thread
  again every `REDELIVER_S` until the handler raises outside one (finalizers of other kinds,
  seen by the hook, are redelivered the same way).

A second signal (`DUPLICATE_S` or more after the first: `timeout` sends SIGTERM to the child
and then to its group, one request) exits at once, the same way as the watchdog.

The module knows nothing of Prefect: the CLI reports `Interrupted`, the flow says which stage
runs (`set_stage`) and takes the signals back from Prefect's own SIGTERM handler, which a flow
run installs (`claim_signals`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEADLINE_S = 8.0  # the watchdog ends the process this long after the first signal
BACKSTOP_S = 9.5  # SIGALRM's default action, should the watchdog thread never run
GRACE_S = 4.0  # a deferred section (training) has this long to stop by itself
FORWARD_AFTER_S = 1.0  # then the signal goes to the children still alive in our group
DUPLICATE_S = 0.3  # a signal this soon after the first is the same request, delivered twice
KILL_GRACE_S = 2.0  # SIGTERM to the children left at exit, then SIGKILL
REDELIVER_S = 0.02  # an interrupt the handler could not raise comes again this often


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal; what was finished is kept."""

    def __init__(self, signum: int, stage: str):
        super().__init__(message(signum, stage))
        self.signum = signum
        self.stage = stage

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)

    def __str__(self) -> str:
        return message(self.signum, self.stage)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


def message(signum: int, stage: str, note: str = "") -> str:
    return (
        f"interrupted by {signal_name(signum)} during {stage}{note}; finished stages are kept; "
        "run the same command again to resume"
    )


class _State:
    def __init__(self) -> None:
        self.installed = False
        self.previous: dict[int, object] = {}
        self.signum: int | None = None
        self.at = 0.0
        self.stage = "start-up"
        self.deferring = 0  # depth of deferred() sections of the main thread
        self.pending = False  # the handler must raise at its next delivery (outside a finalizer)
        self.redelivering = False  # a thread sends the signal again while `pending`
        self.acknowledged = False  # a deferred section saw the request and is stopping
        self.exit: Callable[[int], None] = os._exit
        self.deadline_s = DEADLINE_S
        self.grace_s = GRACE_S
        self.backstop_s: float | None = BACKSTOP_S


_state = _State()


# ------------------------------------------------------------------------------ the public API


@contextlib.contextmanager
def handling(
    deadline_s: float = DEADLINE_S,
    grace_s: float = GRACE_S,
    backstop_s: float | None = BACKSTOP_S,
    exit: Callable[[int], None] = os._exit,
) -> Iterator[None]:
    """Handle SIGINT and SIGTERM as this module says while the block runs (main thread only;
    elsewhere a no-op). `exit` is what the watchdog and a second signal call (tests pass
    their own); the previous handlers come back afterwards. The watchdog, once armed by a
    signal, stays armed until the process exits: whatever still runs after the block (exit
    hooks) is bounded by it too."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _state.__init__()
    _state.deadline_s, _state.grace_s, _state.backstop_s = deadline_s, grace_s, backstop_s
    _state.exit = exit
    for signum in SIGNALS:
        _state.previous[signum] = signal.signal(signum, _handle)
    _state.installed = True
    try:
        yield
    finally:
        _state.installed = False
        for signum, handler in _state.previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]


def claim_signals() -> None:
    """Take SIGINT and SIGTERM back where other code replaced the handlers (a Prefect flow run
    installs its own SIGTERM handler for its duration). Main thread, inside `handling()`."""
    if not _state.installed or threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        if signal.getsignal(signum) is not _handle:
            signal.signal(signum, _handle)


def set_stage(stage: str) -> None:
    """What the process is doing, for the message (`interrupted by SIGTERM during train`)."""
    _state.stage = stage


def requested() -> bool:
    """A signal arrived: stop at the next point where stopping is clean. Inside `deferred()`,
    True is taken as the answer: the caller stops now (it may save first; the watchdog still
    bounds it), and is no longer interrupted after `GRACE_S`."""
    if _state.signum is None:
        return False
    _state.acknowledged = True
    return True


def time_left() -> float:
    """Seconds until the watchdog ends the process (infinite before any signal): what a
    clean-up may still wait for."""
    if _state.signum is None:
        return float("inf")
    return max(0.0, _state.at + _state.deadline_s - time.monotonic())


def raise_if_requested() -> None:
    if _state.signum is not None:
        raise Interrupted(_state.signum, _state.stage)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Code that stops by itself at a clean point (between training steps, after saving a
    checkpoint): a signal inside only sets `requested()`, which the code checks often, then
    calls `raise_if_requested()`. Should it not check within `GRACE_S`, it is interrupted
    anyway."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        _state.deferring += 1
    try:
        yield
    finally:
        if main:
            _state.deferring -= 1


def descendants(pid: int | None = None, exclude: set[int] = frozenset()) -> list[int]:
    """Every live process started by `pid` (this one by default), its children's children
    included, whatever their session or group, but those in `exclude` and theirs; parents
    before children (read from /proc)."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":  # a zombie: dead, only its exit status is left
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    queue = list(children.get(root, []))
    while queue:
        child = queue.pop(0)
        if child in exclude:
            continue
        found.append(child)
        queue.extend(children.get(child, []))
    return found


def stop_descendants(
    grace_s: float = KILL_GRACE_S, pid: int | None = None, exclude: set[int] = frozenset()
) -> list[int]:
    """SIGTERM every descendant but those in `exclude` and theirs (one snapshot of the tree: a
    child whose parent dies first is still found), wait up to `grace_s` for them to go,
    SIGKILL the rest. The pids signalled."""
    pids = descendants(pid, exclude)
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    _signal_all([p for p in pids if _alive(p)], signal.SIGKILL)
    return pids


# ------------------------------------------------------------------------------ the mechanism


def _handle(signum: int, frame: object) -> None:
    state = _state
    if state.signum is None:
        state.signum, state.at = signum, time.monotonic()
        _quiet_tracebacks()
        _arm_watchdog()
        if state.deferring:
            _start_grace_timer()
            return
        state.pending = True
    if state.pending:  # the first signal, the grace timer's, or one a finalizer would drop
        if _inside_finalizer(frame):
            _redeliver()
            return
        state.pending = False
        raise Interrupted(state.signum, state.stage)
    if time.monotonic() - state.at < DUPLICATE_S:
        return  # the same request, delivered to the process and then to its group
    _exit_now(signum, " (a second signal: stopped at once)")


def _exit_now(signum: int, note: str) -> None:
    """Kill every descendant, print the message, exit (128 + the first signal's number)."""
    first = _state.signum if _state.signum is not None else signum
    _signal_all(descendants(), signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.write(2, (message(first, _state.stage, note) + "\n").encode())
    _state.exit(exit_code(first))


def _arm_watchdog() -> None:
    started = _state.at

    def watchdog() -> None:
        forward_at = started + FORWARD_AFTER_S
        time.sleep(max(0.0, forward_at - time.monotonic()))
        if _state.signum is not None and _state.at == started:
            group = os.getpgrp()
            _signal_all([p for p in descendants() if _pgid(p) == group], _state.signum)
        time.sleep(max(0.0, started + _state.deadline_s - time.monotonic()))
        if _state.at == started:  # not a later handling() (tests)
            if os.environ.get("EAGLET_SHUTDOWN_DEBUG"):
                import faulthandler

                faulthandler.dump_traceback(all_threads=True)
            _exit_now(_state.signum or signal.SIGTERM, f" (still stopping after "
                      f"{_state.deadline_s:.0f} s: stopped at once)")  # fmt: skip

    threading.Thread(target=watchdog, name="eaglet-shutdown-watchdog", daemon=True).start()
    if _state.backstop_s is not None:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_REAL, _state.backstop_s)


def _start_grace_timer() -> None:
    started = _state.at

    def grace() -> None:
        time.sleep(_state.grace_s)
        if _state.at == started and _state.deferring and not _state.acknowledged:
            _state.pending = True  # a real signal: it also wakes a sleeping system call
            signal.pthread_kill(threading.main_thread().ident, _state.signum or signal.SIGTERM)

    threading.Thread(target=grace, name="eaglet-shutdown-grace", daemon=True).start()


class _NoTraceback(logging.Filter):
    """After an interrupt, log records keep their message and lose their traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


_NO_TRACEBACK = _NoTraceback()


def _quiet_tracebacks() -> None:
    loggers = [logging.getLogger()] + [
        logger
        for logger in list(logging.Logger.manager.loggerDict.values())
        if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in list(logger.handlers):
            if _NO_TRACEBACK not in handler.filters:
                handler.addFilter(_NO_TRACEBACK)
    sys.excepthook = _one_line_excepthook
    threading.excepthook = lambda args: None  # a helper thread torn down with the run
    sys.unraisablehook = _redeliver_a_dropped_interrupt


def _inside_finalizer(frame) -> bool:
    """The main thread runs a `__del__` (or the hook below): what is raised here is dropped."""
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code is _HOOK_CODE:
            return True
        frame = frame.f_back
    return False


def _redeliver() -> None:
    """Send the signal to the main thread again every `REDELIVER_S` while it is pending."""
    _state.pending = True
    if _state.redelivering:
        return
    _state.redelivering = True
    main, signum = threading.main_thread().ident, _state.signum or signal.SIGTERM

    def again() -> None:
        while _state.pending:
            time.sleep(REDELIVER_S)
            signal.pthread_kill(main, signum)
        _state.redelivering = False

    threading.Thread(target=again, name="eaglet-shutdown-redeliver", daemon=True).start()


def _redeliver_a_dropped_interrupt(unraisable) -> None:
    """Python dropped an exception a finalizer raised (a weakref callback, say): when it is our
    `Interrupted`, it comes again. Anything else a finalizer raised after an interrupt is not
    reported."""
    if isinstance(unraisable.exc_value, Interrupted) and _state.signum is not None:
        _redeliver()


_HOOK_CODE = _redeliver_a_dropped_interrupt.__code__


def _one_line_excepthook(kind, value, traceback) -> None:
    if isinstance(value, KeyboardInterrupt):
        return
    print(f"error: {kind.__name__}: {value}", file=sys.stderr)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)
