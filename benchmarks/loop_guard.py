"""The loop guard's savings and its false stops.

1. Against the stand-in vLLM server (tests/fake_servers.py, streaming as vLLM streams), where a
   known share of prompts loop to `max_tokens`: server tokens spent per usable sample (an answer
   that finished) with the guard and without it, in the same run, and their ratio.
2. On real answers (the demo's generations, or any `generations.jsonl`): how many the guard,
   at the config's defaults, would have stopped (false stops: none of them loops).

    python benchmarks/loop_guard.py [--prompts 200] [--loop-share 0.3] [--max-tokens 2048]
                                    [--generations runs/demo/generate/*/generations.jsonl]
                                    [--engines vllm,sglang,openai]

Counts, not time, are the measure here; the load average is printed beside them all the same.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglet.config import GenerationConfig  # noqa: E402
from eaglet.loop_guard import first_loop  # noqa: E402
from eaglet.records.generations import Generation  # noqa: E402
from eaglet.records.io import read_jsonl  # noqa: E402
from tests.engine_helpers import EOS_ID, TOKENIZER, make_config, make_prompt  # noqa: E402
from tests.fake_servers import FakeServer, serve  # noqa: E402


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def spend(
    url: str, server: FakeServer, prompts: list, max_tokens: int, guard: bool, engine_name: str
) -> dict:
    """Server tokens and usable samples of one pass over `prompts`."""
    from eaglet.engines.registry import make_engine

    config = make_config(
        [url], engine_name, max_tokens=max_tokens, loop_guard=guard, concurrency=32
    )
    engine = make_engine(config, TOKENIZER, end_ids=[EOS_ID])
    server.generated_tokens = 0

    async def run() -> list:
        return [item async for item in engine.generate_async(prompts)]

    records = asyncio.run(run())
    finishes = [r.finish_reason for r in records if isinstance(r, Generation)]
    usable = finishes.count("stop")
    return {
        "tokens": server.generated_tokens,
        "usable": usable,
        "looped": finishes.count("loop"),
        "truncated": finishes.count("length"),
        "per_usable": server.generated_tokens / max(usable, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--loop-share", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--token-delay-s", type=float, default=0.0002)
    parser.add_argument("--generations", nargs="*", default=None)
    parser.add_argument(
        "--engines", default="vllm,sglang,openai", help="HTTP engines to measure, comma-separated"
    )
    args = parser.parse_args()
    defaults = GenerationConfig()
    print(
        f"load average {load()}; guard: {defaults.loop_ngram}-grams, {defaults.loop_repeats} times"
    )

    server = FakeServer(TOKENIZER, loop_share=args.loop_share, token_delay_s=args.token_delay_s)
    prompts = [make_prompt(i) for i in range(args.prompts)]
    looping = sum(server.loops(p.prompt_ids) for p in prompts)
    print(
        f"\n## Stand-in server: {args.prompts} prompts, {looping} looping "
        f"({looping / args.prompts:.0%}), max_tokens {args.max_tokens}\n"
    )
    print(
        "| engine | loop guard | server tokens | usable | looped | truncated | tokens per usable |"
    )
    print("|---|---|---|---|---|---|---|")
    with serve(server) as url:
        for engine_name in args.engines.split(","):
            without = spend(url, server, prompts, args.max_tokens, False, engine_name)
            with_guard = spend(url, server, prompts, args.max_tokens, True, engine_name)
            for name, r in (("off", without), ("on", with_guard)):
                print(
                    f"| {engine_name} | {name} | {r['tokens']:,} | {r['usable']} | "
                    f"{r['looped']} | {r['truncated']} | {r['per_usable']:.0f} |"
                )
            ratio = with_guard["tokens"] / without["tokens"]
            print(f"| {engine_name} | on / off | {ratio:.3f} ({1 - ratio:.0%} fewer) | | | | |")
    print(f"\nload {load()}")

    paths = args.generations
    if paths is None:
        paths = glob.glob("runs/demo/generate/*/generations.jsonl")
    answers = [g for path in paths for g in read_jsonl(Path(path), Generation)]
    if not answers:
        print(
            "\nno generations given (--generations) and none in runs/demo: false stops not measured"
        )
        return
    stops = {
        g.sample_id: (g, at)
        for g in answers
        if (at := first_loop(g.output_ids, defaults.loop_ngram, defaults.loop_repeats))
    }
    finished = [g for g, _ in stops.values() if g.finish_reason == "stop"]
    cut = [(g, at) for g, at in stops.values() if g.finish_reason != "stop"]
    truncated = sum(g.finish_reason == "length" for g in answers)
    tokens = sum(len(g.output_ids) for g in answers)
    print(
        f"\n## On {len(answers)} real answers ({tokens:,} tokens; {', '.join(paths)})\n\n"
        f"false stops (answers that finished, stopped by the guard at its defaults): "
        f"{len(finished)} of {sum(g.finish_reason == 'stop' for g in answers)}"
        + (f": {[g.sample_id for g in finished][:10]}" if finished else "")
        + f"\nanswers cut at max_tokens: {truncated}; the guard stops {len(cut)} of them"
        + "".join(f"\n  {g.sample_id}: at token {at} of {len(g.output_ids)}" for g, at in cut[:10])
    )


if __name__ == "__main__":
    main()
