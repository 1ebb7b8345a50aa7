"""Peak memory of the train stage against the target's parameter bytes: borrowing embed_tokens
and lm_head from the safetensors files (now) against loading the whole target in fp32 and
cloning the two matrices out of it (before).

Each mode runs in its own process: import everything, reset the kernel's peak-RSS mark
(/proc/self/clear_refs), run `train_draft` for a few steps on random features of the right
shape, and print how far the peak rose above the RSS at the reset. The target is a random Qwen3
saved in bf16 as published checkpoints are (or --target DIR, a model folder).

    python benchmarks/train_memory.py [--target DIR] [--steps 3]

Numbers move with the machine's load; the ratio to the target's parameter bytes is the point.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> int:
    """Reset the kernel's peak RSS mark (VmHWM) to the current RSS; return that RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def make_target(path: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=2048,
        num_hidden_layers=16,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)  # as published: bf16


def make_shards(target: Path, folder: Path, samples: int = 16, length: int = 64) -> None:
    """Random features of the target's shape in the shard format (memory, not learning)."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((target / "config.json").read_text())
    H, V = config["hidden_size"], config["vocab_size"]
    folder.mkdir(parents=True, exist_ok=True)
    n = samples * length
    save_file(
        {
            "input_ids": torch.randint(0, V, (n,)),
            "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux_hidden_states": torch.randn(n, 3 * H),
            "final_hidden_states": torch.randn(n, H),
        },
        str(folder / "shard-00000.safetensors"),
    )
    rows = [
        {
            "sample_id": f"s{i}",
            "shard": "shard-00000.safetensors",
            "offset": i * length,
            "length": length,
        }
        for i in range(samples)
    ]
    (folder / "index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def load_whole_target_head(target):
    """The trainer's old way: the whole target in fp32, then copies of the two matrices."""
    import torch
    from transformers import AutoModelForCausalLM

    from eaglet.draft.target_head import TargetHead, head_config

    model = AutoModelForCausalLM.from_pretrained(
        target.model, dtype=torch.float32, trust_remote_code=target.trust_remote_code
    )
    config = head_config(model.config.get_text_config())
    embed = model.get_input_embeddings().weight.detach().clone()
    lm_head = model.get_output_embeddings().weight.detach().clone()
    del model
    return TargetHead(embed=embed, lm_head=lm_head, config=config)


def child(mode: str, target: Path, shards: Path, out: Path, steps: int) -> None:
    import torch
    import transformers  # noqa: F401 - imported in both modes before the baseline

    import eaglet.draft.train as train
    from eaglet.config import TargetConfig, TrainConfig
    from eaglet.draft.train_data import HiddenStatesData

    torch.set_num_threads(1)
    if mode == "whole":
        train.load_target_head = load_whole_target_head
    base = reset_peak()  # imports done: what follows is the trainer's own memory
    config = TrainConfig(
        epochs=1, batch_size=4, max_steps=steps, draft_vocab_size=4096, device="cpu", threads=1
    )
    data = HiddenStatesData(shards)
    run = train.setup(data, TargetConfig(model=str(target)), out, config, [2, 8, 13], "", False)
    setup_peak = peak_rss_bytes()
    train.train_loop(run)
    result = {"mode": mode, "base": base, "setup": setup_peak, "peak": peak_rss_bytes()}
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", nargs=4, metavar=("MODE", "TARGET", "SHARDS", "OUT"))
    args = parser.parse_args()
    if args.child:
        mode, target, shards, out = args.child
        child(mode, Path(target), Path(shards), Path(out), args.steps)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target = args.target or tmp / "target"
        if args.target is None:
            make_target(target)
        make_shards(target, tmp / "hs")
        from safetensors import safe_open

        files = sorted(Path(target).glob("*.safetensors"))
        param_bytes = 0
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    s = handle.get_slice(name)
                    numel = 1
                    for d in s.get_shape():
                        numel *= d
                    param_bytes += numel * 4  # as fp32, the dtype the trainer loaded it in
        config = json.loads((Path(target) / "config.json").read_text())
        head_bytes = 2 * config["vocab_size"] * config["hidden_size"] * 4
        print(
            f"target {target}: {param_bytes / 2**20:.1f} MiB of parameters in fp32, "
            f"embed_tokens + lm_head {head_bytes / 2**20:.1f} MiB"
        )
        results = {}
        for mode in ("whole", "borrow"):
            out = (
                subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--steps",
                        str(args.steps),
                        "--child",
                        mode,
                        str(target),
                        str(tmp / "hs"),
                        str(tmp / f"out-{mode}"),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                .stdout.strip()
                .splitlines()[-1]
            )
            results[mode] = json.loads(out)
        print(f"{'mode':<28}{'setup rise MiB':>15}{'peak rise MiB':>15}{'x target params':>17}")
        labels = {"whole": "before: whole target fp32", "borrow": "after: borrow 2 matrices"}
        for mode, label in labels.items():
            r = results[mode]
            setup, rise = r["setup"] - r["base"], r["peak"] - r["base"]
            print(
                f"{label:<28}{setup / 2**20:>15.1f}{rise / 2**20:>15.1f}{rise / param_bytes:>17.2f}"
            )
        rises = {m: results[m]["peak"] - results[m]["base"] for m in results}
        print(f"after / before peak rise: {rises['borrow'] / rises['whole']:.2f}")


if __name__ == "__main__":
    main()
