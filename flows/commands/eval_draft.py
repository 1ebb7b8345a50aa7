"""`eaglet eval DRAFT`: τ of any draft folder on the config's evaluation sets, without training
(`eaglet.draft.set_evaluation`); a draft that cannot be scored is refused in one line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eaglet.config import load_config
from eaglet.eval_sets import EvalSetError


def cmd_eval(args: argparse.Namespace) -> int:
    """τ of any draft folder (eaglet's exports, speculators' layout, a vLLM EAGLE-3, P-EAGLE or
    DFlash checkpoint) on the config's evaluation sets, without training: a published draft
    and your own side by side on the same prompts (the same sha256). A draft that cannot be
    scored (not a draft, weights cut short, NaN or inf in them) is refused in one line."""
    from eaglet.draft.set_evaluation import evaluate_sets
    from eaglet.preflight.train import draft_folder_problem
    from eaglet.target import end_token_ids, load_tokenizer

    config = load_config(args.config, args.set)
    draft = Path(args.draft)
    problem = draft_folder_problem(draft)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.config is None and not Path(config.target.model).exists():
        print(f"error: no --config, and the demo's target {config.target.model} is not "
              "here (run `eaglet demo` first, or give --config CONFIG.yaml)",
              file=sys.stderr)  # fmt: skip
        return 2
    if not config.evaluate.sets:
        print("error: no evaluate.sets to measure: --set 'evaluate.sets=[{name: gsm8k, "
              "path: gsm8k.jsonl}]' or a config with them", file=sys.stderr)  # fmt: skip
        return 2
    tokenizer = load_tokenizer(config.target)
    eos = end_token_ids(config.target, tokenizer)
    try:
        report = evaluate_sets(
            config.evaluate.sets, draft, config.target, tokenizer, config.evaluate,
            config.tokenize.chat_template_kwargs, eos, progress=print,
        )  # fmt: skip
    except (EvalSetError, KeyError, ValueError, RuntimeError, OSError) as exc:
        print(f"error: {draft} cannot be scored against {config.target.model}: "
              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc!r}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.json:
        print(json.dumps({"draft": str(draft.resolve()), "sets": report}, indent=2))
        return 0
    print(f"draft {draft.resolve()} ({next(iter(report.values()))['method']})")
    for name, figures in report.items():
        left_out = figures.get("skipped", [])
        skipped = f", {len(left_out)} over the context left out" if left_out else ""
        print(
            f"  {name:<12} τ {figures['tau']:.3f}  emitted τ {figures['emitted_tau']:.3f}  "
            f"{figures['rounds']} rounds, {figures['prompts']} prompts{skipped}, k "
            f"{figures['num_speculative_tokens']}, sha256 {figures['prompts_sha256'][:16]}"
        )
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    evaluate = commands.add_parser(
        "eval", help="tau of any draft folder on the evaluation sets, without training"
    )
    evaluate.add_argument("draft", help="a draft folder (any format eaglet reads)")
    evaluate.add_argument("--config", default=None, help="a config (default: the demo's)")
    evaluate.add_argument("--set", action="append", default=[], metavar="a.b=value")
    evaluate.add_argument("--json", action="store_true")
    evaluate.set_defaults(handler=cmd_eval)
