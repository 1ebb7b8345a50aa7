"""Hidden-state extraction: throughput, bytes per token, storage error, memory (ratios against
baselines measured in the same run; no asserts on time).

1. Tokens/s of the `hf` backend (one sample per forward, so that a sample's features do not
   depend on its neighbours) for short (8-64 tokens) and long (16-400) samples; with
   --vllm-url, the `vllm` backend (a server started with
   eaglet.hidden_states.backends.vllm.server_args) too, as a ratio against hf's.
2. Per storage form: bytes per token (values, against bf16's 8·H anchor, and in all), the
   relative error of the states read back, and how often the target's greedy token
   (lm_head of the stored final state) equals float32's.
3. Peak resident memory of the whole stage (one subprocess each) for N and 10·N samples.

    python benchmarks/hidden_states.py --model /tmp/eaglet-fixture-model [--samples 64]
        [--vllm-url http://127.0.0.1:8931 --aux 2 4 5] [--memory-samples 200]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglet.hidden_states.backends.hf import HFBackend  # noqa: E402
from eaglet.hidden_states.feature_encoding import STORAGES, bytes_per_token, decode, encode  # noqa: E402
from tests.hidden_states_helpers import config_for, write_examples  # noqa: E402


def tokens_per_s(backend, examples, repeats: int = 3) -> float:
    """Best of `repeats` timed passes (a shared machine only ever slows a pass down)."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        backend.features(examples)
        best = min(best, time.perf_counter() - started)
    return sum(len(e.input_ids) for e in examples) / best


def throughput(args, config, length_profiles: dict[str, list]) -> None:
    """`hf` (one sample per forward) and, with --vllm-url, the vllm backend, per length
    profile."""
    single = HFBackend(config.target, args.aux)
    for name, examples in length_profiles.items():
        tokens_per_s(single, examples[:4], repeats=1)  # warm up
        rows = [("hf one sample per forward", tokens_per_s(single, examples))]
        if args.vllm_url:
            from eaglet.hidden_states.backends.vllm import VllmBackend

            server = config.hidden_states.vllm.model_copy(
                update={"endpoints": [args.vllm_url], "concurrency": 8}
            )
            settings = config.hidden_states.model_copy(update={"vllm": server})
            vllm = VllmBackend(config.target, settings, args.aux)
            vllm.features(examples[:4])
            rows.append(
                ("vllm (extract_hidden_states), concurrency 8", tokens_per_s(vllm, examples))
            )
        tokens = sum(len(e.input_ids) for e in examples)
        print(f"\n## Throughput, {name}: {len(examples)} samples, {tokens} tokens "
              f"({torch.get_num_threads()} torch threads, best of 3)")  # fmt: skip
        print(f"{'backend':48} {'tokens/s':>10} {'ratio':>8}")
        base = rows[0][1]
        for row_name, rate in rows:
            print(f"{row_name:48} {rate:10.0f} {rate / base:7.2f}x")


def storage_table(args, config, examples) -> None:
    backend = HFBackend(config.target, args.aux)
    H = backend.hidden_size
    lm_head = backend.model.lm_head
    feats = backend.features(examples)
    aux = torch.cat([f["aux_hidden_states"] for f in feats])
    final = torch.cat([f["final_hidden_states"] for f in feats])
    with torch.inference_mode():
        greedy = lm_head(final).argmax(-1)
    print(f"\n## Storage forms, H={H}, {aux.shape[0]} tokens (anchor: bfloat16 = 8·H = {8 * H} B)")
    print(f"{'storage':10} {'value B/tok':>11} {'vs 8H':>7} {'all B/tok':>10} {'aux rel err':>12} "
          f"{'final rel err':>13} {'greedy same':>12}")  # fmt: skip
    for storage in STORAGES:
        a = encode("a", aux, storage, 3)
        f = encode("f", final, storage, 1)
        a_back, f_back = decode(a["a"], a.get("a_scale")), decode(f["f"], f.get("f_scale"))
        values = 4 * H * a["a"].element_size()
        rel = lambda x, y: ((x - y).norm(dim=-1) / y.norm(dim=-1)).mean().item()  # noqa: E731
        with torch.inference_mode():
            same = (lm_head(f_back).argmax(-1) == greedy).float().mean().item()
        total = bytes_per_token(H, storage)
        print(f"{storage:10} {values:11d} {values / (8 * H):6.2f}x {total:10d} "
              f"{rel(a_back, aux):12.2e} {rel(f_back, final):13.2e} {same:11.2%}")  # fmt: skip


CHILD = """
import resource, sys, json
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from eaglet.hidden_states.stage import stage_body
from tests.hidden_states_helpers import config_for
work, model, examples = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
config = config_for(work, model, aux_layer_ids=json.loads(sys.argv[5]), storage="int8",
                    shard_tokens=4096)
folder = work / "partial"
folder.mkdir(parents=True)
out = stage_body(config, examples, report=lambda _: None)(folder)
print(json.dumps({"rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "tokens": out.info["tokens"], "samples": out.info["samples"]}))
"""


def memory(args) -> None:
    rows = []
    for n in (args.memory_samples, 10 * args.memory_samples):
        with tempfile.TemporaryDirectory() as tmp:
            examples = Path(tmp) / "examples.jsonl"
            write_examples(examples, n, seed=1, max_len=200, vocab=args.vocab)
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(Path(tmp) / "work"), args.model, str(examples),
                 str(ROOT), json.dumps(args.aux)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("\n## Peak resident memory of the stage (int8, shard_tokens 4096)")
    for row in rows:
        mib = row["rss_kb"] / 1024
        print(f"{row['samples']:6d} samples {row['tokens']:8d} tokens: {mib:7.1f} MiB")
    print(f"ratio 10·N / N: {rows[1]['rss_kb'] / rows[0]['rss_kb']:.3f} (goal <= 1.2)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--aux", type=int, nargs=3, default=[2, 4, 5])
    parser.add_argument("--vllm-url")
    parser.add_argument("--memory-samples", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parts = ["throughput", "storage", "memory"]
    parser.add_argument("--skip", nargs="*", default=[], choices=parts)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = config_for(Path(tempfile.mkdtemp()), Path(args.model), aux_layer_ids=args.aux)
    from eaglet.target import load_config

    args.vocab = load_config(config.target).vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        profiles = {
            f"{low}-{high} tokens": write_examples(
                Path(tmp) / f"{low}.jsonl",
                args.samples,
                seed=0,
                min_len=low,
                max_len=high,
                vocab=args.vocab,
            )  # fmt: skip
            for low, high in ((8, 64), (16, 400))
        }
    examples = profiles["16-400 tokens"]
    print(f"model {args.model}; own process peak RSS so far "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")  # fmt: skip
    if "throughput" not in args.skip:
        throughput(args, config, profiles)
    if "storage" not in args.skip:
        storage_table(args, config, examples)
    if "memory" not in args.skip:
        memory(args)


if __name__ == "__main__":
    main()
