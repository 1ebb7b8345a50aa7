"""Seconds, tokens/s and peak memory of every stage, on the fixture target and on real-shape
ones (`eaglet fixture-model --shape`): what grows with the target's width and vocabulary.

    python benchmarks/real_shapes.py [--work-dir DIR] [--samples N] [--layers L] [--fixture DIR]
                                     [--targets fixture,qwen3-0.6b,qwen3-0.6b+gpt-oss]

A target is `fixture`, a shape, a shape with `-v201k` (201,088 rows around Qwen3's tokenizer) or
with `+TOKENIZER` (another tokenizer family: `+gpt-oss` brings o200k_harmony, 201,088 rows and
the harmony format).

Each stage runs as its own `eaglet run CONFIG --until STAGE` process (the stages before it are
Cached), against one running Prefect server started here, so the peak RSS of that process
(`os.wait4`'s ru_maxrss) is that stage's, plus the floor every run pays (Python, torch,
transformers, Prefect's client: the `download` row, whose own work is a few rows of JSON). The
`expected` column is the stage's main working set from the target's shapes, beside the floor:

- generate (local engine): the weights + KV cache (batch x (longest prompt + max_tokens) x
  layers x 2 x kv_heads x head_dim) + one step's logits (batch x vocabulary);
- hidden_states (hf): the weights + every layer's states for one batch (at most batch_tokens,
  at most the data's tokens, x hidden x (layers + 1)) + the features of one shard (4 x hidden
  per token);
- train: the target's embedding and lm_head (vocabulary x hidden each, one when tied) + the
  draft and its optimizer state (x 4);
- evaluate: the weights + the draft.

Tokens/s counts generated tokens for generate, and example tokens (x epochs) for hidden_states
and train. The load averages are printed beside each figure; nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.startup import start_prefect_server  # noqa: E402
from eaglet.records.io import read_jsonl  # noqa: E402
from eaglet.stages import STAGES  # noqa: E402

MB = 2**20
VOCABULARIES = {"201k": 201088}  # a target name's "-v201k": gpt-oss's vocabulary size


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def build_target(name: str, out: Path, layers: int, fixture: Path | None) -> Path:
    if name == "fixture":
        if fixture is not None:
            return fixture
        args = ["fixture-model", str(out)]
    else:
        shaped, _, tokenizer = name.partition("+")
        shape, _, variant = shaped.partition("-v")
        args = ["fixture-model", str(out), "--shape", shape, "--layers", str(layers)]
        if variant:
            args += ["--vocab-size", str(VOCABULARIES[variant])]
        if tokenizer:
            args += ["--tokenizer", tokenizer]
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "eaglet_prefect.flows.cli", *args], check=True)
    return out


def run_stage(config: Path, stage: str, env: dict) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of `eaglet run CONFIG --until STAGE`."""
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "eaglet_prefect.flows.cli", "run", str(config), "--until", stage],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{stage} failed ({process.returncode}):\n{out[-3000:]}")
    return time.monotonic() - started, usage.ru_maxrss * 1024, out


def stage_seconds(out: str, stage: str) -> float:
    match = re.search(rf"^  {stage} +\w+ +\d+ records +([\d.]+) s", out, re.M)
    return float(match.group(1)) if match else float("nan")


def stage_tokens(work_dir: Path, stage: str, epochs: int) -> int | None:
    from eaglet.records.examples import Example
    from eaglet.records.generations import Generation

    if stage == "generate":
        (path,) = (work_dir / "generate").glob("*/generations.jsonl")
        return sum(len(g.output_ids) for g in read_jsonl(path, Generation))
    if stage in ("hidden_states", "train"):
        (path,) = (work_dir / "extract").glob("*/examples.jsonl")
        tokens = sum(len(e.input_ids) for e in read_jsonl(path, Example))
        return tokens * (epochs if stage == "train" else 1)
    return None


def expected_bytes(model: Path, work_dir: Path, stage: str, settings: dict) -> int | None:
    """The stage's main working set from the target's shapes and the run's data (float32),
    see the module docstring."""
    from eaglet.records.examples import Example
    from eaglet.records.prompts import Prompt

    cfg = json.loads((model / "config.json").read_text())
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * cfg.get("head_dim", H // cfg["num_attention_heads"])
    weights = (model / "model.safetensors").stat().st_size
    draft = 4 * (3 * H * H + 4 * H * H + 3 * H * cfg["intermediate_size"] + 2 * H * V // 16)
    if stage == "generate":
        (path,) = (work_dir / "tokenize").glob("*/prompts.jsonl")
        prompts = [len(p.prompt_ids) for p in read_jsonl(path, Prompt)]
        batch, length = min(settings["batch"], len(prompts)), max(prompts) + settings["max_tokens"]
        return weights + 4 * (batch * length * L * 2 * kv + batch * V)
    if stage == "hidden_states":
        (path,) = (work_dir / "extract").glob("*/examples.jsonl")
        tokens = sum(len(e.input_ids) for e in read_jsonl(path, Example))
        batch_tokens = min(settings["batch_tokens"], tokens)
        return weights + 4 * batch_tokens * H * (L + 1) + 4 * min(tokens, 65536) * 4 * H
    if stage == "train":
        heads = 1 if cfg.get("tie_word_embeddings") else 2
        return 4 * heads * V * H + 4 * draft
    if stage == "evaluate":
        return weights + draft
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--fixture", type=Path, default=os.environ.get("EAGLET_TEST_FIXTURE_MODEL"))
    parser.add_argument("--targets", default="fixture,qwen3-0.6b,qwen3-0.6b+gpt-oss")
    args = parser.parse_args()
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="eaglet-real-shapes-"))
    root.mkdir(parents=True, exist_ok=True)
    data = root / "data"
    if not data.exists():
        from eaglet.fixture.sample_data import write_sample_data

        write_sample_data(data)
    home = root / "prefect-home"
    home.mkdir(exist_ok=True)
    server, url = start_prefect_server(home)
    env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_HOME": str(home)}
    settings = {"batch": 16, "max_tokens": args.max_tokens, "batch_tokens": 16384}
    rows = []
    try:
        for name in args.targets.split(","):
            model = build_target(name, root / "models" / name, args.layers, args.fixture)
            work_dir = root / "work" / name
            config = {
                "name": name,
                "work_dir": str(work_dir),
                "target": {"model": str(model)},
                "datasets": [{"source": "arith", "path": str(data / "arith.jsonl"),
                              "limit": args.samples}],
                "generation": {"max_tokens": args.max_tokens},
                "reasoning": {"max_truncation_rate": 1.0, "min_capture_rate": 0.0},
                "train": {"epochs": 1, "holdout_fraction": 0.25},
                "evaluate": {"max_prompts": 2, "max_new_tokens": 16},
            }  # fmt: skip
            if json.loads((model / "config.json").read_text())["num_hidden_layers"] < 7:
                config["hidden_states"] = {"aux_layer_ids": [1, 2, 3]}
            path = root / f"{name}.yaml"
            path.write_text(json.dumps(config))
            for stage in STAGES:
                before = load()
                wall, peak, out = run_stage(path, stage, env)
                seconds = stage_seconds(out, stage)
                tokens = stage_tokens(work_dir, stage, 1)
                expected = expected_bytes(model, work_dir, stage, settings)
                rows.append({
                    "target": name, "stage": stage, "seconds": seconds, "wall": wall,
                    "tokens_per_s": tokens / seconds if tokens and seconds > 0 else None,
                    "peak_mb": peak / MB,
                    "expected_mb": None if expected is None else expected / MB,
                    "load": f"{before} -> {load()}",
                })  # fmt: skip
                r = rows[-1]
                print(
                    f"{name:18} {stage:13} {seconds:7.1f} s  "
                    f"{r['tokens_per_s'] or 0:8.0f} tok/s  peak {r['peak_mb']:7.0f} MB  "
                    f"expected {r['expected_mb'] or 0:7.0f} MB + floor  load {r['load']}",
                    flush=True,
                )
    finally:
        server.terminate()
        server.wait(timeout=30)
    print("\n| target | stage | s | tokens/s | peak RSS MB | expected MB (+ floor) | load |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        rate = "" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
        expected = "" if r["expected_mb"] is None else f"{r['expected_mb']:.0f}"
        print(
            f"| {r['target']} | {r['stage']} | {r['seconds']:.1f} | {rate} | "
            f"{r['peak_mb']:.0f} | {expected} | {r['load']} |"
        )
    (root / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"\nresults: {root / 'results.json'}")


if __name__ == "__main__":
    main()
