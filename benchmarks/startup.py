"""Start-up of `eaglet run`: seconds from the process's start to its first stage starting, with
the temporary Prefect server (no PREFECT_API_URL) and with a running one (`prefect server
start`, launched here and waited for before the clock starts), and their ratio.

    python benchmarks/startup.py [--model DIR] [--repeat N]

The run is `eaglet run CONFIG --until download` on a dataset that is a named pipe: the clock
stops when the download stage opens it (this script's `open(fifo, "w")` returns then), which
is the first stage doing its work; the rows are then written and the run finishes. Each figure
is printed with the machine's load averages (1, 5, 15 min) at its start and end: on a shared
machine the same run takes several times longer under load. Nothing here asserts on time.

--model is a target folder built by `eaglet fixture-model` (default: EAGLET_TEST_FIXTURE_MODEL,
else one is built, about 4 min of one core).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
ROWS = 8


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fixture_model(given: Path | None) -> Path:
    if given is not None:
        return given
    reuse = os.environ.get("EAGLET_TEST_FIXTURE_MODEL")
    if reuse and (Path(reuse) / "config.json").exists():
        return Path(reuse)
    from eaglet.fixture.model import build_fixture_model

    print("building the fixture model (about 4 min of one core)...", flush=True)
    return build_fixture_model(Path(tempfile.mkdtemp(prefix="eaglet-startup-")) / "model")


def sample_rows(folder: Path) -> bytes:
    from eaglet.fixture.sample_data import write_sample_data

    write_sample_data(folder, seed=0)
    lines = (folder / "arith.jsonl").read_bytes().splitlines(keepends=True)
    return b"".join(lines[:ROWS])


def start_prefect_server(home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
         "--port", str(port), "--no-ui", "--no-scheduler", "--no-late-runs", "--analytics-off"],
        env={**os.environ, "PREFECT_HOME": str(home)},
        stdout=open(home / "server.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit((home / "server.log").read_text()[-3000:])
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit("the Prefect server did not answer within 600 s")


def timed_run(folder: Path, model: Path, rows: bytes, env: dict[str, str]) -> dict:
    """One `eaglet run --until download`: seconds to the first stage, and to the end."""
    folder.mkdir(parents=True)
    fifo = folder / "rows.jsonl"
    os.mkfifo(fifo)
    config = folder / "config.yaml"
    config.write_text(
        json.dumps(
            {
                "name": "startup",
                "work_dir": str(folder / "work"),
                "target": {"model": str(model)},
                "datasets": [{"source": "arith", "path": str(fifo)}],
            }
        )
    )
    opened: dict[str, float] = {}

    def feed() -> None:
        with open(fifo, "wb") as pipe:  # returns when the download stage opens the pipe
            opened["at"] = time.monotonic()
            pipe.write(rows)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    before = load()
    started = time.monotonic()
    with open(folder / "run.log", "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eaglet_prefect.flows.cli",
                "run",
                str(config),
                "--until",
                "download",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=1200)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    ended = time.monotonic()
    if code != 0 or "at" not in opened:
        if "at" not in opened:  # unblock the feeder
            with open(fifo, "rb"):
                pass
        sys.exit(f"the run failed ({code}):\n" + (folder / "run.log").read_text()[-4000:])
    return {
        "first_stage_s": opened["at"] - started,
        "total_s": ended - started,
        "load_before": before,
        "load_after": load(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=2, help="runs per mode (default 2)")
    args = parser.parse_args()
    model = fixture_model(args.model)
    base = Path(tempfile.mkdtemp(prefix="eaglet-startup-"))
    rows = sample_rows(base / "data")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH")
    }
    env.update({"OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"), "PYTHONPATH": str(ROOT)})
    results: dict[str, list[dict]] = {"temporary server": [], "running server": []}

    home = base / "prefect-temporary"  # one home: its first run migrates a new database
    home.mkdir()
    for i in range(args.repeat):
        results["temporary server"].append(
            timed_run(base / f"temporary-{i}", model, rows, {**env, "PREFECT_HOME": str(home)})
        )
        print(f"temporary server run {i + 1}: {fmt(results['temporary server'][-1])}", flush=True)

    home = base / "prefect-running"
    home.mkdir()
    server, url = start_prefect_server(home)
    try:
        for i in range(args.repeat):
            run_env = {**env, "PREFECT_HOME": str(home), "PREFECT_API_URL": url}
            results["running server"].append(timed_run(base / f"running-{i}", model, rows, run_env))
            print(f"running server run {i + 1}:   {fmt(results['running server'][-1])}", flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)

    print()
    print("eaglet run CONFIG --until download: seconds from the process's start to the first stage")
    best = {}
    for mode, runs in results.items():
        best[mode] = min(r["first_stage_s"] for r in runs)
        figures = ", ".join(
            f"{r['first_stage_s']:.1f} s (load {r['load_before']} -> {r['load_after']})"
            for r in runs
        )
        print(f"  {mode:<17} {figures}")
    ratio = best["temporary server"] / best["running server"]
    print(f"  temporary / running server (best of each): {ratio:.2f}x")
    print(f"  machine: {os.cpu_count()} CPUs; load averages are 1/5/15 min")


def fmt(result: dict) -> str:
    return (
        f"first stage at {result['first_stage_s']:.1f} s, done at {result['total_s']:.1f} s "
        f"(load {result['load_before']} -> {result['load_after']})"
    )


if __name__ == "__main__":
    main()
