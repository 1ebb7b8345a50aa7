"""train.keep_best: tau, the acceptance length of the draft being trained, at an epoch's end.

The held-out loss can keep falling while τ drops (DeepSpec#84: after about 4.6 epochs), so the
draft a server would accept most is picked by τ itself. The prompts are the held-out samples'
own (their shard tokens before the first trained one: what the target answered); the target is
loaded once, into the training process, on its device; each epoch's draft is copied into the
target's dtype and runs the evaluator's greedy rounds (`eaglet.draft.evaluate`, vLLM's count)
at k = train.ttt_length, the k the exports name.
"""

from __future__ import annotations

import copy

from eaglet.config.target import TargetConfig
from eaglet.draft.evaluate import default_eos_ids, evaluate_loaded, load_target
from eaglet.draft.train_data import HiddenStatesData
from eaglet.target import end_token_ids, load_tokenizer


def heldout_prompts(data: HiddenStatesData, limit: int) -> list[list[int]]:
    """The prompt ids of the first `limit` samples of `data`: each sample's tokens before its
    first trained (loss-masked) one."""
    prompts = []
    for entry in data.samples[:limit]:
        row = data.sample_tokens(entry)
        trained = row["loss_mask"].nonzero()
        start = int(trained[0]) if len(trained) else entry["length"]
        if start:
            prompts.append(row["input_ids"][:start].tolist())
    return prompts


class HeldoutTau:
    """Calling it with a draft gives the draft's τ on the held-out prompts."""

    def __init__(
        self,
        target: TargetConfig,
        data: HiddenStatesData,
        prompts: int,
        k: int,
        max_new_tokens: int,
        trained_ids: list[int],
    ):
        self.prompts = heldout_prompts(data, prompts)
        if not self.prompts:
            raise ValueError("train.keep_best=tau: the held-out samples have no prompt tokens")
        self.target = load_target(target)
        # the generation config's end tokens, else the tokenizer's (as the evaluate stage)
        self.eos = set(
            default_eos_ids(self.target) or end_token_ids(target, load_tokenizer(target))
        )
        self.k, self.max_new_tokens, self.trained_ids = k, max_new_tokens, trained_ids

    def __call__(self, draft) -> float:
        report = evaluate_loaded(
            copy.deepcopy(draft), self.target, self.prompts, None, self.k, self.max_new_tokens,
            self.eos, self.trained_ids, progress=None,
        )  # fmt: skip
        return report["tau"]
