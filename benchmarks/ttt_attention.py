"""TTT attention: the dense mask against the `TTT` pattern, one training step's draft part.

Times `ttt_unroll` forward + backward of a draft shaped like the fixture target's (or --hidden,
--heads, ...) at several sequence lengths, once with SDPA over every earlier step's keys under
`ttt_attention_mask` (the dense form: (step + 1) * T keys per query) and once with the `TTT`
pattern (`ttt_attention`: a causal [T, T] block plus one diagonal score per later step). The two
alternate, `--repeats` times each, and the script prints the median seconds of each and their
ratio; both run in this process, so the ratio holds on a loaded machine better than either time.

    python benchmarks/ttt_attention.py [--lengths 256 512 1024] [--batch 4] [--ttt-length 4]

Run it alone: on two shared cores torch's threads slow down beside any other job.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from eaglet.draft.methods.eagle3_model import (  # noqa: E402
    TTT,
    Eagle3Config,
    Eagle3Draft,
    ttt_attention_mask,
)
from eaglet.draft.methods.loss import shift_left  # noqa: E402


def unroll(draft: Eagle3Draft, embed, ids, hidden, ttt_length: int, dense: bool) -> list:
    """`ttt_unroll`, with the attention pattern chosen: the dense mask or `TTT`."""
    B, T, _ = hidden.shape
    positions = torch.arange(T).expand(B, T)
    cache, logits = [], []
    for i in range(ttt_length):
        emb = F.embedding(shift_left(ids, 1 + i, T), embed)
        mask = ttt_attention_mask(T, i) if dense else TTT
        hidden, cache = draft(emb, hidden, positions + i, cache, mask)
        logits.append(draft.compute_logits(hidden))
    return logits


def step_seconds(draft, embed, ids, aux, ttt_length: int, dense: bool) -> float:
    start = time.perf_counter()
    draft.zero_grad(set_to_none=True)
    logits = unroll(draft, embed, ids, draft.fuse(aux), ttt_length, dense)
    sum(x.float().logsumexp(-1).mean() for x in logits).backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ttt-length", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--draft-vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = Eagle3Config(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab,
        draft_vocab_size=args.draft_vocab,
        target_hidden_size=args.hidden,
    )
    draft = Eagle3Draft(config)
    embed = torch.randn(args.vocab, args.hidden)
    print(
        f"draft H={args.hidden} heads={args.heads}/{args.kv_heads} D={args.head_dim} "
        f"ttt_length={args.ttt_length} batch={args.batch} threads={torch.get_num_threads()}"
    )
    print(f"{'T':>6} {'dense s':>9} {'TTT s':>9} {'dense/TTT':>10} {'tok/s TTT':>10}")
    for T in args.lengths:
        ids = torch.randint(0, args.vocab, (args.batch, T + args.ttt_length))
        aux = torch.randn(args.batch, T, 3 * args.hidden)
        for dense in (True, False):  # warm-up
            step_seconds(draft, embed, ids, aux, args.ttt_length, dense)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for dense in (True, False):
                times[dense].append(step_seconds(draft, embed, ids, aux, args.ttt_length, dense))
        dense_s, ttt_s = statistics.median(times[True]), statistics.median(times[False])
        tokens = args.batch * T
        ratio = dense_s / ttt_s
        print(f"{T:>6} {dense_s:>9.4f} {ttt_s:>9.4f} {ratio:>9.2f}x {tokens / ttt_s:>10.0f}")


if __name__ == "__main__":
    main()
