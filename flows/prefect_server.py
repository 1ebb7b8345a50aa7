"""Prefect API servers as the `eaglet` command meets them: the temporary server of a run
started without PREFECT_API_URL (its own process session, dying with eaglet even on kill -9),
the URL and credentials of the active Prefect profile, waiting for a server to answer, and a
team's server that refuses a client without its credentials (basic authentication:
PREFECT_SERVER_API_AUTH_STRING on the server, PREFECT_API_AUTH_STRING on each client)."""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGKILL when `parent` dies, even by kill -9 (Linux's
    PR_SET_PDEATHSIG; elsewhere a no-op)."""

    def preexec() -> None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


class TemporaryPrefectServer:
    """The Prefect API server of a run started without PREFECT_API_URL: Prefect's own temporary
    server (uvicorn serving `prefect.server.api.server:create_app`, no UI, the database in
    PREFECT_HOME), started by eaglet so that

    - it starts first, before eaglet imports Prefect, the flows and torch (tens of seconds on
      a loaded machine), and comes up while they load (Prefect's own starts after them, and
      only when the flow is called);
    - it is in its own session: a signal to eaglet's process group (Ctrl-C, `timeout`,
      scancel) leaves it up, so the interrupted flow run is still marked Crashed, and eaglet
      stops it at exit, after Prefect has sent its last logs;
    - it dies with eaglet even on kill -9 (PR_SET_PDEATHSIG, set from the main thread: the
      hook follows the thread that forked).

    The run uses it as any server at PREFECT_API_URL (set for this process and its children)."""

    STARTUP_TIMEOUT_S = 120  # Prefect's 20 s default is short for a busy machine
    running: ClassVar[list[TemporaryPrefectServer]] = []

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.started = 0.0

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self) -> None:
        import importlib.util
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        spec = importlib.util.find_spec("prefect")  # its folder, without importing it
        assert spec is not None and spec.origin is not None
        app_dir = str(Path(spec.origin).parent.parent)
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "uvicorn", "--app-dir", app_dir,
                "--factory", "prefect.server.api.server:create_app",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "error", "--lifespan", "on",
            ],
            env={
                **os.environ,
                "PREFECT_UI_ENABLED": "0",
                "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1",
            },
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )  # fmt: skip
        if self not in self.running:
            self.running.append(self)
            atexit.register(self.stop)  # before Prefect's exit hooks, so it runs after them

    def wait(self) -> None:
        """Until the server answers /health; a server that exits at start (its port taken
        meanwhile) is started again on another port."""
        import httpx

        configured = os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "0")
        timeout = max(float(configured or 0), self.STARTUP_TIMEOUT_S)
        restarts = 0
        with httpx.Client(timeout=5) as client:
            while True:
                assert self.process is not None
                if self.process.poll() is not None:
                    if restarts >= 3:
                        raise RuntimeError(
                            f"the temporary Prefect server exited with {self.process.returncode}"
                            " while starting; set PREFECT_API_URL to a running server instead"
                        )
                    restarts += 1
                    self.start()
                    continue
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() - self.started > timeout:
                    raise RuntimeError(
                        f"the temporary Prefect server did not answer within {timeout:.0f} s; "
                        "set PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher, or "
                        "PREFECT_API_URL to a running server"
                    )
                time.sleep(0.1)

    def stop(self, grace_s: float = 5.0) -> None:
        from eaglet import shutdown

        grace_s = min(grace_s, max(0.5, shutdown.time_left() - 1.5))  # after SIGINT/SIGTERM
        process, self.process = self.process, None
        if self in self.running:
            self.running.remove(self)
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def profile_setting(name: str) -> str | None:
    """A setting of the active Prefect profile (`prefect config set`), read without importing
    Prefect."""
    import tomllib

    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return None
    profile = os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
    value = profiles.get("profiles", {}).get(profile, {}).get(name)
    return str(value) if value else None


class CredentialsRefused(RuntimeError):
    """The Prefect server at PREFECT_API_URL answered 401: it wants credentials this client
    lacks (or has wrong). The message says which setting to give, never its value."""


def check_credentials(api_url: str) -> None:
    """Raise `CredentialsRefused` when the server at `api_url` refuses this client's
    credentials (PREFECT_API_AUTH_STRING, from the environment or the profile); a server
    without authentication, or one that does not answer, passes (the caller waits for it)."""
    import httpx

    auth = os.environ.get("PREFECT_API_AUTH_STRING") or profile_setting("PREFECT_API_AUTH_STRING")
    basic = httpx.BasicAuth(*auth.split(":", 1)) if auth and ":" in auth else None
    try:
        status = httpx.get(f"{api_url.rstrip('/')}/admin/version", auth=basic, timeout=10)
    except httpx.HTTPError:
        return
    if status.status_code != 401:
        return
    given = "the one PREFECT_API_AUTH_STRING gives" if auth else "none (PREFECT_API_AUTH_STRING"
    given += " is refused" if auth else " is not set)"
    raise CredentialsRefused(
        f"the Prefect server at {api_url} requires credentials (basic authentication) and "
        f"refused this client's: {given}. Set PREFECT_API_AUTH_STRING to the server's "
        "PREFECT_SERVER_API_AUTH_STRING (user:password), in the environment or with "
        "`prefect config set`"
    )


# `eaglet serve` right after `prefect server start --background`: the server needs seconds.
SERVER_WAIT_S = 120
# ... but where nothing on this machine is starting one, a loopback URL gets this long.
NO_SERVER_STARTING_WAIT_S = 5
DEFAULT_SERVER_PORT = 4200  # `prefect server start` without --port


def _port_of(words: list[bytes]) -> int:
    """The port a server's command line names (`--port N` or `--port=N`), else Prefect's."""
    for i, word in enumerate(words):
        value = words[i + 1] if word == b"--port" and i + 1 < len(words) else None
        if word.startswith(b"--port="):
            value = word.split(b"=", 1)[1]
        if value is not None and value.isdigit():
            return int(value)
    return DEFAULT_SERVER_PORT


def prefect_server_starting(proc: Path = Path("/proc"), port: int | None = None) -> bool | None:
    """Whether a `prefect server start` (or Prefect's API app, `prefect.server...`, under
    uvicorn) runs on this machine, for `port` when one is given (a server on another port
    will never answer this one); None where /proc cannot say."""
    if not proc.is_dir():
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        cli = any(
            a.endswith(b"prefect") and b == b"server"
            for a, b in zip(words, words[1:], strict=False)
        )
        if cli or any(word.startswith(b"prefect.server") for word in words):
            if port is None or _port_of(words) == port:
                return True  # `prefect server start`, or its API app under uvicorn
    return False


def server_wait_s(api_url: str) -> float:
    """How long `eaglet serve` waits for `api_url`: long where a server may still be starting,
    a few seconds for a loopback URL no process on this machine is starting a server for."""
    from urllib.parse import urlparse

    url = urlparse(api_url)
    host = url.hostname or ""
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    port = url.port or (443 if url.scheme == "https" else 80)
    if loopback and prefect_server_starting(port=port) is False:
        return NO_SERVER_STARTING_WAIT_S
    return SERVER_WAIT_S


def wait_for_server(api_url: str, timeout_s: float) -> bool:
    """True once `api_url/health` answers 200 (saying once that it waits), False at the end
    of `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            if httpx.get(f"{api_url.rstrip('/')}/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return False
        if not said:
            print(f"waiting up to {timeout_s:.0f} s for the Prefect server at {api_url} ...",
                  flush=True)  # fmt: skip
            said = True
        time.sleep(1)
