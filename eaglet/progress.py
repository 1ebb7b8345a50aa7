"""How progress is reported: one throttle for every stage's progress lines, `say`, the
default line writer of core functions, and `Steps`, the lines of work made of a few long
steps (a line as each starts and ends, and a heartbeat while one runs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

REPORT_EVERY_S = 5.0  # a progress line at most this often (the last one always)


class Throttle:
    """`ready()` is true at most once every `every_s` seconds, and always with `force` (the
    final report). The first call is ready."""

    def __init__(
        self, every_s: float = REPORT_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s, self.clock = every_s, clock
        self.last: float | None = None

    def ready(self, force: bool = False) -> bool:
        now = self.clock()
        if not force and self.last is not None and now - self.last < self.every_s:
            return False
        self.last = now
        return True


def say(line: str) -> None:
    """The default `log` of core functions: `print`, looked up when called. Inside a Prefect
    flow or task with `log_prints` the line then reaches the run's logs in the UI; a default
    `log=print` binds the builtin at import, before Prefect patches it, and the line goes only
    to the terminal of the process serving the flow."""
    print(line, flush=True)


HEARTBEAT_S = 30.0  # a line at least this often while a step runs without lines of its own


class Steps:
    """Progress of work made of a known number of long steps (servers started and measured):
    a line when each starts and ends, with the ETA of the whole from the steps done, and while
    one runs a line every `every_s` seconds saying what it is doing and for how long. Used as a
    context manager; the heartbeat thread ends with it."""

    def __init__(
        self,
        label: str,
        total: int,
        log: Callable[[str], None] | None = None,
        every_s: float = HEARTBEAT_S,
    ) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.log = log or say
        self.done, self.what = 0, ""
        self.started = self.step_started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"{label} heartbeat", daemon=True)

    def __enter__(self) -> Steps:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def start(self, what: str) -> None:
        self.what, self.step_started = what, time.monotonic()
        self.log(f"{self.label} {self.done + 1}/{self.total}: {what}")

    def finish(self, result: str = "") -> None:
        self.done += 1
        elapsed = time.monotonic() - self.started
        step = time.monotonic() - self.step_started
        left = self.total - self.done
        eta = f", ETA {timedelta(seconds=round(elapsed / self.done * left))}" if left else ""
        said = f": {result}" if result else ""
        self.log(
            f"{self.label} {self.done}/{self.total} done ({self.what}, {step:.0f} s){said}{eta}"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.done < self.total and self.what:
                step = time.monotonic() - self.step_started
                self.log(f"{self.label} {self.done + 1}/{self.total}: {self.what} ({step:.0f} s)")
