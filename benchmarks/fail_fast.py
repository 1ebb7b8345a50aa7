"""Seconds from `eaglet run` (and `eaglet doctor`) to the failure, per deterministic fault.

    python benchmarks/fail_fast.py [--model DIR] [--only NAME ...] [--skip-vllm]

Faults (goal: each fails in under a minute, with the canary's own limits):
- no_reasoning_parser: a real vLLM server (.vllm-venv) without --reasoning-parser, openai engine;
- wrong_model_name: the same server, generation.served_model it does not serve;
- colliding_layer_ids: a 4-layer target (the fixture's config.json with 4 layers): the
  default aux layer ids are [2, 2, 1];
- wrong_template_kwargs: tokenize.chat_template_kwargs with a key the template never reads;
- server_never_answers: a socket that accepts connections and never writes a byte
  (request_timeout_s left at its 1800 s default).

Each `eaglet run CONFIG --until generate` and `eaglet doctor CONFIG` runs in a fresh process
(with its own temporary Prefect server for `run`), so the times include Python and Prefect
start-up: the baseline rows (a config error, caught before anything starts, and doctor on a
good local config) show that fixed cost in the same run. The `retries` column counts Prefect
task retries seen in the output ("Retrying" lines); it should be 0 for every fault here.
Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextmanager
def silent_server():
    """Accepts connections, reads nothing back, never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        listener.close()


def four_layer_copy(model: Path, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for item in model.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "config.json").unlink()
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 4
    if isinstance(config.get("layer_types"), list):  # one entry per layer
        config["layer_types"] = config["layer_types"][:4]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def timed(args: list[str], env: dict[str, str], timeout: int = 1200) -> tuple[float, int, str]:
    started = time.perf_counter()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "eaglet_prefect.flows.cli", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, out = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = -1, f"TIMED OUT after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
    return time.perf_counter() - started, code, out


def _clock(line: str) -> float | None:
    try:
        h, m, rest = line[:12].split(":")
        return int(h) * 3600 + int(m) * 60 + float(rest)
    except ValueError:
        return None


def in_flow_seconds(text: str) -> float | None:
    """From the flow run's first log line to its failure: the time eaglet itself took, without
    Python, Prefect and the temporary server starting (`run` only)."""
    begin = next((_clock(x) for x in text.splitlines() if "Beginning flow run" in x), None)
    end = next(
        (_clock(x) for x in text.splitlines() if "Flow run" in x and "Finished in state" in x),
        None,
    )
    return None if begin is None or end is None else (end - begin) % 86400


def last_line(text: str, *markers: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for marker in markers:
        found = [line for line in lines if marker in line]
        if found:
            return found[-1][:150]
    return lines[-1][:150] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("EAGLET_TEST_FIXTURE_MODEL"))
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--skip-vllm", action="store_true")
    args = parser.parse_args()
    from eaglet.fixture.sample_data import write_sample_data

    tmp = Path(tempfile.mkdtemp(prefix="eaglet-fail-fast-"))
    model = Path(args.model) if args.model else None
    if model is None or not (model / "config.json").exists():
        from eaglet.fixture.model import build_fixture_model

        model = build_fixture_model(tmp / "fixture", seed=0)
    data = write_sample_data(tmp / "data", seed=0)
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "OMP_NUM_THREADS": "1"}

    def config(name: str, **changes) -> Path:
        base = {
            "name": name,
            "work_dir": str(tmp / "work" / name),
            "target": {"model": str(model)},
            "datasets": [{"source": "arith", "path": str(data["arith"]), "limit": 8}],
            "generation": {"engine": "vllm", "served_model": "tiny"},
        }
        for key, value in changes.items():
            section, _, field = key.partition("__")
            if field:
                base.setdefault(section, {})[field] = value
            else:
                base[section] = value
        path = tmp / f"{name}.yaml"
        path.write_text(json.dumps(base))
        return path

    rows: list[tuple[str, str, float, int, int, str]] = []

    def measure(fault: str, path: Path) -> None:
        if args.only is not None and fault not in args.only:
            return
        for command in ("run", "doctor"):
            extra = ["--until", "generate"] if command == "run" else []
            seconds, code, out = timed([command, str(path), *extra], env)
            retries = out.count("Retrying")
            why = last_line(out, "problem:", "error:", "Error")
            flow = in_flow_seconds(out)
            rows.append((fault, command, seconds, code, retries, why))
            inside = f" (in the flow {flow:.1f} s)" if flow is not None else ""
            print(f"{fault:<24} {command:<7} {seconds:7.1f} s{inside}  exit {code}  retries "
                  f"{retries}  {why}", flush=True)  # fmt: skip
            (tmp / f"{fault}-{command}.log").write_text(out)

    print(f"logs in {tmp}", flush=True)
    measure("baseline_config_error", config("baseline", unknown_key=1))
    measure("baseline_good_local", config("good", generation={"engine": "local"}))
    measure(
        "colliding_layer_ids",
        config("layers", target={"model": str(four_layer_copy(model, tmp / "four"))}),
    )
    measure(
        "wrong_template_kwargs",
        config("kwargs", tokenize={"chat_template_kwargs": {"enable_thinkng": False}}),
    )
    with silent_server() as url:
        measure("server_never_answers", config("silent", generation__endpoints=[url]))
    if not args.skip_vllm:
        from tests.vllm_server import vllm_server

        with ExitStack() as stack:
            url = stack.enter_context(vllm_server(model, tmp / "vllm.log", timeout=900))
            measure(
                "no_reasoning_parser",
                config(
                    "parser",
                    generation={"engine": "openai", "endpoints": [url], "served_model": "tiny"},
                ),
            )
            measure(
                "wrong_model_name",
                config(
                    "model_name",
                    generation={"engine": "vllm", "endpoints": [url], "served_model": "qwen3"},
                ),
            )
    print("\nfault                    command  seconds  exit  retries")
    base = {c: s for f, c, s, *_ in rows if f == "baseline_config_error"}
    for fault, command, seconds, code, retries, _ in rows:
        ratio = f"{seconds / base[command]:.2f}x baseline" if base.get(command) else ""
        print(f"{fault:<24} {command:<8} {seconds:7.1f}  {code:>4}  {retries:>7}  {ratio}")
    shutil.rmtree(tmp / "work", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
