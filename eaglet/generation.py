"""The resumable generation loop: prompts in, one append-only JSONL line per record out.

`run_generation` owns the file side of the generate stage, for any engine:

- ids already in `generations.jsonl` are skipped (a torn last line, left by a kill in the
  middle of a write, is cut off first), so a rerun sends only what is missing;
- each record is written as one line and flushed the moment it arrives, so a kill -9 loses
  at most the requests in flight, and never duplicates a line;
- prompts that failed for good go to `failed.jsonl` (rewritten each run: a rerun retries
  them, and those that succeed leave the list);
- progress (done/total, requests/s, output tokens/s, ETA) goes to a callback every few
  seconds, from a worker thread so a slow callback never stalls the writer.

Engines with `generate_async` (the HTTP engines) stream `Generation | Failure`; engines with
only a sync `generate` (the local engine) run in a worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from eaglet.errors import is_transient_status
from eaglet.progress import Throttle
from eaglet.records.generations import Generation
from eaglet.records.io import Record, record_line, repair_and_read_ids, repair_jsonl
from eaglet.records.prompts import Prompt

T = TypeVar("T")

FSYNC_EVERY_S = 10.0  # flush() survives a killed process; fsync guards against power loss


class Failure(Record):
    """A prompt the engine gave up on: what went wrong, for `failed.jsonl` and the logs."""

    sample_id: str
    source: str
    status: int | None = None  # the HTTP status, None for connection errors and timeouts
    message: str
    attempts: int = 1
    engine: str = ""


@dataclass(frozen=True)
class GenerationProgress:
    done: int  # records in the output file, earlier runs included
    total: int  # prompts, earlier runs included
    failed: int  # failures in this run
    truncated: int  # finish_reason=length in this run
    elapsed_s: float
    requests_per_s: float  # this run's records per second
    output_tokens_per_s: float
    eta_s: float | None  # None until the first record of this run

    def describe(self) -> str:
        eta = "?" if self.eta_s is None else f"{self.eta_s:.0f} s"
        return (
            f"{self.done}/{self.total} done, {self.failed} failed: "
            f"{self.requests_per_s:.2f} req/s, {self.output_tokens_per_s:.0f} output tok/s, "
            f"ETA {eta}"
        )


class TooManyFailuresError(RuntimeError):
    """More prompts failed for good than `generation.max_failure_fraction` allows.

    `transient` (read by `eaglet.errors.is_transient`, so by the task's retries): some failures
    were connection errors, timeouts, 429 or 5xx, which a retry may get past; when every one
    was a 4xx (the server refusing these requests), a retry fails the same way."""

    def __init__(self, summary: GenerationSummary, max_fraction: float) -> None:
        self.summary = summary
        self.transient = summary.transient_failures > 0
        examples = "; ".join(f"{f.sample_id}: {f.message}" for f in summary.failure_examples)
        super().__init__(
            f"{summary.failed} of {summary.total} prompts failed "
            f"({summary.failure_fraction:.1%} > generation.max_failure_fraction="
            f"{max_fraction:.1%}); they are listed in {summary.failed_path}. "
            f"First failures: {examples}. Fix the cause and rerun: records already written "
            "are kept and only the missing prompts are sent."
        )


@dataclass
class GenerationSummary:
    total: int  # distinct prompts
    already_done: int  # records found in the output file at the start
    written: int  # records written by this run
    failed: int  # prompts that failed for good in this run
    truncated: int  # records of this run with finish_reason=length
    output_tokens: int  # output tokens of this run's records
    elapsed_s: float
    finish_reasons: dict[str, int] = field(default_factory=dict)  # this run's records
    retried_failures: int = 0  # prompts listed in failed.jsonl by the previous run
    stopped_early: bool = False  # stopped once max_failure_fraction could no longer hold
    transient_failures: int = 0  # failures without a 4xx answer (connection, timeout, 5xx)
    failure_examples: list[Failure] = field(default_factory=list)  # the first few
    out_path: str = ""
    failed_path: str = ""
    # Unreadable lines moved from the output file to <name>.rejected-lines.jsonl at the start.
    set_aside_lines: int = 0

    @property
    def done(self) -> int:
        return self.already_done + self.written

    @property
    def failure_fraction(self) -> float:
        return self.failed / max(1, self.total)

    @property
    def requests_per_s(self) -> float:
        return self.written / max(self.elapsed_s, 1e-9)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / max(self.elapsed_s, 1e-9)

    def check(self, max_failure_fraction: float) -> None:
        """Raise `TooManyFailuresError` when the failed share is over the limit."""
        if self.failure_fraction > max_failure_fraction:
            raise TooManyFailuresError(self, max_failure_fraction)

    def as_dict(self) -> dict[str, Any]:
        """The figures a manifest or a progress artifact keeps (JSON-ready)."""
        return {
            "total": self.total,
            "already_done": self.already_done,
            "written": self.written,
            "failed": self.failed,
            "truncated": self.truncated,
            "output_tokens": self.output_tokens,
            "elapsed_s": round(self.elapsed_s, 3),
            "requests_per_s": round(self.requests_per_s, 3),
            "output_tokens_per_s": round(self.output_tokens_per_s, 1),
            "finish_reasons": dict(self.finish_reasons),
            "retried_failures": self.retried_failures,
            "stopped_early": self.stopped_early,
            "set_aside_lines": self.set_aside_lines,
        }


async def _records_of(engine: Any, prompts: list[Prompt]) -> AsyncIterator[Generation | Failure]:
    """The engine's async stream, or its sync `generate` run in a worker thread; nothing (the
    engine untouched) for no prompts."""
    if not prompts:
        return
    if hasattr(engine, "generate_async"):
        stream = engine.generate_async(prompts)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()
        return
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue(maxsize=256)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for record in engine.generate(prompts):
                if stop.is_set():
                    return
                asyncio.run_coroutine_threadsafe(queue.put(record), loop).result()
            asyncio.run_coroutine_threadsafe(queue.put(done), loop).result()
        except BaseException as exc:  # handed to the consumer, which raises it
            if not stop.is_set():
                asyncio.run_coroutine_threadsafe(queue.put(exc), loop).result()

    worker = threading.Thread(target=produce, name="eaglet-sync-engine", daemon=True)
    worker.start()
    try:
        while True:
            item = await queue.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while not queue.empty():  # unblock a producer waiting on a full queue
            queue.get_nowait()


class _ProgressReporter:
    """Calls the callback in a worker thread, at most one call at a time, skipping reports
    that come while the previous one still runs."""

    def __init__(self, callback: Callable[[GenerationProgress], None] | None) -> None:
        self.callback = callback
        self.pending: asyncio.Future | None = None
        self.throttle = Throttle()

    def maybe(self, make: Callable[[], GenerationProgress], force: bool = False) -> None:
        if self.callback is None:
            return
        if self.pending is not None and not self.pending.done():
            return
        if not self.throttle.ready(force):
            return
        self.pending = asyncio.ensure_future(asyncio.to_thread(self.callback, make()))

    async def final(self, progress: GenerationProgress) -> None:
        if self.callback is None:
            return
        if self.pending is not None:
            await asyncio.gather(self.pending, return_exceptions=True)
        await asyncio.to_thread(self.callback, progress)


def _progress_of(summary: GenerationSummary, started: float) -> GenerationProgress:
    """The progress so far of a run that started at `started` (a `time.monotonic()` value)."""
    elapsed = time.monotonic() - started
    rate = summary.written / max(elapsed, 1e-9)
    remaining = summary.total - summary.done - summary.failed
    return GenerationProgress(
        done=summary.done,
        total=summary.total,
        failed=summary.failed,
        truncated=summary.truncated,
        elapsed_s=elapsed,
        requests_per_s=rate,
        output_tokens_per_s=summary.output_tokens / max(elapsed, 1e-9),
        eta_s=remaining / rate if summary.written else None,
    )


def _append_line(handle: IO[str], record: Record) -> None:
    """Write `record` as one line and flush it (a killed process loses no finished line)."""
    handle.write(record_line(record))
    handle.flush()


class _RecordWriter:
    """Writes each record (or failure) as one flushed line and counts it in the summary;
    fsyncs the output every `FSYNC_EVERY_S` seconds."""

    def __init__(
        self,
        out: IO[str],
        failed: IO[str],
        summary: GenerationSummary,
        pending_ids: set[str],
        limit: float | None,
    ) -> None:
        self.out = out
        self.failed = failed
        self.summary = summary
        self.pending_ids = pending_ids
        self.limit = limit  # failures allowed before the run stops, None for no limit
        self.last_sync = time.monotonic()

    def write(self, item: Generation | Failure) -> bool:
        """Write and count `item`; False once the failures are over the limit (stop)."""
        self.pending_ids.discard(item.sample_id)
        if isinstance(item, Failure):
            _append_line(self.failed, item)
            self.summary.failed += 1
            self.summary.transient_failures += is_transient_status(item.status)
            if len(self.summary.failure_examples) < 3:  # the first few kept as examples
                self.summary.failure_examples.append(item)
            if self.limit is not None and self.summary.failed > self.limit:
                self.summary.stopped_early = True
                return False
        else:
            _append_line(self.out, item)
            reasons = self.summary.finish_reasons
            self.summary.written += 1
            self.summary.output_tokens += len(item.output_ids)
            self.summary.truncated += item.finish_reason == "length"
            reasons[item.finish_reason] = reasons.get(item.finish_reason, 0) + 1
        if time.monotonic() - self.last_sync > FSYNC_EVERY_S:
            os.fsync(self.out.fileno())
            self.last_sync = time.monotonic()
        return True

    def sync(self) -> None:
        """Flush and fsync both files (the end of a run, however it ends)."""
        self.out.flush()
        os.fsync(self.out.fileno())
        self.failed.flush()
        os.fsync(self.failed.fileno())


async def run_generation(
    engine: Any,
    prompts: Iterable[Prompt],
    out_path: Path,
    failed_path: Path,
    progress: Callable[[GenerationProgress], None] | None = None,
    max_failure_fraction: float | None = None,
    append_failures: bool = False,
) -> GenerationSummary:
    """Generate every prompt whose id is not in `out_path` yet, appending one line per record.

    `engine` has `generate_async(prompts) -> AsyncIterator[Generation | Failure]` or a sync
    `generate(prompts) -> Iterator[Generation]`. With `max_failure_fraction`, the run stops
    as soon as more prompts have failed than that share of the total could allow, and raises
    `TooManyFailuresError` (records written so far stay); without it, the caller checks the
    summary (`summary.check(fraction)`). `append_failures` adds to `failed_path` instead of
    starting it afresh (later rounds of a multi-turn run).
    """
    out_path, failed_path = Path(out_path), Path(failed_path)
    started = time.monotonic()
    repair = repair_jsonl(out_path)  # unreadable lines set aside, never dropped
    previous_failures = repair_and_read_ids(failed_path)
    unique: dict[str, Prompt] = {}  # by sample id, the first of each id kept, in order
    for prompt in prompts:
        unique.setdefault(prompt.sample_id, prompt)
    todo = [p for sid, p in unique.items() if sid not in repair.ids]
    summary = GenerationSummary(  # before the first request: what the files already hold
        total=len(unique),
        already_done=len(repair.ids & unique.keys()),
        written=0,
        failed=0,
        truncated=0,
        output_tokens=0,
        elapsed_s=0.0,
        retried_failures=len(previous_failures - repair.ids),
        out_path=str(out_path),
        failed_path=str(failed_path),
        set_aside_lines=len(repair.set_aside),
    )
    reporter = _ProgressReporter(progress)
    snapshot = functools.partial(_progress_of, summary, started)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    failed_path.parent.mkdir(parents=True, exist_ok=True)
    limit = None if max_failure_fraction is None else max_failure_fraction * max(1, summary.total)
    with (
        open(out_path, "a", encoding="utf-8") as out,
        open(failed_path, "a" if append_failures else "w") as failed,
    ):
        writer = _RecordWriter(out, failed, summary, {p.sample_id for p in todo}, limit)
        stream = _records_of(engine, todo)
        try:
            async for item in stream:
                if item.sample_id not in writer.pending_ids:
                    continue  # an engine answering twice, or an id we never asked for
                if not writer.write(item):
                    break  # more prompts failed than max_failure_fraction allows
                reporter.maybe(snapshot)
        finally:
            await stream.aclose()
            writer.sync()
    summary.elapsed_s = time.monotonic() - started
    await reporter.final(snapshot())
    if summary.stopped_early:
        raise TooManyFailuresError(summary, max_failure_fraction or 0.0)
    return summary


def run_generation_sync(
    engine: Any,
    prompts: Iterable[Prompt],
    out_path: Path,
    failed_path: Path,
    progress: Callable[[GenerationProgress], None] | None = None,
    max_failure_fraction: float | None = None,
) -> GenerationSummary:
    """`run_generation` for callers that are not async (a Prefect task, the CLI). Works
    whether or not the calling thread already runs an event loop."""
    return run_sync(
        run_generation(engine, prompts, out_path, failed_path, progress, max_failure_fraction)
    )


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to the end from sync code, whether or not this thread already runs
    an event loop (then it runs in a fresh thread with its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = asyncio.run(coroutine)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="eaglet-run-sync")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
