"""A private PostgreSQL cluster for the tests' Prefect servers (a team's server runs Prefect on
PostgreSQL): Debian's postgresql binaries (`.ci/run` installs them), `initdb` into a temporary
folder and `postgres` on a free loopback port with password authentication, run as the
`postgres` user when the tests run as root (PostgreSQL refuses root). One cluster per test
process; each Prefect server gets a database of its own. Durability settings are off
(fsync, synchronous commit): a test's database dies with the test, and the server with the
test process, even one killed (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from eaglet_prefect.flows.prefect_server import _die_with_parent
from tests.vllm_server import free_port

USER = "eaglet"


def postgres_bin() -> Path | None:
    """The newest installed PostgreSQL's binaries (`/usr/lib/postgresql/<version>/bin`)."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3])
    )
    return found[-1].parent if found else None


class Postgres:
    """One running cluster: `database(name)` makes a database and gives its SQLAlchemy URL
    (asyncpg, as Prefect's server needs)."""

    def __init__(self) -> None:
        binaries = postgres_bin()
        if binaries is None:
            raise FileNotFoundError("no PostgreSQL under /usr/lib/postgresql (apt: postgresql)")
        self.bin = binaries
        self.folder = Path(tempfile.mkdtemp(prefix="eaglet-test-pg-"))
        self.password = secrets.token_hex(12)
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.owner = "postgres" if os.geteuid() == 0 else None  # root may not run postgres
        if self.owner is not None:
            entry = pwd.getpwnam(self.owner)
            os.chown(self.folder, entry.pw_uid, entry.pw_gid)

    def _run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            command,
            user=self.owner,
            group=self.owner,
            extra_groups=[] if self.owner else None,
            cwd=self.folder,
            capture_output=True,
            text=True,
            check=True,
            **kwargs,
        )

    def start(self, timeout_s: float = 120) -> None:
        password_file = self.folder / "password"
        password_file.write_text(self.password)
        if self.owner is not None:
            shutil.chown(password_file, self.owner, self.owner)
        data = self.folder / "data"
        self._run(
            [str(self.bin / "initdb"), "-D", str(data), "-U", USER, "--pwfile",
             str(password_file), "--auth=scram-sha-256", "-E", "UTF8", "--no-sync"],
        )  # fmt: skip
        password_file.unlink()
        self.process = subprocess.Popen(
            [str(self.bin / "postgres"), "-D", str(data), "-p", str(self.port),
             "-k", str(self.folder), "-c", "listen_addresses=127.0.0.1",
             "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
             "-c", "max_connections=200"],
            user=self.owner, group=self.owner, extra_groups=[] if self.owner else None,
            cwd=self.folder, stdout=open(self.folder / "postgres.log", "w"),
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()),
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            ready = subprocess.run(
                [str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                capture_output=True,
            )
            if ready.returncode == 0:
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.folder / "postgres.log").read_text()[-3000:]
                self.stop()
                raise RuntimeError(f"PostgreSQL did not start: {log}")
            time.sleep(0.2)

    def database(self, name: str) -> str:
        """Create database `name`; its URL for Prefect (`PREFECT_API_DATABASE_CONNECTION_URL`)."""
        self._run(
            [str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER,
             name],
            env={**os.environ, "PGPASSWORD": self.password},
        )  # fmt: skip
        return f"postgresql+asyncpg://{USER}:{self.password}@127.0.0.1:{self.port}/{name}"

    def query(self, database: str, sql: str) -> str:
        """What `psql` prints for `sql` in `database` (unaligned, tuples only)."""
        return self._run(
            [str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", USER,
             "-d", database, "-At", "-c", sql],
            env={**os.environ, "PGPASSWORD": self.password},
        ).stdout.strip()  # fmt: skip

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(2)  # SIGINT: PostgreSQL's fast shutdown
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        shutil.rmtree(self.folder, ignore_errors=True)
