"""Draft methods side by side on the same data: EAGLE-3, P-EAGLE, DFlash and DSpark, each trained
on the same hidden states of the same samples and evaluated on the same held-out prompts at the
same k.

Per method: offline τ and emitted τ (output tokens per verification round) greedy and sampled
(T --temperature, vLLM's rejection rule), the draft's cost per round against the target's
(wall time of the drafter's proposals and of the target's verification forwards in eaglet's
evaluator, on this CPU: not vLLM's kernels), training seconds and tokens/s. The pipeline's own
stages run (eaglet.stage_runner, no Prefect): download, tokenize, generate, extract and
hidden_states once (Cached for the other methods: the layers are the same), then train and
evaluate per method.

    python benchmarks/methods.py [--demo-dir runs/demo] [--work-dir /tmp/eaglet-methods]
        [--methods eagle3,peagle,dflash,dspark] [--k 4] [--epochs 8] [--temperature 0.6]
        [--set a.b=value ...] [--out benchmarks/methods.md]

The target and data are the demo's (`make demo` builds them in --demo-dir). Run it alone: on two
shared cores the timings move with whatever else runs (the load average is printed beside
them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglet.config import load_config  # noqa: E402
from eaglet.draft import evaluate as evaluator  # noqa: E402
from eaglet.draft.methods import draft_method, method_of_draft  # noqa: E402
from eaglet.stage_bodies.every_stage import run_stage_without_prefect  # noqa: E402
from eaglet.stage_context import PlainContext  # noqa: E402
from eaglet.stages import STAGE_LIST  # noqa: E402

METHOD_SETTINGS = {  # the same k for each: its chain, its masks, its block
    "eagle3": lambda k: [f"evaluate.num_speculative_tokens={k}"],
    "peagle": lambda k: [f"evaluate.num_speculative_tokens={k}", f"train.ttt_length={k}"],
    "dflash": lambda k: [
        f"evaluate.num_speculative_tokens={k}",
        f"train.dflash.block_size={k + 1}",
    ],
    "dspark": lambda k: [
        f"evaluate.num_speculative_tokens={k}",
        f"train.dspark.block_size={k}",
    ],
}


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run_pipeline(config) -> dict:
    outputs = {}
    for spec in STAGE_LIST:
        if spec.runs(config):
            inputs = {name: outputs[name] for name in spec.inputs(config)}
            outputs[spec.output] = run_stage_without_prefect(
                spec.name, config, inputs, PlainContext(lambda _: None)
            )
    return outputs


def round_costs(draft_dir: Path, config, prompts: list[list[int]]) -> dict:
    """Seconds per round of the drafter and of the target's verification, in the evaluator."""
    spent = {"draft": 0.0, "target": 0.0, "rounds": 0}
    config_json = json.loads((draft_dir / "config.json").read_text())
    method = method_of_draft(config_json)
    draft, _ = method.load(draft_dir)
    target = evaluator.load_target(config.target)
    draft = draft.to(dtype=target.get_input_embeddings().weight.dtype).eval()
    k = method.evaluation_k(config_json, config.evaluate.num_speculative_tokens)
    real_drafter, real_extend = method.drafter, evaluator.TargetRunner.extend

    def timed_drafter(*args, **kwargs):
        inner = real_drafter(*args, **kwargs)
        propose = inner.propose

        def timed(*a, **kw):
            started = time.perf_counter()
            out = propose(*a, **kw)
            spent["draft"] += time.perf_counter() - started
            spent["rounds"] += 1
            return out

        inner.propose = timed
        return inner

    def timed_extend(self, tokens):
        started = time.perf_counter()
        out = real_extend(self, tokens)
        spent["target"] += time.perf_counter() - started
        return out

    method.drafter, evaluator.TargetRunner.extend = timed_drafter, timed_extend
    try:
        ids = method.layer_ids(None, target.config.num_hidden_layers)
        evaluator.evaluate_loaded(draft, target, prompts, None, k, 64, set(), ids, progress=None)
    finally:
        method.drafter, evaluator.TargetRunner.extend = real_drafter, real_extend
    rounds = max(spent["rounds"], 1)
    return {
        "draft_ms_per_round": 1000 * spent["draft"] / rounds,
        "target_ms_per_round": 1000 * spent["target"] / rounds,
        "draft_over_target": spent["draft"] / max(spent["target"], 1e-9),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo-dir", default="runs/demo")
    parser.add_argument("--work-dir", default="/tmp/eaglet-methods")
    parser.add_argument("--methods", default=",".join(METHOD_SETTINGS))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--set", action="append", default=[], metavar="a.b=value")
    parser.add_argument("--out", default=None, help="also write the table (Markdown) here")
    args = parser.parse_args()

    demo = Path(args.demo_dir).resolve()
    if not (demo / "models" / "fixture" / "config.json").exists():
        sys.exit(f"no fixture target in {demo}/models/fixture: run `make demo` first")
    base = [
        f"work_dir={args.work_dir}",
        f"target.model={demo / 'models' / 'fixture'}",
        f"datasets=[{{source: arith, path: {demo / 'data' / 'arith.jsonl'}}}, "
        f"{{source: tools, path: {demo / 'data' / 'tools.jsonl'}}}, "
        f"{{source: mixed, path: {demo / 'data' / 'mixed.parquet'}}}]",
        f"train.epochs={args.epochs}",
        f"evaluate.temperature={args.temperature}",
        *args.set,
    ]
    rows = []
    for name in args.methods.split(","):
        draft_method(name)  # an unknown name fails before any work
        config = load_config(None, [*base, f"train.method={name}", *METHOD_SETTINGS[name](args.k)])
        load_before = loadavg()
        outputs = run_pipeline(config)
        train, report_manifest = outputs["draft"], outputs["report"]
        report = json.loads(
            (Path(args.work_dir) / report_manifest.path / "report.json").read_text()
        )
        draft_dir = Path(args.work_dir) / train.path / "draft"
        prompts_path = Path(args.work_dir) / outputs["prompts"].path / "prompts.jsonl"
        prompts = [json.loads(line)["prompt_ids"] for line in prompts_path.read_text().splitlines()]
        costs = round_costs(draft_dir, config, prompts[-8:])
        info, sampled = train.info, report.get("sampled") or {}
        row = {
            "method": name,
            "k": report["draft"]["num_speculative_tokens"],
            "tau": report["tau"],
            "emitted_tau": report["emitted_tau"],
            "untrained_tau": report["untrained_tau"],
            "sampled_tau": sampled.get("tau"),
            "sampled_emitted_tau": sampled.get("emitted_tau"),
            "train_seconds": info["seconds"],
            "train_tokens_per_s": info["train_tokens"]
            * info["epochs_completed"]
            / max(info["step_seconds"], 1e-9),
            **costs,
            "load_average": f"{load_before} -> {loadavg()}",
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    t = f"T={args.temperature:g}"
    table = [
        f"| method | k | τ greedy | emitted τ | τ {t} | emitted τ {t} | untrained τ "
        "| draft ms/round | target ms/round | draft / target | train s | train tokens/s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for r in rows:
        cells = [
            r["method"], r["k"], f"{r['tau']:.3f}", f"{r['emitted_tau']:.3f}",
            f"{r['sampled_tau'] or nan:.3f}", f"{r['sampled_emitted_tau'] or nan:.3f}",
            f"{r['untrained_tau']:.3f}", f"{r['draft_ms_per_round']:.1f}",
            f"{r['target_ms_per_round']:.1f}", f"{r['draft_over_target']:.2f}",
            f"{r['train_seconds']:.0f}", f"{r['train_tokens_per_s']:.0f}", r["load_average"],
        ]  # fmt: skip
        table.append("| " + " | ".join(str(c) for c in cells) + " |")
    print("\n".join(table))
    if args.out:
        Path(args.out).write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
