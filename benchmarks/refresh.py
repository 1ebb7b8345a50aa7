"""A draft that follows its target: how far a drifted target leaves the old draft, and what
training again from it (`eaglet.refresh`, `train.init_from`) buys against training from
scratch, in τ and training steps.

    python benchmarks/refresh.py --work-dir /tmp/refresh-bench \\
        --old /work/fixture-model --new /work/fixture-drift [--fraction 0.33]

`--old` is the demo's fixture target, `--new` that target trained further on the restyled
corpus (`eaglet fixture-model NEW --continue-from OLD --corpus restyled`). Runs the demo's
config (its datasets and evaluation sets, written into --work-dir) without Prefect: a draft
for the old target; the same draft measured on the new one; a draft for the new target trained
from the old draft for `--fraction` of the epochs; one trained from scratch for all of them.
Prints τ per set, their mean and the training steps of each, with the load average.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglet.config import load_config  # noqa: E402
from eaglet.fixture.sample_data import write_sample_data  # noqa: E402
from eaglet.refresh import measure, set_taus  # noqa: E402
from eaglet.stages import DRAFT_FOLDER, REPORT_FILE  # noqa: E402
from tests.pipeline_helpers import run_every_stage  # noqa: E402


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def demo_overrides(data: Path, work_dir: Path, target: Path) -> list[str]:
    return [
        f"work_dir={work_dir}",
        f"target.model={target}",
        f"datasets=[{{source: arith, path: {data / 'arith.jsonl'}}}, "
        f"{{source: tools, path: {data / 'tools.jsonl'}}}, "
        f"{{source: mixed, path: {data / 'mixed.parquet'}}}]",
        f"evaluate.sets=[{{name: mt-bench, path: {data / 'mt-bench.jsonl'}}}, "
        f"{{name: gsm8k, path: {data / 'gsm8k.jsonl'}}}]",
    ]


def train_run(label: str, overrides: list[str]) -> dict:
    config = load_config(None, overrides)
    started = time.time()
    manifests = run_every_stage(config)
    seconds = time.time() - started
    train, evaluate = manifests["train"], manifests["evaluate"]
    report = json.loads((Path(config.work_dir) / evaluate.path / REPORT_FILE).read_text())
    tau = set_taus(report)
    steps = train.info.get("steps") or train.info.get("total_steps")
    print(f"{label:<34} τ {tau}  mean {sum(tau.values()) / len(tau):.3f}  steps {steps}  "
          f"{seconds:.0f} s (load {loadavg()})", flush=True)  # fmt: skip
    return {"config": config, "tau": tau, "steps": steps, "draft": Path(config.work_dir)
            / train.path / DRAFT_FOLDER}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--new", type=Path, required=True)
    parser.add_argument("--fraction", type=float, default=1 / 3)
    args = parser.parse_args()
    data = args.work_dir / "data"
    if not (data / "arith.jsonl").is_file():
        write_sample_data(data, seed=0)
    epochs = load_config(None, []).train.epochs
    short = max(1, math.ceil(epochs * args.fraction))  # epochs, cut at the steps' fraction

    old = train_run("old draft on the old target", demo_overrides(data, args.work_dir / "old",
                                                                    args.old))  # fmt: skip
    on_new = load_config(None, demo_overrides(data, args.work_dir / "old", args.new))
    drifted = set_taus(measure(on_new, old["draft"]))
    mean = sum(drifted.values()) / len(drifted)
    print(f"{'old draft on the new target':<34} τ {drifted}  mean {mean:.3f}  (load "
          f"{loadavg()})", flush=True)  # fmt: skip
    refreshed = train_run(
        f"refreshed ({args.fraction:.2f} of the steps)",
        [*demo_overrides(data, args.work_dir / "refreshed", args.new),
         f"train.init_from={old['draft']}", "train.init_from_vocab=grow",
         f"train.epochs={short}", f"train.max_steps={math.floor(old['steps'] * args.fraction)}"],
    )  # fmt: skip
    scratch = train_run(f"from scratch ({epochs} epochs)",
                        demo_overrides(data, args.work_dir / "scratch", args.new))  # fmt: skip
    ratio = (sum(refreshed["tau"].values()) / len(refreshed["tau"])) / (
        sum(scratch["tau"].values()) / len(scratch["tau"])
    )
    print(f"refreshed / from scratch: mean τ {ratio:.3f}, steps {refreshed['steps']} / "
          f"{scratch['steps']}")  # fmt: skip


if __name__ == "__main__":
    main()
