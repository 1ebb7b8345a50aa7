"""τ of the trained draft per hidden-state storage form, with bytes per token (issue 10's
measurement behind the default `hidden_states.storage`).

1. Examples: the fixture target's greedy answers to its own chat prompts (--samples).
2. For each storage form (float32, bfloat16, int8, fp8): the hidden_states stage body writes
   the shards, the trainer trains a draft on them (same seed, same data, same settings), and
   eaglet's offline evaluator measures τ on held-out fixture prompts.
3. Printed per form: bytes per token on disk (measured: shard bytes / tokens) against bf16's
   8·H anchor, τ, and τ against float32 storage's.

    python benchmarks/storage_tau.py [--target /tmp/eaglet-fixture-model] [--samples 96]
        [--epochs 4] [--storages float32 bfloat16 int8 fp8]

Run it alone: two cores shared with another process slow the training tenfold.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.train_throughput import (  # noqa: E402
    benchmark_train_config,
    folder_bytes,
    held_out_prompts,
    write_fixture_examples,
)
from eaglet.config import (  # noqa: E402
    HiddenStatesConfig,
    PipelineConfig,
    TargetConfig,
)
from eaglet.draft.evaluate import evaluate_draft  # noqa: E402
from eaglet.draft.job import pipeline_job  # noqa: E402
from eaglet.draft.launch import run_job  # noqa: E402
from eaglet.hidden_states.feature_encoding import STORAGES  # noqa: E402
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION, resolve_aux_layer_ids  # noqa: E402
from eaglet.hidden_states.stage import stage_body  # noqa: E402
from eaglet.target import load_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="/tmp/eaglet-fixture-model")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--storages", nargs="+", default=list(STORAGES), choices=STORAGES)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = TargetConfig(model=args.target, device="cpu")
    target_config = load_config(target)
    hidden_size, num_layers = target_config.hidden_size, target_config.num_hidden_layers
    info = {
        "aux_layer_ids": resolve_aux_layer_ids(None, num_layers),
        "aux_layer_convention": AUX_LAYER_CONVENTION,
    }
    held_out = held_out_prompts(target, args.eval_prompts)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        examples_path, tokens = write_fixture_examples(target, args, work)
        print(f"hidden size {hidden_size}")
        train = benchmark_train_config(args.epochs)
        results = {}
        for storage in args.storages:
            config = PipelineConfig(
                work_dir=str(work),
                target=target,
                hidden_states=HiddenStatesConfig(storage=storage),
                train=train,
            )
            shards = work / f"shards-{storage}"
            shards.mkdir()
            stage_body(config, examples_path, report=lambda line: None)(shards)
            job = pipeline_job(config, work / storage, features_dir=shards, features_info=info)
            run_job(job)
            draft = work / storage / "draft"
            tau = evaluate_draft(draft, target, held_out, 4, 64, untrained_seed=None)["tau"]
            results[storage] = {"bytes_per_token": folder_bytes(shards) / tokens, "tau": tau}
            print(f"{storage}: {results[storage]}", flush=True)

    print()
    print(f"{'storage':10} {'B/token':>9} {'vs 8H':>7} {'tau':>7} {'tau vs float32':>15}")
    reference = results.get("float32", {}).get("tau")
    for storage, result in results.items():
        relative = f"{result['tau'] / reference - 1:+.2%}" if reference else "n/a"
        print(
            f"{storage:10} {result['bytes_per_token']:9.0f} "
            f"{result['bytes_per_token'] / (8 * hidden_size):6.2f}x {result['tau']:7.3f} "
            f"{relative:>15}"
        )


if __name__ == "__main__":
    main()
