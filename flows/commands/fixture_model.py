"""`eaglet fixture-model OUT_DIR`: the tiny reasoning target (or one trained further on another
corpus, a target that drifted), or random weights at a real model's shapes with its real
tokenizer and template."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from eaglet.fixture.corpus import CORPORA
from eaglet.fixture.real_shape import SHAPES as REAL_SHAPES
from eaglet.fixture.real_tokenizers import TOKENIZERS as REAL_TOKENIZERS


def cmd_fixture_model(args: argparse.Namespace) -> int:
    from eaglet.fixture.model import build_fixture_model
    from eaglet.fixture.real_shape import build_real_shape_model
    from eaglet.fixture.real_tokenizers import MissingTokenizerPackage

    started = time.time()
    if args.shape is None:
        if args.layers is not None or args.vocab_size is not None or args.tokenizer is not None:
            print("error: --layers, --vocab-size and --tokenizer go with --shape", file=sys.stderr)
            return 2
        if args.corpus != "fixture" and args.continue_from is None:
            print("error: --corpus goes with --continue-from", file=sys.stderr)
            return 2
        if args.continue_from is not None and not (args.continue_from / "fixture.json").is_file():
            print(f"error: --continue-from {args.continue_from} is not a fixture model folder",
                  file=sys.stderr)  # fmt: skip
            return 2
        path = build_fixture_model(
            Path(args.out_dir), seed=args.seed, train_steps=args.steps,
            continue_from=args.continue_from, corpus=args.corpus,
        )  # fmt: skip
    else:
        try:
            path = build_real_shape_model(
                Path(args.out_dir),
                args.shape,
                args.layers,
                args.vocab_size,
                seed=args.seed,
                tokenizer_family=args.tokenizer or "qwen3",
            )
        except (MissingTokenizerPackage, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(f"fixture model written to {path} in {time.time() - started:.1f} s")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    fixture = commands.add_parser(
        "fixture-model",
        help="build the tiny reasoning target model, or a random-weight one at a real shape",
    )
    fixture.add_argument("out_dir")
    fixture.add_argument("--seed", type=int, default=0)
    fixture.add_argument(
        "--shape",
        choices=REAL_SHAPES,
        help="a real model's shapes, random weights, its real tokenizer and chat template",
    )
    fixture.add_argument(
        "--continue-from", type=Path, metavar="FIXTURE",
        help="train a fixture model further (its tokenizer kept): a target that drifted",
    )  # fmt: skip
    fixture.add_argument(
        "--corpus", choices=CORPORA, default="fixture",
        help="what it trains on: the fixture's conversations, or 'restyled' (the same tasks, "
        "reasoning in other words; with --continue-from)",
    )  # fmt: skip
    fixture.add_argument("--steps", type=int, help="training steps (default 250; continued: 60)")
    fixture.add_argument("--layers", type=int, help="with --shape: fewer layers, same width")
    fixture.add_argument(
        "--vocab-size", type=int, help="with --shape: more embedding and lm_head rows"
    )
    fixture.add_argument(
        "--tokenizer",
        choices=REAL_TOKENIZERS,
        help="with --shape: the tokenizer family, its chat template and vocabulary "
        "(default qwen3; gpt-oss: o200k_harmony, 201,088 rows, the harmony format)",
    )
    fixture.set_defaults(handler=cmd_fixture_model)
