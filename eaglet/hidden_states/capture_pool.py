"""The capture servers one process sends its hidden-state requests to (the vllm backend's
`hidden_states.vllm.endpoints`): which server gets the next request, what a failure does, and
how fast each one answered.

- Balance: the server with the fewest of this process's requests in flight, ties in turn
  (each training rank or stage process balances its own requests; equal servers get equal
  shares, a slow one fewer).
- Failure: a request that got no answer (connection refused or reset, a timeout), a 408,
  429 or 5xx, or a 200 whose file the server died before finishing (no `/health` after it) marks
  its server down for a while (1 s, doubling per failure in a row up to
  `MAX_DOWN_S`) and is sent again, to another server while one is up; a server down for all
  is tried again when its time is out. Each sample is tried at most `tries` times (4 + 2 per
  server), then the run fails with every server's last error (`CaptureFailed`, transient:
  the stage's retry or the next run resumes). Another 4xx is the server saying no: raised at
  once by the caller.
- Rates: per server, the samples and tokens it answered, the seconds this process had a
  request there (`busy_s`) and the requests sent again elsewhere (`retries`).

A request is one sample's states: sending it again never puts a sample twice in a batch (the
caller keeps one answer per sample; a late file of the failed try is never read).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from eaglet.errors import TransientError

MAX_DOWN_S = 30.0


class CaptureFailed(TransientError, RuntimeError):
    """Every try of a sample failed on every capture server."""


@dataclass
class Server:
    url: str
    outstanding: int = 0
    down_until: float = 0.0
    failures_in_row: int = 0
    samples: int = 0
    tokens: int = 0
    retries: int = 0
    busy_s: float = 0.0
    busy_since: float = 0.0
    last_error: str = ""


@dataclass
class CapturePool:
    urls: list[str]
    first_down_s: float = 1.0  # a server's first pause after a failure (doubles per failure)
    servers: list[Server] = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _turn: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.servers = [Server(url.rstrip("/")) for url in self.urls]

    @property
    def tries(self) -> int:
        return 4 + 2 * len(self.servers)

    def pick(self, avoid: Server | None = None) -> Server:
        """The up server with the fewest requests in flight (not `avoid`, the one that just
        failed, while another is up); when all are down, waits for the first to come back."""
        while True:
            with self._lock:
                now = time.monotonic()
                up = [s for s in self.servers if s.down_until <= now]
                if len(up) > 1 and avoid in up:
                    up.remove(avoid)
                if up:
                    least = min(s.outstanding for s in up)
                    candidates = [s for s in up if s.outstanding == least]
                    self._turn += 1
                    return candidates[self._turn % len(candidates)]
                wait = min(s.down_until for s in self.servers) - now
            time.sleep(min(max(wait, 0.01), MAX_DOWN_S))

    @contextmanager
    def request(self, server: Server) -> Iterator[None]:
        """One request in flight at `server` (its busy time counts while any is)."""
        with self._lock:
            if server.outstanding == 0:
                server.busy_since = time.monotonic()
            server.outstanding += 1
        try:
            yield
        finally:
            with self._lock:
                server.outstanding -= 1
                if server.outstanding == 0:
                    server.busy_s += time.monotonic() - server.busy_since

    def answered(self, server: Server, tokens: int) -> None:
        with self._lock:
            server.samples += 1
            server.tokens += tokens
            server.failures_in_row = 0

    def failed(self, server: Server, error: str) -> None:
        """`server` failed a request that may pass: down for a while, the request sent again."""
        with self._lock:
            server.failures_in_row += 1
            server.retries += 1
            server.last_error = error
            down = min(MAX_DOWN_S, self.first_down_s * 2.0 ** (server.failures_in_row - 1))
            server.down_until = time.monotonic() + down

    def gave_up(self, sample_id: str) -> CaptureFailed:
        errors = "; ".join(f"{s.url}: {s.last_error or 'no error'}" for s in self.servers)
        return CaptureFailed(
            f"sample {sample_id}: no capture server answered in {self.tries} tries ({errors}); "
            "check the servers of hidden_states.vllm.endpoints, then rerun to resume"
        )

    def stats(self) -> dict[str, dict]:
        """url -> samples, tokens, busy_s, retries (this process's)."""
        with self._lock:
            return {
                s.url: {
                    "samples": s.samples, "tokens": s.tokens, "busy_s": s.busy_s,
                    "retries": s.retries,
                }
                for s in self.servers
            }  # fmt: skip
