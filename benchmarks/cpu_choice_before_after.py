"""The demo's train stage and the fast test suite, with the CPU thread and wait choice of an
earlier commit (`--before`, default the one before the bounded spin of issue 41) against
today's: the same tree twice, differing only in `eaglet/cpu_threads.py`.

1. Two copies of this checkout's committed tree (`git archive HEAD`): "after" as it is,
   "before" with `eaglet/cpu_threads.py` from `--before`.
2. The train stage: its body (`eaglet.stage_bodies.train.run`) on a finished demo work dir's
   hidden-state shards (`--work-dir`, default runs/demo: run `make demo` first), into a fresh
   folder, timed end to end (training, export, plot) in a fresh process per measurement.
3. The fast suite (`make test-fast`'s selection, 2 pytest-xdist workers, the `serial` part
   left out, and tests/test_cpu_threads.py: it tests today's module), timed by wall clock;
   `--skip-suite` leaves it out.
4. Rounds: before and after alternate (the order rotated each round), `--repeats` rounds;
   medians with (lowest-highest); after/before ratios. Load averages (1, 5, 15 min) printed
   before and after each measurement: nothing else should run meanwhile.

    python benchmarks/cpu_choice_before_after.py [--work-dir runs/demo] [--repeats 3]
        [--before f47eb00^] [--skip-suite]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TRAIN_RUNNER = """
import json, sys, tempfile, time
from pathlib import Path
from eaglet.config import load_config
from eaglet.stage_context import PlainContext
from eaglet.stage_bodies.every_stage import BODIES
from eaglet.storage import read_manifest

work_dir = Path(sys.argv[1]).resolve()
run = json.loads((work_dir / "run.json").read_text())["stages"]
config = load_config(str(work_dir / "config.yaml"), [])
inputs = {
    "features": read_manifest(Path(run["hidden_states"]["path"])),
    "examples": read_manifest(Path(run["extract"]["path"])),
}
lines = []
body = BODIES["train"]
with tempfile.TemporaryDirectory() as scratch:
    folder = Path(scratch) / "train.partial"
    folder.mkdir()
    config = config.model_copy(update={"work_dir": str(work_dir)})
    started = time.perf_counter()
    body(PlainContext(log=lines.append), config, inputs, folder)
    seconds = time.perf_counter() - started
chosen = [line for line in lines if "thread" in line][:1]
print(json.dumps({"seconds": seconds, "threads": chosen}))
"""

SUITE = "not slow and not vllm and not browser and not serial"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def export_tree(destination: Path, before: str | None) -> Path:
    """HEAD's committed files in `destination`; `eaglet/cpu_threads.py` from `before`."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(destination, filter="data")
    if before is not None:
        old = subprocess.run(
            ["git", "show", f"{before}:eaglet/cpu_threads.py"],
            cwd=ROOT, check=True, capture_output=True,
        ).stdout  # fmt: skip
        (destination / "eaglet" / "cpu_threads.py").write_bytes(old)
    return destination


def environment(tree: Path, fixture: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.pop("GOMP_SPINCOUNT", None)
    env["PYTHONPATH"] = str(tree)
    env["EAGLET_TEST_FIXTURE_MODEL"] = str(fixture)
    return env


def time_train(tree: Path, work_dir: Path, fixture: Path) -> tuple[float, str]:
    done = subprocess.run(
        [sys.executable, "-c", TRAIN_RUNNER, str(work_dir)],
        cwd=tree, env=environment(tree, fixture), capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"train stage failed in {tree}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["seconds"], "; ".join(result["threads"])


def time_suite(tree: Path, fixture: Path) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadfile", "-m", SUITE, "--ignore", "tests/test_cpu_threads.py"],
        cwd=tree, env=environment(tree, fixture), capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    if done.returncode != 0:
        raise SystemExit(f"the fast suite failed in {tree}:\n{done.stdout[-3000:]}")
    return seconds, tail


def summary(name: str, figures: dict[str, list[float]]) -> None:
    medians = {variant: statistics.median(values) for variant, values in figures.items()}
    for variant, values in figures.items():
        print(f"  {name} {variant:<6} median {medians[variant]:7.1f} s "
              f"({min(values):.1f}-{max(values):.1f}) over {len(values)}")  # fmt: skip
    print(f"  {name} after/before: {medians['after'] / medians['before']:.2f}x the time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "demo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", default="f47eb00^")
    parser.add_argument("--skip-suite", action="store_true")
    args = parser.parse_args()
    work_dir = args.work_dir.resolve()
    fixture = work_dir / "models" / "fixture"
    if not (work_dir / "run.json").is_file() or not (fixture / "model.safetensors").is_file():
        raise SystemExit(f"{work_dir} holds no finished demo: run `make demo` first")
    scratch = Path(tempfile.mkdtemp(prefix="cpu-choice-"))
    try:
        trees = {
            "before": export_tree(scratch / "before", args.before),
            "after": export_tree(scratch / "after", None),
        }
        print(f"before: HEAD with eaglet/cpu_threads.py of {args.before}; after: HEAD; "
              f"{os.cpu_count()} CPUs; load {load()}")  # fmt: skip
        train = {"before": [], "after": []}
        suite = {"before": [], "after": []}
        order = ["before", "after"]
        for round_number in range(args.repeats):
            for variant in order if round_number % 2 == 0 else order[::-1]:
                before_load = load()
                seconds, threads = time_train(trees[variant], work_dir, fixture)
                train[variant].append(seconds)
                print(f"round {round_number + 1} train  {variant:<6} {seconds:7.1f} s  load "
                      f"{before_load} -> {load()}  [{threads}]", flush=True)  # fmt: skip
                if args.skip_suite:
                    continue
                before_load = load()
                seconds, tail = time_suite(trees[variant], fixture)
                suite[variant].append(seconds)
                print(f"round {round_number + 1} suite  {variant:<6} {seconds:7.1f} s  load "
                      f"{before_load} -> {load()}  [{tail}]", flush=True)  # fmt: skip
        print("summary:")
        summary("train stage", train)
        if not args.skip_suite:
            summary("fast suite ", suite)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
