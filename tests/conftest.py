"""Shared fixtures: the fixture target model (built once per session), the sample data, and
the training world of tests/train_helpers.py with a draft trained on it (once per module).

Set EAGLET_TEST_FIXTURE_MODEL to a folder built by `eaglet fixture-model` to reuse it across
sessions (`make test` hands over the demo's, or builds one beside the vLLM venv's install).
Under pytest-xdist the workers share one build.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Helper modules that assert, rewritten as test modules are so that a failure shows its values.
pytest.register_assert_rewrite("tests.work_dir_lock_helpers")

# Every Prefect temporary server a test (or a run it starts) brings up migrates a fresh SQLite
# database first; on a loaded CI machine that takes longer than Prefect's 20 s default.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")


@pytest.fixture(scope="session")
def fixture_model_dir(tmp_path_factory) -> Path:
    reuse = os.environ.get("EAGLET_TEST_FIXTURE_MODEL")
    if reuse and (Path(reuse) / "config.json").exists():
        return Path(reuse)
    from eaglet.fixture.model import build_fixture_model

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build_fixture_model(tmp_path_factory.mktemp("fixture") / "model", seed=0)
    # pytest-xdist: the first worker builds it in the folder all workers share, the others wait.
    shared = tmp_path_factory.getbasetemp().parent / "fixture-model"
    with open(shared.parent / "fixture-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "model.safetensors").exists():
            shutil.rmtree(shared, ignore_errors=True)  # a build cut short
            build_fixture_model(shared, seed=0)
    return shared


@pytest.fixture(scope="session")
def drifted_model_dir(tmp_path_factory, fixture_model_dir) -> Path:
    """The fixture target trained further on the restyled corpus (`eaglet fixture-model
    --continue-from`, about 25 s): a target that drifted, which the fixture's drafts feel."""
    from eaglet.fixture.model import build_fixture_model

    shared = tmp_path_factory.getbasetemp().parent / "drifted-model"
    with open(shared.parent / "drifted-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "model.safetensors").exists():
            shutil.rmtree(shared, ignore_errors=True)
            build_fixture_model(shared, continue_from=fixture_model_dir, corpus="restyled")
    return shared


@pytest.fixture(scope="session")
def sample_data_dir(tmp_path_factory) -> Path:
    from eaglet.fixture.sample_data import write_sample_data

    folder = tmp_path_factory.mktemp("data")
    write_sample_data(folder, seed=0)
    return folder


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one thread is several times faster than two on a shared 2-core box.
    The modules on the training world (tests/train_helpers.py) use it for all their tests:
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The training world of tests/train_helpers.py, once per module: the tiny target in
    `world / "target"` and the hidden-state shards of its greedy answers to 64 random prompts in
    `world / "hs"`. (Modules with a world of their own define their own `world`.)"""
    from tests.train_helpers import make_world

    root = tmp_path_factory.mktemp("eagle")
    make_world(root, 64)
    return root


@pytest.fixture(scope="module")
def trained(world):
    """A draft trained on `world` (tests/train_helpers.py's `settings()`) into
    `world / "run"`, once per module: (its summary, its progress records)."""
    from eaglet.draft.train import train_draft
    from tests.train_helpers import AUX_IDS, CONVENTION, settings

    progress = []
    summary = train_draft(
        world / "hs",
        world / "target",
        world / "run",
        settings(),
        AUX_IDS,
        CONVENTION,
        progress=progress.append,
    )
    return summary, progress


def small_run_overrides(work_dir: Path, model_dir: Path, data_dir: Path) -> list[str]:
    """A pipeline small enough for a test: a few samples per source, one short epoch."""
    return [
        f"work_dir={work_dir}",
        f"target.model={model_dir}",
        f"datasets=[{{source: arith, path: {data_dir / 'arith.jsonl'}, limit: 16}}, "
        f"{{source: tools, path: {data_dir / 'tools.jsonl'}, limit: 8}}]",
        "generation.max_tokens=160",
        "reasoning.min_capture_rate=0.5",  # a handful of samples from a 2M-parameter model
        "train.epochs=1",
        "train.holdout_fraction=0.2",
        "evaluate.max_prompts=2",
        "evaluate.max_new_tokens=48",
    ]


class SharedPrefectServer:
    """One real Prefect API server (`prefect server start`, its own SQLite database) for
    every `eaglet` process the tests start, started on first use and stopped at the end of
    the session. Without it each `eaglet run` starts Prefect's temporary server and migrates
    a fresh database: about 12 s per run on this machine, across some 40 runs of the suite.
    Tests of the temporary server itself (kill -9 takes it along; secrets never reach its
    database) pass {"PREFECT_API_URL": None} to `cli_env`."""

    process: subprocess.Popen | None = None
    url: str | None = None

    @classmethod
    def api_url(cls) -> str:
        if cls.url is not None:
            return cls.url
        from eaglet.vllm_process import free_port

        home = Path(tempfile.mkdtemp(prefix="eaglet-test-prefect-"))
        port = free_port()
        cls.process = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(port), "--no-ui", "--no-scheduler", "--no-late-runs",
             "--analytics-off"],
            env={**os.environ, "PREFECT_HOME": str(home)},
            stdout=open(home / "server.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}/api"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if cls.process.poll() is not None:
                raise RuntimeError((home / "server.log").read_text()[-3000:])
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    cls.url = url
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        cls.stop()
        raise RuntimeError(f"the tests' Prefect server did not answer within 300 s: {home}")

    @classmethod
    def stop(cls) -> None:
        if cls.process is not None and cls.process.poll() is None:
            os.killpg(cls.process.pid, signal.SIGTERM)
            try:
                cls.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(cls.process.pid, signal.SIGKILL)
                cls.process.wait()
        cls.process, cls.url = None, None


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_prefect_server():
    yield
    SharedPrefectServer.stop()


def cli_env(
    cwd: Path, env: dict[str, str | None] | None = None, prefect: bool = True
) -> dict[str, str]:
    """The environment of an `eaglet` process a test starts: this one's, the session's
    Prefect server (`prefect`: for a command that talks to Prefect; started on first use,
    about 10 s, and only then), a Prefect home in `cwd`, then `env` (a None value removes a
    variable). Without `prefect` no API URL is set: a command that still made a flow run would
    start Prefect's temporary server, slower, never a user's server."""
    env = env or {}
    wanted = prefect and "PREFECT_API_URL" not in env
    full_env = {
        **os.environ,
        "PREFECT_HOME": str(cwd / ".prefect-home"),
        "PREFECT_API_URL": SharedPrefectServer.api_url() if wanted else None,
        **env,
    }
    return {key: value for key, value in full_env.items() if value is not None}


# `eaglet` commands that never talk to a Prefect API (no flow run, deployment or block: a
# `doctor` may read a Secret block), and `run --plan`
OFFLINE_COMMANDS = {"inspect", "gc", "fixture-model"}


def uses_prefect(args: list[str]) -> bool:
    return not (args and (args[0] in OFFLINE_COMMANDS or (args[0] == "run" and "--plan" in args)))


def run_cli(
    args: list[str], cwd: Path = ROOT, env: dict[str, str | None] | None = None, timeout=1500
) -> subprocess.CompletedProcess:
    """Run `python -m eaglet_prefect.flows.cli ARGS` (the `eaglet` command) in a fresh
    process, as a user would from a shell."""
    return subprocess.run(
        [sys.executable, "-m", "eaglet_prefect.flows.cli", *args],
        cwd=cwd,
        env=cli_env(cwd, env, prefect=uses_prefect(args)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_http_run_config(
    folder: Path, model_dir: Path, data_dir: Path, url: str, samples: int, **generation
) -> Path:
    """`folder/config.yaml`: `samples` arith rows generated by the vllm engine at `url`."""
    config = {
        "work_dir": str(folder / "work"),
        "target": {"model": str(model_dir)},
        "datasets": [{"source": "arith", "path": str(data_dir / "arith.jsonl"), "limit": samples}],
        "generation": {"engine": "vllm", "endpoints": [url], "served_model": "tiny", **generation},
    }
    path = folder / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@contextlib.contextmanager
def small_tmpfs(mount: Path, size: str):
    """A real filesystem of `size` (e.g. "8m") mounted at `mount` for a disk-budget test;
    skips the test where mounting is not permitted (it needs root, which CI has)."""
    mount.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root (CI runs this as root)")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mount not permitted here: {mounted.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


# The longest modules start first, so that under pytest-xdist (`--dist loadfile`) no worker is
# left with one of them at the end while the other idles: the demo builds its own model.
LONGEST_MODULES = (
    "test_pipeline.py",
    "test_serving_vllm.py",
    "test_security.py",
    "test_real_shape.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)

    items.sort(key=rank)  # stable: each module's own order is kept


@pytest.fixture(scope="session")
def postgres():
    """One private PostgreSQL cluster per test process (tests/postgres_helpers.py) for the
    Prefect servers of a team's setup, each on a database of its own; the tests that need it
    skip where PostgreSQL is not installed (`.ci/run` installs it)."""
    from tests.postgres_helpers import Postgres, postgres_bin

    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    cluster = Postgres()
    cluster.start()
    yield cluster
    cluster.stop()
