"""How progress is reported: one throttle for every stage's progress lines, and `say`, the
default line writer of core functions."""

from __future__ import annotations

import time
from collections.abc import Callable

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
