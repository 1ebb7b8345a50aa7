"""Which epoch train.keep_best exports, by loss and by tau, and what the exported draft serves.

The demo's data and target (built on first use, as `eaglet demo` builds them), trained for
`--epochs` with train.keep_best off, loss and tau in one work dir (the stages before train are
Cached after the first), each evaluated offline on the held-out prompts and, with a vLLM venv
(`make vllm-venv`), served by vLLM at the same k. Prints per mode the exported epoch, the offline
and served tau, and per epoch the held-out loss and tau keep_best: tau measured.

    python benchmarks/keep_best.py [--work-dir /tmp/keep-best] [--epochs 20] [--set KEY=VALUE]

Tau and epochs are the measure; the seconds and the load average are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
EAGLET = Path(sys.executable).parent / "eaglet"  # the console script beside this python


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def run_demo(work_dir: Path, overrides: list[str]) -> float:
    started = time.time()
    command = [str(EAGLET), "demo", "--work-dir", str(work_dir)]
    command += [x for o in overrides for x in ("--set", o)]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.time() - started


def inspect(work_dir: Path) -> dict:
    out = subprocess.run(
        [str(EAGLET), "inspect", str(work_dir), "--json"],
        check=True, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/keep-best"))
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], help="more config overrides")
    args = parser.parse_args()
    served = VLLM_PYTHON.exists()
    common = [f"train.epochs={args.epochs}", "train.keep_best_prompts=8", *args.set]
    if served:
        common += [
            "evaluate.serving=vllm", f"evaluate.vllm_python={VLLM_PYTHON}",
            "evaluate.vllm_args=[--enforce-eager]",
        ]  # fmt: skip
    rows, per_epoch = [], []
    for mode in ("off", "loss", "tau"):
        seconds = run_demo(args.work_dir, [*common, f"train.keep_best={mode}"])
        report = inspect(args.work_dir)
        train = report["stages"]["train"]
        info = json.loads((Path(train["path"]) / "manifest.json").read_text())["info"]
        evaluation = report["evaluation"]
        rows.append(
            (mode, info.get("best_epoch") or float(args.epochs), evaluation["tau"],
             evaluation.get("served_tau"), seconds)
        )  # fmt: skip
        if mode == "tau":
            per_epoch = info["heldout_losses"]
        print(f"keep_best {mode}: done in {seconds:.0f} s, load {load()}", flush=True)
    print(f"\nfixture target, the demo's data, {args.epochs} epochs; load average {load()}")
    print("| keep_best | exported epoch | offline tau (held-out prompts) | served tau (vLLM) | s |")
    print("|---|---|---|---|---|")
    for mode, epoch, tau, served_tau, seconds in rows:
        shown = f"{served_tau:.3f}" if served_tau is not None else "(no vLLM venv)"
        print(f"| {mode} | {epoch:g} | {tau:.3f} | {shown} | {seconds:.0f} |")
    print("\n| epoch | held-out loss | held-out tau (keep_best prompts) |")
    print("|---|---|---|")
    for record in per_epoch:
        print(f"| {record['epoch']:g} | {record['loss']:.4f} | {record['tau']:.3f} |")


if __name__ == "__main__":
    main()
