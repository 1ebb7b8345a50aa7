"""τ of eaglet drafts trained on a few hundred samples against a few thousand, per setting: why
the defaults (optimizer, learning rate) hold for both a demo-sized run and a real one.

Reads the samples and hidden states `benchmarks/training.py` left in --work-dir (run that
first), trains one draft per (--eaglet setting, --train-samples N) on the first N of its
training samples (the held-out 10 % are left out, as there), and prints eaglet's offline τ at
k = 3 on the same held-out prompts as training.py.

    python benchmarks/small_runs.py --work-dir /tmp/tb-data [--train-samples 192 2000]
        [--epochs 12 4] [--eaglet defaults --eaglet optimizer=adamw,lr=0.001 ...]

Run it alone (two shared cores: torch's threads thrash beside another job).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.training import eaglet_settings, offline_tau, row  # noqa: E402
from eaglet.config import TargetConfig, TrainConfig  # noqa: E402
from eaglet.draft.train import train_draft  # noqa: E402
from eaglet.fixture.model import eval_prompts  # noqa: E402
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION  # noqa: E402
from eaglet.split import heldout_ids  # noqa: E402
from eaglet.target import load_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work-dir", required=True, help="benchmarks/training.py's work dir")
    parser.add_argument("--target", default="/tmp/eaglet-fixture-model")
    parser.add_argument("--train-samples", type=int, nargs="+", default=[192, 2000])
    parser.add_argument(
        "--epochs", type=int, nargs="+", default=[12, 4], help="one per --train-samples"
    )
    parser.add_argument("--eaglet", action="append", default=None, metavar="SETTINGS")
    parser.add_argument("--aux-layer-ids", type=int, nargs=3, default=[2, 4, 5])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--max-eval-tokens", type=int, default=128)
    args = parser.parse_args()
    if len(args.epochs) != len(args.train_samples):
        parser.error("give one --epochs per --train-samples")
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    states = work / "eaglet-hidden-states"
    lines = (states / "index.jsonl").read_text().splitlines()
    ids = [json.loads(line)["sample_id"] for line in lines if line.strip()]
    training = [i for i in ids if i not in heldout_ids(ids, TrainConfig().holdout_fraction)]
    target = TargetConfig(model=args.target, device="cpu")
    tokenizer = load_tokenizer(target)
    prompts = [
        tokenizer(p, add_special_tokens=False)["input_ids"]
        for p in eval_prompts(args.eval_prompts, seed=7)
    ]

    results = []
    for spec in args.eaglet or ["defaults"]:
        for n, epochs in zip(args.train_samples, args.epochs, strict=True):
            kept = set(training[:n])
            config = TrainConfig(
                **{"epochs": epochs, "threads": args.threads, "device": "cpu"}
                | eaglet_settings(spec)
            )
            out = work / "small-runs" / f"{spec.replace('=', '-').replace(',', '+')}-n{n}"
            started = time.time()
            summary = train_draft(
                states, target, out, config, args.aux_layer_ids, AUX_LAYER_CONVENTION,
                exclude_sample_ids=set(ids) - kept, resume=False,
            )  # fmt: skip
            results.append(
                {
                    "setting": spec,
                    "train_samples": len(kept),
                    "epochs": epochs,
                    "steps": summary["steps"],
                    "train_s": time.time() - started,
                    "final_loss": summary["final_loss"],
                    "tau": offline_tau(summary["draft_dir"], target, prompts, args.max_eval_tokens),
                }
            )
            print(json.dumps(results[-1]))
    (work / f"small-runs-{int(time.time())}.json").write_text(json.dumps(results, indent=2))
    print()
    row("setting", "samples", "epochs", "steps", "train s", "final loss", "tau (eaglet)")
    for r in results:
        row(
            r["setting"], r["train_samples"], r["epochs"], r["steps"], r["train_s"],
            r["final_loss"], r["tau"],
        )  # fmt: skip


if __name__ == "__main__":
    main()
