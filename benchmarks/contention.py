"""The demo's training on a quiet and on a busy machine: tokens/s of eaglet's thread and wait
choice (eaglet/cpu_threads.py) against fixed settings, quiet and beside one CPU-burning process
per core; and the same training inside a Prefect task against plain.

1. Examples: the fixture target's greedy answers to its own chat prompts (--samples), then the
   hidden_states stage body writes its shards (the demo's settings: int8, offline).
2. Every measurement is a fresh process (libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once,
   when torch loads) training the demo's TrainConfig (`PipelineConfig().train`, CPU) on those
   shards for --seconds after two warm-up steps; tokens/s = tokens trained / seconds.
   - eaglet's choice: nothing set; eaglet picks the threads (affinity, quota, load; again
     between steps) and the wait (GOMP_SPINCOUNT=cpu_threads.SPIN_COUNT);
   - fixed: every --threads count with every --waits setting (PASSIVE, or a GOMP_SPINCOUNT;
     "2 thr, spin 300000" is what ran before eaglet chose: torch's default threads on 2 cores,
     libgomp's default spin).
3. Honest figures: each variant's first measurement (--warmup-seconds, cold caches) is shown
   and discarded; then --repeats rounds, each variant in a rotated order quiet and then beside
   the burners (--burners, default one per usable CPU), so a drift of the machine's load
   reaches every variant alike; before each measurement it waits (up to --wait-quiet s) for
   other processes to go idle, and prints what they kept busy. The summary: median
   (lowest-highest) per variant and condition, and eaglet's medians over the best fixed
   setting's, quiet with quiet and loaded with loaded.
4. Prefect: old and new, the training inside a Prefect task of a flow (a temporary Prefect
   server, run logs and a progress artifact as the train task writes them) against the same
   training plainly, alternated --prefect-repeats times (beside --prefect-burners busy loops).

    python benchmarks/contention.py --target runs/demo/models/fixture [--seconds 15]
        [--repeats 3] [--threads 1,2] [--waits PASSIVE,10000,300000] [--skip-prefect]

Times move with whatever else the machine runs (the load average counts these measurements'
own threads too): the load average (1, 5, 15 min) before and after is printed beside every
figure, and nothing is asserted on time. Figures: see eaglet/cpu_threads.py's docstring.
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

from eaglet.cpu_threads import SPIN_COUNT  # noqa: E402

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
    from eaglet.draft.job import pipeline_job
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
    job.out_dir = work / f"train-{time.time_ns()}"
    job.resume = False
    job.train = job.train.model_copy(update={"threads": variant.get("threads")})
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
        f"{name:<24} {condition:<7} {r['tokens_per_s']:>7.0f} tok/s  threads {r['threads']}  "
        f"({r['steps']} steps in {r['seconds']:.1f} s; load {r['load']})",
        flush=True,
    )
    if r.get("choice"):
        print(f"{'':<32} {r['choice'].split(' ', 1)[-1].strip()}", flush=True)


def torch_default_threads() -> int:
    code = "import torch; print(torch.get_num_threads())"
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    return int(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))


def old_variant() -> dict:
    """torch's default thread count, libgomp's default wait: what ran before cpu_threads."""
    return {"threads": torch_default_threads(), "env": OLD_ENV}


def wait_env(wait: str) -> dict:
    """ "PASSIVE" (sleep at once; the same as GOMP_SPINCOUNT=0) or a GOMP_SPINCOUNT."""
    return {"OMP_WAIT_POLICY": "PASSIVE"} if wait.upper() == "PASSIVE" else {"GOMP_SPINCOUNT": wait}


def fixed_variants(threads: list[int], waits: list[str]) -> dict[str, dict]:
    """Every thread count with every wait setting, both fixed: what eaglet is measured against."""
    return {
        f"{t} thr, {'PASSIVE' if w.upper() == 'PASSIVE' else 'spin ' + w}": {
            "threads": t,
            "env": wait_env(w),
        }
        for t in threads
        for w in waits
    }


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def figure(values: list[float]) -> str:
    """The median and the spread (lowest-highest) of a variant's measurements."""
    return f"{median(values):>6.0f} ({min(values):.0f}-{max(values):.0f})"


def wait_quiet(limit_s: float) -> str:
    """Wait up to `limit_s` until other processes keep less than half a CPU busy (another job on
    a shared machine would make one variant's "quiet" loaded); returns what it found."""
    from eaglet.cpu_threads import others_load

    started = time.time()
    while True:
        busy = others_load()
        waited = time.time() - started
        if busy < 0.5 or waited >= limit_s:
            return f"others {busy:.1f} CPUs busy" + (f" after {waited:.0f} s" if waited > 1 else "")
        time.sleep(2)


def contention(args, job: dict, work: Path) -> None:
    """A discarded warm-up measurement per variant, then --repeats rounds; in each round every
    variant (in a rotated order) quiet and then beside the burners, so slow drifts of the
    machine's load reach all variants alike. The summary: medians with their spread."""
    cpus = len(os.sched_getaffinity(0))
    burners = args.burners or cpus
    threads = [int(t) for t in args.threads.split(",")]
    variants = {"eaglet's choice": {}} | fixed_variants(threads, args.waits.split(","))
    names = list(variants)
    print(
        f"\n{cpus} usable CPUs, {burners} burners, torch's default threads "
        f"{torch_default_threads()}; {len(names)} variants, {args.repeats} rounds of "
        f"{args.seconds:g} s measurements after a {args.warmup_seconds:g} s warm-up each"
    )
    for name in names:
        others = wait_quiet(args.wait_quiet)
        r = measure(job, variants[name], args.warmup_seconds, work)
        show(name, "warm-up", r | {"load": f"{r['load']}; {others}"})
    figures: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.repeats):
        print(f"-- round {round_ + 1}", flush=True)
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            for condition in ("quiet", "loaded"):
                others = wait_quiet(args.wait_quiet)
                with Burners(burners if condition == "loaded" else 0):
                    r = measure(job, variants[name], args.seconds, work)
                show(name, condition, r | {"load": f"{r['load']}; {others}"})
                figures.setdefault((name, condition), []).append(r["tokens_per_s"])
    summarize(names, figures)


def summarize(names: list[str], figures: dict[tuple[str, str], list[float]]) -> None:
    """Medians (spread); eaglet's against the best fixed setting, quiet and loaded apart."""
    print(f"\nload average at the end: {loadavg()}")
    print(f"{'variant':<24} {'quiet tok/s':>20} {'loaded tok/s':>20} {'loaded/quiet':>13}")
    for name in names:
        quiet, loaded = figures[name, "quiet"], figures[name, "loaded"]
        ratio = median(loaded) / median(quiet)
        print(f"{name:<24} {figure(quiet):>20} {figure(loaded):>20} {ratio:>13.2f}")
    fixed = names[1:]
    best = {c: max(fixed, key=lambda n: median(figures[n, c])) for c in ("quiet", "loaded")}
    mine = {c: median(figures[names[0], c]) for c in ("quiet", "loaded")}
    goals = {"quiet": 0.95, "loaded": 0.9}
    for condition, goal in goals.items():
        ratio = mine[condition] / median(figures[best[condition], condition])
        verdict = "met" if ratio >= goal else "NOT met"
        print(
            f"eaglet / best fixed {condition} ({best[condition]}): {ratio:.2f}x "
            f"(goal >= {goal}: {verdict})"
        )
    own = mine["loaded"] / mine["quiet"]
    print(
        f"eaglet loaded / its own quiet: {own:.2f}x (goal >= 0.35: "
        f"{'met' if own >= 0.35 else 'NOT met'})"
    )


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
    parser.add_argument("--seconds", type=float, default=15.0, help="per measurement")
    parser.add_argument("--warmup-seconds", type=float, default=5.0, help="each variant's first")
    parser.add_argument("--repeats", type=int, default=3, help="rounds: quiet and loaded each")
    parser.add_argument("--burners", type=int, default=0, help="0: one per usable CPU")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=120.0,
        help="seconds to wait, before each measurement, for other processes to go idle",
    )
    parser.add_argument("--threads", default="1,2", help="the fixed variants' thread counts")
    parser.add_argument(
        "--waits",
        default=f"PASSIVE,{SPIN_COUNT},300000",
        help="the fixed variants' waits: PASSIVE or GOMP_SPINCOUNT values",
    )
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
