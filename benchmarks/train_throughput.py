"""Training throughput on the fixture target: online (co-located) against offline, the disk
each used and the τ of each draft; and one against two gloo processes under torchrun.

1. Examples: the fixture target's greedy answers to its own chat prompts (--samples).
2. Offline: the hidden_states stage body writes shards (storage --storage), then the trainer
   reads them. Online: the trainer runs the target on each batch as it trains. Same seed, same
   data, same settings; tokens/s of training, seconds of the extraction, bytes on disk.
   With --served, online once more with the states served by a real vLLM CPU server
   (extract_hidden_states and eaglet's CPU connector, started here from .vllm-venv).
3. τ of every draft on held-out fixture prompts (eaglet's offline evaluator).
4. The offline job in one process and under torchrun with two gloo processes (same global
   batch, one thread each): tokens/s of each.

    python benchmarks/train_throughput.py [--target /tmp/eaglet-fixture-model] [--samples 96]
        [--served] [--skip-ddp]

Numbers on a shared machine move with its load; each ratio is measured in one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from eaglet.config import (  # noqa: E402
    HiddenStatesConfig,
    PipelineConfig,
    TargetConfig,
    TrainConfig,
)
from eaglet.draft.evaluate import evaluate_draft  # noqa: E402
from eaglet.draft.job import pipeline_job  # noqa: E402
from eaglet.draft.launch import launch, run_job  # noqa: E402
from eaglet.fixture.model import eval_prompts, greedy_generate  # noqa: E402
from eaglet.hidden_states.backends.vllm import server_args  # noqa: E402
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION, resolve_aux_layer_ids  # noqa: E402
from eaglet.hidden_states.stage import stage_body  # noqa: E402
from eaglet.records.examples import Example  # noqa: E402
from eaglet.records.io import write_jsonl  # noqa: E402
from eaglet.target import load_config, load_model, load_tokenizer  # noqa: E402
from eaglet.vllm_process import free_port, vllm_server  # noqa: E402


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def make_examples(target: TargetConfig, n: int, seed: int, max_new_tokens: int) -> list[Example]:
    tokenizer, model = load_tokenizer(target), load_model(target)
    prompts = eval_prompts(n, seed=seed)
    answers = greedy_generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
    examples = []
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer = [t for t in answer if t != tokenizer.pad_token_id]
        examples.append(
            Example(
                sample_id=f"b{seed}-{i}",
                source="fixture",
                reasoning="",
                content="",
                input_ids=ids + answer,
                loss_mask=[0] * len(ids) + [1] * len(answer),
                finish_reason="stop",
            )
        )
    return examples


def write_fixture_examples(target: TargetConfig, args, work: Path) -> tuple[Path, int]:
    """`work/examples.jsonl`: the target's greedy answers to `args.samples` fixture prompts;
    returns the path and the number of tokens."""
    examples = make_examples(target, args.samples, 1, args.max_new_tokens)
    examples_path = work / "examples.jsonl"
    write_jsonl(examples_path, examples)
    tokens = sum(len(e.input_ids) for e in examples)
    print(f"{len(examples)} examples, {tokens} tokens, target {target.model}")
    return examples_path, tokens


def benchmark_train_config(epochs: int) -> TrainConfig:
    """The training settings every benchmark run shares: one thread, CPU, no held-out part."""
    return TrainConfig(
        epochs=epochs,
        batch_size=8,
        draft_vocab_size=4096,
        holdout_fraction=0.0,
        threads=1,
        device="cpu",
        log_every=1000,
    )


def held_out_prompts(target: TargetConfig, n: int) -> list[list[int]]:
    """Token ids of `n` fixture prompts the examples never used (seed 7)."""
    tokenizer = load_tokenizer(target)
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in eval_prompts(n, seed=7)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="/tmp/eaglet-fixture-model")
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--storage", default="int8")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eval-prompts", type=int, default=12)
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--served", action="store_true", help="online from a vLLM CPU server too")
    parser.add_argument("--vllm-python", default=str(ROOT / ".vllm-venv" / "bin" / "python"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = TargetConfig(model=args.target, device="cpu")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        examples_path, tokens = write_fixture_examples(target, args, work)
        train = benchmark_train_config(args.epochs)
        config = PipelineConfig(
            work_dir=str(work),
            target=target,
            hidden_states=HiddenStatesConfig(storage=args.storage),
            train=train,
        )

        started = time.time()
        hs = work / "hidden_states"
        hs.mkdir()
        stage_body(config, examples_path, report=lambda line: None)(hs)
        extract_s = time.time() - started
        disk = folder_bytes(hs)

        num_layers = load_config(target).num_hidden_layers
        info = {
            "aux_layer_ids": resolve_aux_layer_ids(None, num_layers),  # as the stage resolved
            "aux_layer_convention": AUX_LAYER_CONVENTION,
        }
        results = {}
        for mode in ("offline", "online"):
            if mode == "offline":
                job = pipeline_job(config, work / mode, features_dir=hs, features_info=info)
            else:
                job = pipeline_job(config, work / mode, examples_path=examples_path)
            started = time.time()
            summary = run_job(job)
            seconds = time.time() - started
            results[mode] = {"seconds": seconds, "tokens_per_s": trained(summary) / seconds}

        if args.served:
            results["served"] = served_online(args, config, work, examples_path, info)

        held_out = held_out_prompts(target, args.eval_prompts)
        for mode, result in results.items():
            draft = work / mode / "draft"
            result["tau"] = evaluate_draft(draft, target, held_out, 4, 64, untrained_seed=None)[
                "tau"
            ]

        off, on = results["offline"], results["online"]
        print()
        row("mode", "train s", "train tok/s", "extract s", "disk MiB", "tau")
        row("offline", off["seconds"], off["tokens_per_s"], extract_s, disk / 2**20, off["tau"])
        row("online", on["seconds"], on["tokens_per_s"], 0.0, 0.0, on["tau"])
        if "served" in results:
            sv = results["served"]
            row("served", sv["seconds"], sv["tokens_per_s"], 0.0, 0.0, sv["tau"])
            ratio = sv["tokens_per_s"] / off["tokens_per_s"]
            print(f"served online / offline training tokens/s: {ratio:.2f}")
            print(f"tau served / offline: {sv['tau'] / off['tau']:.4f}")
            print(f"vLLM server start: {sv['startup_s']:.1f} s (not in train s)")
        print(f"online / offline training tokens/s: {on['tokens_per_s'] / off['tokens_per_s']:.2f}")
        wall_ratio = on["seconds"] / (extract_s + off["seconds"])
        print(f"online / (extract + offline train) wall: {wall_ratio:.2f}")
        print(f"tau online / offline: {on['tau'] / off['tau']:.4f}")
        print(f"disk saved online: {disk} bytes (storage {args.storage})")

        if args.skip_ddp:
            return
        timings = {}
        for nproc in (1, 2):
            job = pipeline_job(config, work / f"ddp{nproc}", features_dir=hs, features_info=info)
            started = time.time()
            summary = run_job(job) if nproc == 1 else launch(job, 2, log_line=lambda _: None)
            timings[nproc] = (time.time() - started, summary["seconds"], trained(summary))
        print()
        row("processes", "wall s", "train s", "train tok/s")
        for nproc, (wall, train_s, tok) in timings.items():
            row(str(nproc), wall, train_s, tok / train_s)
        speedup = timings[1][1] / timings[2][1]
        print(f"2 / 1 processes training tokens/s: {speedup:.2f}")
        print(f"2 / 1 processes, wall with start-up: {timings[1][0] / timings[2][0]:.2f}")


def served_online(args, config: PipelineConfig, work: Path, examples_path: Path, info: dict):
    """Online training with every micro-batch's states from a vLLM CPU server."""
    connector = work / "connector"
    connector.mkdir()
    num_layers = load_config(config.target).num_hidden_layers
    command = [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", config.target.model, "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(free_port()), "--dtype", "float32",
        "--max-model-len", "1024", "--enforce-eager",
        *server_args(info["aux_layer_ids"], num_layers, str(connector), cpu=True),
    ]  # fmt: skip
    # The server imports eaglet's CPU-safe connector from this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    started = time.time()
    with vllm_server(command, work / "vllm.log", startup_timeout_s=900) as url:
        startup_s = time.time() - started
        settings = config.hidden_states.model_copy(
            update={
                "backend": "vllm",
                "endpoints": [url],
                "concurrency": 4,
                "connector_path": str(connector),
            }
        )
        served = config.model_copy(update={"hidden_states": settings})
        job = pipeline_job(served, work / "served", examples_path=examples_path)
        started = time.time()
        summary = run_job(job)
        seconds = time.time() - started
    left = list(connector.iterdir())
    print(f"served: {len(left)} connector files left on disk")
    return {"seconds": seconds, "tokens_per_s": trained(summary) / seconds, "startup_s": startup_s}


def trained(summary: dict) -> float:
    """Tokens the run trained on: its windows' tokens times the epochs it completed."""
    return summary["train_tokens"] * summary["epochs_completed"]


def row(*cells) -> None:
    print("".join(f"{c:>12.2f}" if isinstance(c, float) else f"{c:>12}" for c in cells))


if __name__ == "__main__":
    main()
