"""One run per work dir: the lock a run holds on `WORK_DIR/.eaglet.lock` from its first step to
its last.

Two runs writing one work dir corrupt it (a second writer appends to a sealed `generations.jsonl`,
every prompt is sent twice). The lock is an exclusive `flock` on the lock file, held through an
open file for the whole run, and the file names its holder (pid, host, start time, flow run,
command) so that a second run fails at once with a message naming who holds it.

- kill -9 of the holder: the kernel drops a `flock` with the process, so the next run takes the
  lock; the file still names the dead holder, and the taker says so (`took_over`), never
  silently.
- NFS: Linux emulates `flock` with POSIX byte-range locks over NFS (lockd for v3, the protocol's
  own locks for v4), so two hosts exclude each other when the server supports locking. If the
  holder's host dies, its lock lasts until the server's lease runs out (NFSv4: about 90 s).
  Where the filesystem refuses locks (`ENOLCK`, e.g. NFS mounted `nolock`), the run fails with
  a message saying so instead of running unlocked.
- One process may take the same lock again (the CLI, then the flow it runs): the holder counts
  its takes and releases at the last.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eaglet.errors import PermanentError
from eaglet.progress import say

LOCK_FILE = ".eaglet.lock"


class WorkDirLocked(PermanentError, RuntimeError):
    """Another run holds the work dir; the message names it."""


class WorkDirUnwritable(PermanentError, RuntimeError):
    """The work dir cannot be written (a read-only mount, no permission); nothing ran."""


@dataclass
class _Held:
    fd: int
    takes: int
    holder: dict[str, Any]
    took_over: dict[str, Any] | None


_held: dict[str, _Held] = {}
_guard = threading.Lock()


def lock_path(work_dir: str | Path) -> Path:
    return Path(work_dir) / LOCK_FILE


def read_holder(work_dir: str | Path) -> dict[str, Any] | None:
    """What the lock file says of its last holder (None when there is none or it is unreadable)."""
    try:
        text = lock_path(work_dir).read_text(encoding="utf-8")
        holder = json.loads(text) if text.strip() else None
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "another process (it has not written its name yet)"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    text = f"pid {holder.get('pid')} on host {holder.get('host')}, started {when}"
    if holder.get("flow_run"):
        text += f", flow run {holder['flow_run']}"
    if holder.get("command"):
        text += f" ({holder['command']})"
    return text


def acquire(work_dir: str | Path, flow_run: str | None = None) -> dict[str, Any] | None:
    """Take the work dir's lock for this process, or raise `WorkDirLocked` naming the holder.
    Returns the previous holder when it took over a lock a dead run left (its file still named
    it), else None."""
    folder = Path(work_dir)
    key = str(folder.resolve())
    with _guard:
        held = _held.get(key)
        if held is not None:
            held.takes += 1
            if flow_run and not held.holder.get("flow_run"):
                held.holder["flow_run"] = flow_run
                _write_holder(held.fd, held.holder)
            return None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path(folder), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise WorkDirUnwritable(
                f"work dir {folder} cannot be written ({exc.strerror}: {lock_path(folder)}): a "
                "run writes its lock and every stage there; nothing ran. To read a finished work "
                f"dir use `eaglet inspect {folder}`; to run, copy it somewhere writable (a work "
                "dir is relocatable) or set work_dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno == errno.ENOLCK:
                raise WorkDirLocked(
                    f"{lock_path(folder)}: the filesystem refuses file locks (ENOLCK; an NFS "
                    "mount with 'nolock'?): eaglet will not run two writers unguarded; put the "
                    "work dir on a filesystem with locking"
                ) from None
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise WorkDirLocked(
                f"work dir {folder} is in use by another eaglet run: "
                f"{describe(read_holder(folder))}. Wait for it to end (or stop it); two runs "
                f"on one work dir would corrupt it. Lock file: {lock_path(folder)}"
            ) from None
        # A holder that released emptied the file: one still named there died holding it.
        took_over = read_holder(folder)
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "flow_run": flow_run,
            "command": " ".join(Path(sys.argv[0]).name.split() + sys.argv[1:])[:300],
        }
        _write_holder(fd, holder)
        _held[key] = _Held(fd=fd, takes=1, holder=holder, took_over=took_over)
        return took_over


def _write_holder(fd: int, holder: dict[str, Any]) -> None:
    data = json.dumps(holder).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def release(work_dir: str | Path) -> None:
    """Give back one take of the lock; the last one empties the file and unlocks it."""
    key = str(Path(work_dir).resolve())
    with _guard:
        held = _held.get(key)
        if held is None:
            return
        held.takes -= 1
        if held.takes > 0:
            return
        del _held[key]
        try:
            os.ftruncate(held.fd, 0)  # no holder named: the next run has nothing to take over
        finally:
            fcntl.flock(held.fd, fcntl.LOCK_UN)
            os.close(held.fd)


def is_held(work_dir: str | Path) -> bool:
    """Whether a live run holds `work_dir`'s lock now (this process's own takes count: it
    holds it); a work dir that was never run, or whose holder died, is not held."""
    folder = Path(work_dir)
    if str(folder.resolve()) in _held:
        return True
    try:
        fd = os.open(lock_path(folder), os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def took_over_message(work_dir: str | Path, previous: dict[str, Any]) -> str:
    return (
        f"work dir {work_dir}: took over the lock of a run that ended without releasing it "
        f"({describe(previous)}; no longer running): its unfinished stage resumes"
    )


@contextmanager
def held(
    work_dir: str | Path, flow_run: str | None = None, log: Callable[[str], None] = say
) -> Iterator[None]:
    """Hold the work dir's lock for the block (`eaglet run`/`demo`, and the flow itself); a
    lock a dead run left is taken over and `log` says so."""
    previous = acquire(work_dir, flow_run)
    if previous is not None:
        log(took_over_message(work_dir, previous))
    try:
        yield
    finally:
        release(work_dir)
