"""Which failures are worth a retry: transient faults are, deterministic ones are not.

A stage task is retried (Prefect `retries`) only when `is_transient(exc)` says so. A retry
after a deterministic failure — a canary that found a broken server setup, a config error,
a failed quality gate, a server refusing every request with a 4xx — fails the same way, only
later (against a server without a reasoning parser the run used to fail after 6 minutes of
retries instead of in seconds).

- `PermanentError`: a failure retrying cannot mend; the errors of eaglet that mean "fix
  something first" derive from it (`CanaryError`, `ConfigError`, `QualityGateError`,
  `PromptError`, `RecordFileError`, ...).
- `TransientError`: a fault that may pass by itself.
- An exception with a `transient` attribute says so itself (`TooManyFailuresError`: transient
  unless every failure was a 4xx).
- Anything else is transient only when it, or an exception it was raised from, is a connection
  error or a timeout (the builtin ones, httpx's, requests', urllib3's), a `KilledWorker`
  (a Dask worker that died), or an HTTP error with status 408, 429 or 5xx. Unknown errors are
  final: a bug fails the same way twice.
"""

from __future__ import annotations

# Exception class names (anywhere in the class's MRO) that mean a fault that may pass; names,
# not classes, so the core imports none of the libraries that define them.
TRANSIENT_NAMES = frozenset(
    {
        "TransportError",  # httpx: connect, read, write, pool, protocol errors
        "TimeoutException",  # httpx
        "ConnectionError",  # builtin, requests
        "Timeout",  # requests
        "TimeoutError",  # builtin, asyncio
        "ProtocolError",  # urllib3: connection aborted
        "ChunkedEncodingError",  # requests: connection cut mid-body
        "IncompleteRead",  # http.client
        "RemoteDisconnected",  # http.client
        "KilledWorker",  # dask.distributed: the worker running the task died
    }
)


class PermanentError(Exception):
    """A failure that a retry cannot mend: fix the cause (the message says how), then rerun."""

    transient = False


class NonFiniteError(PermanentError, ArithmeticError):
    """A NaN or inf in the target's states, a loss or an evaluation: the message names the
    first sample (and step) where it appeared. Broken weights or a dtype that overflows
    compute it again on a retry."""


class TransientError(Exception):
    """A fault that may pass by itself (a server restarting, a network blip)."""

    transient = True


def is_transient_status(status: int | None) -> bool:
    """True for an HTTP status worth a retry (408, 429, 5xx) and for no status at all (the
    request got no answer: a connection error or a timeout)."""
    return status is None or status in (408, 429) or status >= 500


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the work that raised `exc` may succeed (see the module docstring)."""
    link: BaseException | None = exc
    seen: set[int] = set()
    while link is not None and id(link) not in seen:  # the exception and its causes
        seen.add(id(link))
        verdict = getattr(link, "transient", None)
        if isinstance(verdict, bool):
            return verdict
        if any(cls.__name__ in TRANSIENT_NAMES for cls in type(link).__mro__):
            return True
        status = getattr(getattr(link, "response", None), "status_code", None)
        if isinstance(status, int):
            return is_transient_status(status)
        link = link.__cause__ or link.__context__
    return False
