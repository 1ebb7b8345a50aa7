"""torch's CPU threads: how many intra-op threads each torch stage uses and how idle OpenMP
threads wait. Spin briefly where the process has its CPUs to itself; one thread where others
compete.

torch's CPU wheel runs its intra-op threads on GNU OpenMP (libgomp). The demo's draft training
on 2 threads is 30,000-57,000 parallel regions a second (perf, a uprobe on GOMP_parallel), 17-30
us each, so how a thread waits between regions decides the speed. Measured on a 2-core KVM
guest (benchmarks/contention.py: the demo's training in tokens/s; perf on the same):

- OMP_WAIT_POLICY=PASSIVE (sleep at once; eaglet's wait before issue 41): the thread that ends
  a region first futex-sleeps and is woken for the next one. In 2 s (perf sched timehist) the
  main thread slept 22,782 times (35 us each, 40% of the time), the worker 22,806 (54 us, 61%);
  10,000 context switches a second, 1.31 CPUs busy, 30 us a region; the kernel's wake-up and
  switch path 16% of the CPU samples. Two such threads run slower than one: quiet ~5,300-6,300
  against ~7,000.
- Spinning (GOMP_SPINCOUNT=10,000): 200 switches a second, 1.93 CPUs busy, 17.5 us a region:
  2 threads quiet ~11,000. A spin of 1,000 is too short to bridge the gaps between regions
  (~8,600); 10,000 to 300,000 measure alike.
- But a spinning thread beside busy processes spins while the sibling it waits for is
  descheduled: every region waits for a time slice (perf sched: 4 ms per wake-up), and 2
  threads beside a busy loop per core train at 70-600 tokens/s with any spin; 1 thread (no
  barrier at all) at 1,300-4,700.

Here libgomp spins ~40,000 times a ms: its default 300,000 burns ~7.5 ms of a CPU after each
last region (SPIN_COUNT: ~0.35 ms). So two parts:

- `quiet_openmp`, run when `eaglet` is imported (eaglet/__init__.py), before torch loads:
  GOMP_SPINCOUNT=SPIN_COUNT unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT. libgomp reads
  them once, when it loads, so the wait cannot change per stage; torch loaded first keeps
  libgomp's default spin.
- `apply_threads(stage, override)`, called by every stage that runs torch, in the thread that
  runs it (a Prefect task's or an engine's worker thread included): the threads the process may
  use (`choose_threads`: CPU affinity, a cgroup v2/v1 CPU quota and, as idle threads spin, only
  the CPUs other processes leave free: on 2 cores any load from others means 1 thread), set
  with `torch.set_num_threads`, logged in one line with the reason and the wait. Training
  (RECHECKED_STAGES) chooses again every RECHECK_S seconds between its optimizer steps
  (`between_steps`, a torch optimizer step hook) and logs a changed count: the load of others
  can come and go during a long stage.

An explicit choice wins, in this order: the stage's override (train.threads), OMP_NUM_THREADS
(or MKL_NUM_THREADS) in the environment, and a `torch.set_num_threads` the caller made before
(a count that is none of torch's defaults, or differs from the one this module set last in
that thread); none of them is changed between steps. The user's OMP_WAIT_POLICY or
GOMP_SPINCOUNT wins over SPIN_COUNT. Nothing here imports torch at module level, so importing
eaglet stays fast.
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
from dataclasses import dataclass, field
from pathlib import Path

from eaglet.stages import PRODUCER

log = logging.getLogger(__name__)

WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
SPIN_COUNT = 10000  # ~0.35 ms of spinning here, then the idle thread sleeps
SPIN_LOAD_LIMIT = 0.25  # spinning threads: a CPU with less load than this from others is free
LOAD_SAMPLES, LOAD_INTERVAL_S = 10, 0.01  # 0.1 s at each stage's start and each re-check
RECHECK_S = 10.0  # between training steps: the load read again this often (1% of the time)
RECHECKED_STAGES = (PRODUCER["draft"],)  # training: its optimizer steps re-check the load

# What `quiet_openmp` found when eaglet was imported: "set" (this module set GOMP_SPINCOUNT
# before torch loaded), "user" (the environment already chose), "late" (torch had loaded:
# libgomp spins with its defaults).
wait_policy_state = "unknown"
# The count apply_threads set last in any thread (torch's default for threads started later),
# and in `_local.applied` the one it set in this thread (torch's count is per thread).
_applied: int | None = None
_local = threading.local()  # .applied; .watch: this thread's stage checked between steps
_report: ContextVar[Callable[[str], None] | None] = ContextVar("cpu_threads_report", default=None)


def quiet_openmp(environ=os.environ, modules=sys.modules) -> str:
    """GOMP_SPINCOUNT=SPIN_COUNT in `environ` unless a wait setting is there already or torch
    is loaded (too late: libgomp read the environment when it loaded). Returns the state it
    left: "set", "user" or "late". Child processes (torchrun workers, servers) inherit it."""
    global wait_policy_state
    if any(environ.get(var) for var in WAIT_VARS):
        wait_policy_state = "user"
    elif "torch" in modules:
        wait_policy_state = "late"
    else:
        environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
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
    processes keep busy now (at least 1). With idle threads that spin (`spinning`; default:
    `spins()`) only CPUs others leave free count (less than SPIN_LOAD_LIMIT of load on them):
    a spinning thread that shares a CPU stalls every region's barrier. With threads that sleep
    at once, the nearest whole number.

    The readers default to this module's `affinity_cpus`, `cgroup_cpu_limit` and `others_load`
    (looked up at each call) and `environ` to os.environ."""
    environ = os.environ if environ is None else environ
    affinity = affinity or affinity_cpus
    quota = quota or cgroup_cpu_limit
    load = load or others_load
    if override:
        return ThreadChoice(override, f"train.threads={override}", False)
    for var in THREAD_VARS:
        value = (environ.get(var) or "").split(",")[0].strip()
        if value.isdigit() and int(value) > 0:
            return ThreadChoice(int(value), f"{var}={int(value)}", False)
    cpus = affinity()
    usable, why = cpus, [f"{cpus} CPUs in the affinity mask"]
    limit = quota()
    if limit is not None:
        usable = max(1, min(usable, math.floor(limit)))
        why.append(f"cgroup quota {limit:g} CPUs")
    busy = load()
    why.append(f"others keep {busy:.1f} CPUs busy")
    if spinning is None:
        spinning = spins(environ)
    if spinning:
        threads = max(1, min(usable, math.floor(usable - busy + SPIN_LOAD_LIMIT)))
        why.append("idle OpenMP threads spin: only CPUs others leave free")
    else:
        threads = max(1, min(usable, math.floor(usable - busy + 0.5)))
    return ThreadChoice(threads, ", ".join(why), True)


def _spin_count(environ) -> int | None:
    """GOMP_SPINCOUNT as a number (its k/M/G/T suffixes), None if unset or unreadable."""
    text = (environ.get("GOMP_SPINCOUNT") or "").strip()
    scale = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    return int(digits) * scale if digits.isdigit() else None


def spins(environ=None) -> bool:
    """Whether libgomp's idle threads spin in this process: torch loaded before eaglet set
    the wait, GOMP_SPINCOUNT above 0 (it wins over the policy), or no PASSIVE policy."""
    environ = os.environ if environ is None else environ
    if wait_policy_state == "late":
        return True
    count = _spin_count(environ)
    if count is not None:
        return count > 0
    return (environ.get("OMP_WAIT_POLICY") or "").strip().upper() != "PASSIVE"


def wait_setting(environ=None) -> str:
    """How idle OpenMP threads wait and who chose it, for the log line."""
    environ = os.environ if environ is None else environ
    if wait_policy_state == "late":
        return "idle threads spin ~3 ms: torch loaded before eaglet set GOMP_SPINCOUNT"
    named = ", ".join(f"{var}={environ[var]}" for var in WAIT_VARS if environ.get(var))
    if not named:
        return "libgomp's default wait: spin ~3 ms"
    if wait_policy_state == "set":
        return f"idle threads spin {_spin_count(environ)} times, then sleep ({named}, eaglet's)"
    return f"{named}, the user's"


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
    differs from what this module set last in this thread, or (never set in this thread) is
    none of `defaults` (torch's own, and what this module set last in another thread: a new
    thread's default)."""
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


def _say(line: str, sinks: set) -> None:
    log.info("%s", line)
    for sink in sinks:
        sink(line)


def _plural(threads: int) -> str:
    return f"{threads} intra-op thread{'s' * (threads != 1)}"


def apply_threads(
    stage: str, override: int | None = None, report: Callable[[str], None] | None = None, **readers
) -> ThreadChoice:
    """Choose (`choose_threads`; `readers` replace its readers) and set torch's intra-op
    threads in the calling thread (and as torch's default for threads started later); log one
    line. A count the caller set with torch.set_num_threads is kept when there is no override
    nor OMP_NUM_THREADS. A stage of RECHECKED_STAGES whose count this module chose chooses
    again between its optimizer steps (`between_steps`)."""
    import torch

    global _applied
    current = torch.get_num_threads()
    choice = choose_threads(override, **readers)
    defaults = _torch_defaults() | ({_applied} - {None})
    if choice.chosen and set_by_caller(current, getattr(_local, "applied", None), defaults):
        choice = ThreadChoice(current, f"torch.set_num_threads({current}) by the caller", False)
        torch.set_num_threads(current)  # torch's default for threads started later too
    else:
        torch.set_num_threads(choice.threads)
        _applied = _local.applied = choice.threads  # a caller's count stays unrecorded
    sinks = {report, _report.get()} - {None}
    rechecked = choice.chosen and stage in RECHECKED_STAGES
    _say(
        f"{stage}: {_plural(choice.threads)} ({choice.reason}; {wait_setting()}; "
        f"{f'checked again every {RECHECK_S:g} s between steps; ' if rechecked else ''}"
        f"thread {threading.current_thread().name})",
        sinks,
    )
    _local.watch = _Watch(stage, choice.threads, readers, sinks) if rechecked else None
    if rechecked:
        _install_step_hook()
    return choice


# --- between steps ------------------------------------------------------------------------


@dataclass
class _Watch:
    """A stage whose thread count is chosen again between its steps, in its own thread."""

    stage: str
    threads: int
    readers: dict
    sinks: set
    due: float = field(default_factory=lambda: time.monotonic() + RECHECK_S)
    optimizer: int | None = None  # id() of the optimizer whose steps are the stage's


_hook_lock = threading.Lock()
_hook_installed = False


def between_steps(optimizer: object | None = None) -> int | None:
    """Between two steps of a stage `apply_threads` watches in this thread: every RECHECK_S
    seconds choose again and set the new count (logged). Cheap when not due. The watch ends
    when the thread count is no longer the one set here (someone else set it) and, given an
    optimizer, it follows only the first optimizer that steps (not another one the thread
    steps later, e.g. the fixture model's training with its fixed count). Returns the count
    set now, or None."""
    global _applied
    watch = getattr(_local, "watch", None)
    if watch is None:
        return None
    if optimizer is not None:
        watch.optimizer = watch.optimizer or id(optimizer)
        if watch.optimizer != id(optimizer):
            return None
    if time.monotonic() < watch.due:
        return None
    import torch

    if torch.get_num_threads() != watch.threads:  # set by someone else since: theirs
        _local.watch = None
        return None
    choice = choose_threads(**watch.readers)
    watch.due = time.monotonic() + RECHECK_S
    if choice.threads == watch.threads:
        return None
    torch.set_num_threads(choice.threads)
    _applied = _local.applied = watch.threads = choice.threads
    _say(f"{watch.stage}: now {_plural(choice.threads)} ({choice.reason})", watch.sinks)
    return choice.threads


def _install_step_hook() -> None:
    """Once per process: `between_steps` after every torch optimizer step (in the stepping
    thread; nothing happens in a thread without a watch)."""
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            register_optimizer_step_post_hook(lambda optimizer, *_: between_steps(optimizer))
            _hook_installed = True
