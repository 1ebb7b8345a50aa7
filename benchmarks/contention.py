"""The demo's training on a busy machine: tokens/s alone and beside one CPU-burning process per
core, libgomp's old settings against eaglet's thread choice (eaglet/cpu_threads.py); and the same
training inside a Prefect task against plain, in one run.

1. Examples: the fixture target's greedy answers to its own chat prompts (--samples), then the
   hidden_states stage body writes its shards (the demo's settings: int8, offline).
2. Every measurement is a fresh process (libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once,
   when torch loads) training the demo's TrainConfig (`PipelineConfig().train`, CPU) on those
   shards for --seconds after two warm-up steps; tokens/s = tokens trained / seconds.
   - old: the behaviour before eaglet chose threads: torch's default intra-op threads and
     libgomp's default wait (spin up to 300,000 times, ~3 ms, before sleeping);
   - new: eaglet's choice (cpu_threads.apply_threads: threads by affinity, quota and load;
     idle OpenMP threads sleep at once);
   - with --matrix, the variants that find the cause: threads 1 / 2 under each wait setting.
3. Each variant quiet, then beside one busy-loop process per usable CPU (--burners), then quiet
   again; loaded/quiet is the loaded figure over the mean of the two quiet ones.
4. Prefect: old and new, the training inside a Prefect task of a flow (a temporary Prefect
   server, run logs and a progress artifact as the train task writes them) against the same
   training plainly, alternated --prefect-repeats times (beside --prefect-burners busy loops).

    python benchmarks/contention.py [--target /tmp/eaglet-fixture-model] [--seconds 20]
        [--matrix] [--skip-contention] [--skip-prefect] [--prefect-burners N]

Measured on 2 shared cores (load averages in the commit that added this file; other agents'
jobs came and went): quiet, old ~6.8k tokens/s and new ~5.4k (idle threads that sleep lose
the ~30% a second spinning thread gains on these small ops); beside a burner per core, old
0.1-2.0k (down to 125), new 2.7-3.6k.

Times move with whatever else the machine runs: the load average (1, 5, 15 min) is printed
beside every figure, and nothing is asserted on time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BURN = "import time\nwhile True:\n    pass\n"
OLD_ENV = {"GOMP_SPINCOUNT": "300000"}  # libgomp's own default with OMP_WAIT_POLICY unset
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# --- child: one measurement ---------------------------------------------------------------


class Enough(Exception):
    pass


def child(spec: dict) -> None:
    """Train the job in `spec` for spec["seconds"] after two warm-up steps and print one JSON
    line: tokens/s, steps, the thread count and the choice eaglet logged."""
    import logging
    import threading

    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s", stream=sys.stderr)
    job = spec["job"]
    state = {"tokens": 0.0, "seconds": 0.0, "steps": 0, "last": None}

    def progress(record: dict) -> None:
        import torch

        now = time.time()
        state["threads"] = torch.get_num_threads()
        state["thread_name"] = threading.current_thread().name
        if record["step"] > 2 and state["last"] is not None:
            state["tokens"] += record["tokens_per_s"] * (now - state["last"])
            state["seconds"] += now - state["last"]
            state["steps"] += 1
        state["last"] = now
        if state["seconds"] >= spec["seconds"] and state["steps"] >= 3:
            raise Enough

    if spec.get("prefect"):
        run = prefect_runner(progress)
    else:
        from eaglet.draft.launch import run_job

        def run(job: dict) -> None:
            run_job(job, progress)

    try:
        run(job)
    except Enough:
        pass
    except Exception as exc:  # Prefect wraps the task's exception
        if "Enough" not in repr(exc) and not isinstance(exc.__cause__, Enough):
            raise
    result = {
        "tokens_per_s": state["tokens"] / max(state["seconds"], 1e-9),
        "seconds": state["seconds"],
        "steps": state["steps"],
        "threads": state.get("threads"),
        "thread": state.get("thread_name"),
        "wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "spincount": os.environ.get("GOMP_SPINCOUNT"),
    }
    print("RESULT " + json.dumps(result), flush=True)


def prefect_runner(measure):
    """The training as the train task runs it: inside a task of a flow, the progress records
    logged through the run logger (throttled) and written to a progress artifact."""
    from prefect import flow, get_run_logger, task
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from eaglet.draft.launch import run_training
    from eaglet.progress import Throttle

    @task(name="train")
    def train(job: dict) -> None:
        logger = get_run_logger()
        artifact = create_progress_artifact(progress=0.0, description="train: starting")
        throttle = Throttle()

        def progress(record: dict) -> None:
            if throttle.ready():
                logger.info("train step %d, %.0f tokens/s", record["step"], record["tokens_per_s"])
                update_progress_artifact(artifact, progress=1.0, description="training")
            measure(record)

        run_training(job, 1, progress, logger.info)

    @flow(name="contention-bench")
    def pipeline(job: dict) -> None:
        train(job)

    return pipeline


# --- parent ---------------------------------------------------------------------------------


def prepare(args, work: Path) -> dict:
    """Examples and shards of the fixture target; returns the demo's training job (offline)."""
    from eaglet.config import PipelineConfig, TargetConfig
    from eaglet.draft.launch import pipeline_job
    from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION, resolve_aux_layer_ids
    from eaglet.hidden_states.stage import stage_body
    from eaglet.target import load_config

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_throughput import write_fixture_examples

    target = TargetConfig(model=args.target, device="cpu")
    examples_path, _ = write_fixture_examples(target, args, work)
    # The demo's training settings; many epochs so the time limit, not the data, ends a run.
    train = PipelineConfig().train.model_copy(
        update={"device": "cpu", "log_every": 1, "epochs": 1000}
    )
    config = PipelineConfig(work_dir=str(work), target=target, train=train)
    hs = work / "hidden_states"
    hs.mkdir()
    started = time.time()
    stage_body(config, examples_path, report=lambda line: None)(hs)
    print(f"shards written in {time.time() - started:.1f} s (load {loadavg()})")
    info = {
        "aux_layer_ids": resolve_aux_layer_ids(None, load_config(target).num_hidden_layers),
        "aux_layer_convention": AUX_LAYER_CONVENTION,
    }
    return pipeline_job(config, work / "train", features_dir=hs, features_info=info)


def measure(job: dict, variant: dict, seconds: float, work: Path, prefect: bool = False) -> dict:
    job = json.loads(json.dumps(job))
    job["out_dir"] = str(work / f"train-{time.time_ns()}")
    job["resume"] = False
    job["train"]["threads"] = variant.get("threads")
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    env.update(variant.get("env", {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if prefect:
        env["PREFECT_HOME"] = str(work / "prefect-home")
        env.pop("PREFECT_API_URL", None)  # a temporary server, as `eaglet run` starts
        env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")
    spec = {"job": job, "seconds": seconds, "prefect": prefect}
    spec_path = work / f"spec-{time.time_ns()}.json"
    spec_path.write_text(json.dumps(spec))
    before = loadavg()
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(spec_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"measurement failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    chosen = [ln for ln in done.stderr.splitlines() if "intra-op thread" in ln]
    result["choice"] = chosen[-1] if chosen else ""
    result["load"] = f"{before} -> {loadavg()}"
    return result


class Burners:
    """One busy-loop process per CPU this process may use, while inside the block."""

    def __init__(self, count: int):
        self.count, self.procs = count, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(self.count)]
        if self.count:
            time.sleep(2)  # let the scheduler spread them
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def show(name: str, condition: str, r: dict) -> None:
    print(
        f"{name:<26} {condition:<7} {r['tokens_per_s']:>9.0f} tok/s  threads {r['threads']}  "
        f"({r['steps']} steps in {r['seconds']:.1f} s; load {r['load']})",
        flush=True,
    )
    if r.get("choice"):
        print(f"{'':<34} {r['choice'].strip()}", flush=True)


def torch_default_threads() -> int:
    code = "import torch; print(torch.get_num_threads())"
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    return int(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))


def old_variant() -> dict:
    """torch's default thread count, libgomp's default wait: what ran before cpu_threads."""
    return {"threads": torch_default_threads(), "env": OLD_ENV}


def contention(args, job: dict, work: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    burners = args.burners or cpus
    old = old_variant()
    variants = {"old (torch default, spin)": old, "new (eaglet's choice)": {}}
    if args.matrix:
        variants |= {
            "threads 1, spin": {"threads": 1, "env": OLD_ENV},
            "threads 2, PASSIVE": {"threads": 2, "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
            "threads 2, ACTIVE": {"threads": 2, "env": {"OMP_WAIT_POLICY": "ACTIVE"}},
            "threads 2, SPINCOUNT=0": {"threads": 2, "env": {"GOMP_SPINCOUNT": "0"}},
            "threads 2, SPINCOUNT=10k": {"threads": 2, "env": {"GOMP_SPINCOUNT": "10000"}},
            "threads 1, PASSIVE": {"threads": 1, "env": {"OMP_WAIT_POLICY": "PASSIVE"}},
        }
    print(f"\n{cpus} usable CPUs, {burners} burners, torch's default threads {old['threads']}")
    summary = {}
    for name, variant in variants.items():
        quiet1 = measure(job, variant, args.seconds, work)
        show(name, "quiet", quiet1)
        with Burners(burners):
            loaded = measure(job, variant, args.seconds, work)
        show(name, "loaded", loaded)
        quiet2 = measure(job, variant, args.seconds, work)
        show(name, "quiet", quiet2)
        quiet = (quiet1["tokens_per_s"] + quiet2["tokens_per_s"]) / 2
        summary[name] = (quiet, loaded["tokens_per_s"])
    print(f"\n{'variant':<26} {'quiet':>9} {'loaded':>9} {'loaded/quiet':>13}")
    for name, (quiet, loaded) in summary.items():
        print(f"{name:<26} {quiet:>9.0f} {loaded:>9.0f} {loaded / quiet:>13.2f}")
    old, new = summary["old (torch default, spin)"], summary["new (eaglet's choice)"]
    print(f"new / old loaded: {new[1] / old[1]:.1f}x; new / old quiet: {new[0] / old[0]:.2f}x")


def prefect_gap(args, job: dict, work: Path) -> None:
    condition = f"{args.prefect_burners} burn" if args.prefect_burners else "quiet"
    print(f"\nthe same training inside a Prefect task and plain ({condition})")
    variants = {"old": old_variant(), "new": {}}
    figures: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.prefect_repeats):
        for name, variant in variants.items():
            for mode in ("plain", "prefect"):
                with Burners(args.prefect_burners):
                    r = measure(job, variant, args.seconds, work, prefect=mode == "prefect")
                show(f"{name} {mode}", condition, r)
                print(f"{'':<34} ran in thread {r['thread']}", flush=True)
                figures.setdefault((name, mode), []).append(r["tokens_per_s"])
    for name in variants:
        plain = sum(figures[name, "plain"]) / len(figures[name, "plain"])
        inside = sum(figures[name, "prefect"]) / len(figures[name, "prefect"])
        print(f"{name}: prefect / plain tokens/s {inside / plain:.2f} ({inside:.0f} / {plain:.0f})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--target", default="/tmp/eaglet-fixture-model")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=20.0, help="per measurement")
    parser.add_argument("--burners", type=int, default=0, help="0: one per usable CPU")
    parser.add_argument("--matrix", action="store_true", help="threads x wait settings too")
    parser.add_argument("--skip-contention", action="store_true")
    parser.add_argument("--skip-prefect", action="store_true")
    parser.add_argument("--prefect-repeats", type=int, default=2)
    parser.add_argument(
        "--prefect-burners", type=int, default=0, help="busy loops beside the Prefect pair"
    )
    args = parser.parse_args()
    if args.child:
        child(json.loads(Path(args.child).read_text()))
        return
    if not (Path(args.target) / "config.json").exists():
        print(f"building the fixture target in {args.target} (minutes) ...", flush=True)
        build = [sys.executable, "-m", "eaglet_prefect.flows.cli", "fixture-model", args.target]
        subprocess.run(build, check=True)
    print(f"load average at start: {loadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        job = prepare(args, work)
        if not args.skip_contention:
            contention(args, job, work)
        if not args.skip_prefect:
            prefect_gap(args, job, work)


if __name__ == "__main__":
    main()
