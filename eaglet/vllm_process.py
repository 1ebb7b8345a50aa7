"""A local vLLM OpenAI server as a child process: started in its own process group, waited for
on `/health`, stopped by signalling the whole group (vLLM has child processes).

Its port is chosen below the kernel's ephemeral range, so no other program's `bind(port 0)` is
handed it in the seconds vLLM takes to import before it binds; and `/health` counts only once
this server's own process holds the listening socket (on Linux), so another server on the port
is never taken for it.

One home for what both users of a local server need: the evaluate stage (the target with the
draft as its eagle3 speculative model, `eaglet.draft.serving`) and the hidden_states stage and
online training (the target with `extract_hidden_states`, `eaglet.hidden_states.backends.vllm`).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from eaglet.errors import PermanentError


class VllmServerError(PermanentError, RuntimeError):
    """The server exited or never became healthy while starting (its log says why)."""


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000


def free_port() -> int:
    """A loopback port free now, below the ephemeral range the kernel hands to `bind(0)` (so
    another program cannot be given it before our server binds it); any free port where the
    range cannot be read or leaves no room."""
    try:
        first_ephemeral = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 0
    candidates = list(range(_LOWEST_PORT, first_ephemeral))
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening_socket_inodes(port: int, proc: Path = Path("/proc")) -> set[str] | None:
    """The inodes of the sockets listening on `port` (IPv4 and IPv6), or None where /proc does
    not say (not Linux)."""
    inodes: set[str] = set()
    found_table = False
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        found_table = True
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(inode)
    return inodes if found_table else None


def _running_members(group: int, proc: Path) -> Iterator[Path]:
    """The /proc entries of the running processes of process group `group` (a zombie is not
    running: it writes nothing and holds no memory or socket)."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            running = fields[0] != "Z" and int(fields[2]) == group  # fields 3, 5: state, group
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        if running:
            yield entry


def group_holds_listening_socket(group: int, port: int, proc: Path = Path("/proc")) -> bool | None:
    """Whether a process of process group `group` holds a socket listening on `port`; None
    where /proc cannot say (not Linux)."""
    inodes = listening_socket_inodes(port, proc)
    if inodes is None or not (proc / str(group) / "fd").is_dir():
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in _running_members(group, proc):
        try:
            if any(os.readlink(fd) in wanted for fd in (entry / "fd").iterdir()):
                return True
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return False


def group_is_running(group: int, proc: Path = Path("/proc")) -> bool:
    """Whether any process of process group `group` is still running; where /proc is
    missing, whether the group exists."""
    if not (proc / "self").is_dir():
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True
    return next(_running_members(group, proc), None) is not None


def _group_ended_within(process: subprocess.Popen, seconds: float) -> bool:
    """Wait up to `seconds` for every process of `process`'s group to exit (the leader is
    reaped meanwhile, so that it does not count)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        process.poll()
        if not group_is_running(process.pid):
            return True
        time.sleep(0.1)
    return False


def stop_process_group(
    process: subprocess.Popen, first: signal.Signals = signal.SIGTERM, grace_s: float = 30.0
) -> None:
    """Send `first` to the group of a process started with `start_new_session=True` and return
    once every process of the group has exited (the API server's multiprocessing resource
    tracker writes its last lines to the same log after the API server is gone); SIGKILL
    whatever is left after `grace_s`."""
    try:
        os.killpg(process.pid, first)
        if not _group_ended_within(process, grace_s):
            os.killpg(process.pid, signal.SIGKILL)
            _group_ended_within(process, 10)
    except ProcessLookupError:
        pass  # the whole group has exited
    process.wait()


@contextmanager
def vllm_server(
    command: list[str],
    log_path: Path,
    startup_timeout_s: float,
    env: dict[str, str] | None = None,
    timeout_setting: str = "the startup timeout",
    cwd: Path | None = None,
) -> Iterator[str]:
    """Run `command` (a vLLM OpenAI server on 127.0.0.1, its `--port` in it) in its own process
    group with `env` added to this environment (in the folder `cwd`, default this one), wait
    for `/health`, yield the base URL, and stop the whole group afterwards. `timeout_setting`
    names the config key of the timeout in the error."""
    port = command[command.index("--port") + 1]
    base_url = f"http://127.0.0.1:{port}"
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; read by the CPU backend only
    log_path = Path(log_path)
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
            cwd=cwd,
        )  # fmt: skip
        try:
            deadline = time.time() + startup_timeout_s
            answered_by_another = False
            while True:
                if process.poll() is not None:
                    taken = f" (port {port} is held by another program)" * answered_by_another
                    raise VllmServerError(
                        f"vLLM exited with {process.returncode} while starting{taken}; "
                        f"see {log_path}"
                    )
                try:
                    healthy = httpx.get(f"{base_url}/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    healthy = False
                if healthy:
                    ours = group_holds_listening_socket(process.pid, int(port))
                    if ours is not False:
                        break
                    answered_by_another = True
                if time.time() > deadline:
                    raise VllmServerError(
                        f"vLLM not healthy after {startup_timeout_s:.0f} s ({timeout_setting}); "
                        f"see {log_path}"
                    )
                time.sleep(1)
            yield base_url
        finally:
            stop_process_group(process)
