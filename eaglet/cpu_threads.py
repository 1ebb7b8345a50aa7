"""torch's CPU threads: how many intra-op threads a stage uses, and idle OpenMP threads that
sleep instead of spinning.

A user's machine is never idle. torch's CPU wheel runs its intra-op threads on GNU OpenMP
(libgomp), whose idle threads, with OMP_WAIT_POLICY unset, spin up to 300,000 times (~3 ms)
after every parallel region before they sleep. Alone that costs nothing; beside other busy
processes a spinning thread burns the time slice its sibling, descheduled, needs to reach the
region's barrier, and the draft's many small ops each wait a scheduler tick: the demo's
training ran at a small fraction of its fair share (benchmarks/contention.py measures it). Two
parts fix it:

- `quiet_openmp`, run when `eaglet` is imported (eaglet/__init__.py), before torch loads:
  OMP_WAIT_POLICY=PASSIVE (idle threads sleep at once) unless the user set OMP_WAIT_POLICY or
  GOMP_SPINCOUNT. libgomp reads them once, when it loads; torch loaded first keeps spinning, and
  the thread choice then counts the load more strictly (`SPIN_LOAD_LIMIT`).
- `apply_threads(stage, override)`, called by every stage that runs torch in the thread that
  runs it (a Prefect task's or an engine's worker thread included): the threads the process may
  actually use (`choose_threads`: CPU affinity, a cgroup v2/v1 CPU quota, less the CPUs other
  processes keep busy right now), set with `torch.set_num_threads`, logged in one line.

An explicit choice wins, in this order: the stage's override (train.threads), OMP_NUM_THREADS
(or MKL_NUM_THREADS) in the environment, and a `torch.set_num_threads` the caller made before
(a count that is none of torch's defaults, or differs from the one this module set last).
Nothing here imports torch at module level, so importing eaglet stays fast.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
SPIN_LOAD_LIMIT = 0.25  # with spinning threads, any more load from others than this: 1 thread
LOAD_SAMPLES, LOAD_INTERVAL_S = 10, 0.01  # 0.1 s at each stage's start

# What `quiet_openmp` found when eaglet was imported: "set" (this module set PASSIVE before
# torch loaded), "user" (the environment already chose), "late" (torch had loaded: libgomp
# spins with its defaults).
wait_policy_state = "unknown"
_applied: int | None = None  # the thread count apply_threads set last, in any thread
_report: ContextVar[Callable[[str], None] | None] = ContextVar("cpu_threads_report", default=None)


def quiet_openmp(environ=os.environ, modules=sys.modules) -> str:
    """OMP_WAIT_POLICY=PASSIVE in `environ` unless a wait setting is there already or torch is
    loaded (too late: libgomp read the environment when it loaded). Returns the state it left:
    "set", "user" or "late". Child processes (torchrun workers, servers) inherit the setting."""
    global wait_policy_state
    if any(environ.get(var) for var in WAIT_VARS):
        wait_policy_state = "user"
    elif "torch" in modules:
        wait_policy_state = "late"
    else:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        wait_policy_state = "set"
    return wait_policy_state


# --- what the process may use ----------------------------------------------------------------


def affinity_cpus() -> int:
    """CPUs this process may run on (its affinity mask: taskset, cpusets, Slurm)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """The process's cgroup per hierarchy: "" for v2 (the "0::" line), else the controller
    list ("cpu,cpuacct")."""
    paths: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths[parts[1]] = parts[2]
    return paths


def _walk_up(mount: Path, path: str) -> Iterator[Path]:
    """`mount/path`, its parents up to `mount`, then `mount` itself (a container sees its own
    cgroup at the mount's root while /proc/self/cgroup names the host's path)."""
    folder = mount / path.strip("/")
    while True:
        yield folder
        if folder == mount:
            return
        folder = folder.parent


def cgroup_cpu_limit(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPU quota of the process's cgroup in CPUs (the smallest along its path), or None
    for none. cgroup v2: `cpu.max` ("max 100000" or "QUOTA PERIOD"); v1: `cpu.cfs_quota_us`
    (-1 = none) over `cpu.cfs_period_us`, under the cpu controller's mount."""
    paths = _cgroup_paths(proc_cgroup)
    limits: list[float] = []
    if "" in paths and (root / "cgroup.controllers").exists():  # v2, unified
        for folder in _walk_up(root, paths[""]):
            try:
                quota, period = (folder / "cpu.max").read_text().split()[:2]
            except (OSError, ValueError):
                continue
            if quota != "max" and float(period) > 0:
                limits.append(float(quota) / float(period))
    for controllers, path in paths.items():
        if "cpu" not in controllers.split(","):
            continue
        for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
            for folder in _walk_up(mount, path):
                try:
                    quota = float((folder / "cpu.cfs_quota_us").read_text())
                    period = float((folder / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                if quota > 0 and period > 0:
                    limits.append(quota / period)
    return min(limits) if limits else None


def runnable_tasks(loadavg: Path = Path("/proc/loadavg")) -> int | None:
    """Threads runnable on the whole machine right now (the 4th field of /proc/loadavg, the
    reader included)."""
    try:
        return int(loadavg.read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def own_runnable(tasks: Path = Path("/proc/self/task")) -> int:
    """Threads of this process runnable right now (state R in their stat), the reader
    included: at least 1."""
    count = 0
    try:
        names = list(tasks.iterdir())
    except OSError:
        return 1
    for task in names:
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        count += bool(fields) and fields[0] == "R"
    return max(1, count)


def others_load(
    read: Callable[[], int | None] = runnable_tasks,
    own: Callable[[], int] = own_runnable,
    samples: int = LOAD_SAMPLES,
    interval_s: float = LOAD_INTERVAL_S,
) -> float:
    """CPUs other processes keep busy now: the mean of a few readings of the machine's
    runnable count less this process's runnable threads (a Prefect task's own log and event
    threads, busy for a moment as the task starts, are not another process). Not the 1-minute
    load average: it lags by a minute and counts this process's own previous stage."""
    readings = []
    for i in range(samples):
        value = read()
        if value is not None:
            readings.append(max(0, value - own()))
        if i + 1 < samples:
            time.sleep(interval_s)
    return sum(readings) / len(readings) if readings else 0.0


# --- the choice ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # one line: why this many
    chosen: bool  # True: this module chose (False: an explicit setting it respected)


def _explicit_env(environ) -> tuple[str, int] | None:
    for var in THREAD_VARS:
        value = (environ.get(var) or "").split(",")[0].strip()
        if value.isdigit() and int(value) > 0:
            return var, int(value)
    return None


def choose_threads(
    override: int | None = None,
    *,
    environ=None,
    affinity: Callable[[], int] | None = None,
    quota: Callable[[], float | None] | None = None,
    load: Callable[[], float] | None = None,
    spinning: bool | None = None,
) -> ThreadChoice:
    """Intra-op threads for a stage: `override`, else OMP_NUM_THREADS / MKL_NUM_THREADS, else
    the CPUs the process may use (affinity, whole CPUs of a cgroup quota) less those other
    processes keep busy now (rounded to the nearest; at least 1). With idle threads that spin
    (`spinning`; default: `spins()`) any load above SPIN_LOAD_LIMIT means 1 thread: spinning
    threads collapse beside other work.

    The readers default to this module's `affinity_cpus`, `cgroup_cpu_limit` and `others_load`
    (looked up at each call) and `environ` to os.environ."""
    environ = os.environ if environ is None else environ
    affinity = affinity or affinity_cpus
    quota = quota or cgroup_cpu_limit
    load = load or others_load
    if override:
        return ThreadChoice(override, f"train.threads={override}", False)
    explicit = _explicit_env(environ)
    if explicit:
        return ThreadChoice(explicit[1], f"{explicit[0]}={explicit[1]}", False)
    cpus = affinity()
    usable, why = cpus, [f"{cpus} CPUs in the affinity mask"]
    limit = quota()
    if limit is not None:
        usable = max(1, min(usable, math.floor(limit)))
        why.append(f"cgroup quota {limit:g} CPUs")
    busy = load()
    threads = max(1, min(usable, math.floor(usable - busy + 0.5)))
    why.append(f"others keep {busy:.1f} CPUs busy")
    if spinning is None:
        spinning = spins(environ)
    if spinning:
        why.append("idle OpenMP threads spin")
        if busy > SPIN_LOAD_LIMIT:
            threads = 1
    return ThreadChoice(threads, ", ".join(why), True)


def spins(environ=None) -> bool:
    """Whether libgomp's idle threads spin in this process: torch loaded before eaglet set
    the wait policy, GOMP_SPINCOUNT above 0 (it wins over the policy), or no PASSIVE policy."""
    environ = os.environ if environ is None else environ
    if wait_policy_state == "late":
        return True
    count = (environ.get("GOMP_SPINCOUNT") or "").strip()
    if count:
        return count not in ("0", "0k", "0M", "0G", "0T")
    return (environ.get("OMP_WAIT_POLICY") or "").strip().upper() != "PASSIVE"


def wait_setting(environ=None) -> str:
    """How idle OpenMP threads wait, for the log line."""
    environ = os.environ if environ is None else environ
    if wait_policy_state == "late":
        return "idle threads spin: torch loaded before eaglet set OMP_WAIT_POLICY"
    named = [f"{var}={environ[var]}" for var in WAIT_VARS if environ.get(var)]
    return ", ".join(named) or "libgomp's default wait: spin ~3 ms"


def _torch_defaults() -> set[int]:
    """Counts torch picks by itself: logical CPUs, the affinity mask, physical cores."""
    counts = {os.cpu_count() or 1, affinity_cpus()}
    cores = set()
    for topology in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        try:
            package = (topology / "physical_package_id").read_text().strip()
            cores.add((package, (topology / "core_id").read_text().strip()))
        except OSError:
            continue
    if cores:
        counts.add(len(cores))
    return counts


def set_by_caller(current: int, applied: int | None, defaults: set[int]) -> bool:
    """Whether torch's current thread count is a caller's own `torch.set_num_threads`: it
    differs from what this module set last, or (never set here) is none of torch's defaults."""
    if applied is not None:
        return current != applied
    return current not in defaults


@contextmanager
def report_to(report: Callable[[str], None] | None) -> Iterator[None]:
    """Stages run inside the block (this thread and context) write their choice line to
    `report` (e.g. a Prefect task's logger) as well as to this module's logger."""
    token = _report.set(report)
    try:
        yield
    finally:
        _report.reset(token)


def apply_threads(
    stage: str,
    override: int | None = None,
    report: Callable[[str], None] | None = None,
    **readers,
) -> ThreadChoice:
    """Choose (`choose_threads`; `readers` replace its readers) and set torch's intra-op
    threads in the calling thread (and as torch's default for threads started later); log one
    line. A count the caller set with torch.set_num_threads is kept when there is no override
    nor OMP_NUM_THREADS."""
    import torch

    global _applied
    current = torch.get_num_threads()
    choice = choose_threads(override, **readers)
    if choice.chosen and set_by_caller(current, _applied, _torch_defaults()):
        choice = ThreadChoice(current, f"torch.set_num_threads({current}) by the caller", False)
        torch.set_num_threads(current)  # torch's default for threads started later too
    else:
        torch.set_num_threads(choice.threads)
        _applied = choice.threads  # the caller's count stays the caller's: not recorded
    line = (
        f"{stage}: {choice.threads} intra-op thread{'s' * (choice.threads != 1)} "
        f"({choice.reason}; {wait_setting()}; thread {threading.current_thread().name})"
    )
    log.info("%s", line)
    for sink in {report, _report.get()} - {None}:
        sink(line)
    return choice
