"""The embedded engine: the target in-process with transformers, batched, greedy or sampled.

It is the default so the whole pipeline runs on a laptop with no server; output ids are the
model's own tokens, so its records are token-exact like those of the vLLM and SGLang engines.
With `generation.loop_guard` each row's new tokens go through a `LoopDetector` as they are
generated; a looping row ends there (finish_reason "loop", the ids so far), and a batch whose
other rows are done stops instead of running its loops to max_tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from transformers import StoppingCriteria

from eaglet.config import PipelineConfig, TargetConfig
from eaglet.cpu_threads import apply_threads
from eaglet.engines.base import SamplingParams
from eaglet.loop_guard import LoopDetector
from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt
from eaglet.target import end_token_ids, load_model, load_tokenizer


class LocalEngine:
    name = "local"

    def __init__(
        self,
        target: TargetConfig,
        params: SamplingParams,
        batch_size: int = 16,
        loop_guard: tuple[int, int] | None = None,  # (ngram, repeats); None: unguarded
    ) -> None:
        self.params = params
        self.batch_size = batch_size
        self.loop_guard = loop_guard
        self.tokenizer = load_tokenizer(target)
        self.model = load_model(target)
        self.eos_ids = end_token_ids(target, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]

    @classmethod
    def from_config(cls, config: PipelineConfig, tokenizer: Any = None, **_: Any) -> LocalEngine:
        """The registry's constructor; the local engine loads the target's tokenizer itself
        and takes no server settings."""
        generation = config.generation
        params = SamplingParams.from_generation(generation)
        guard = (generation.loop_ngram, generation.loop_repeats) if generation.loop_guard else None
        return cls(config.target, params, generation.batch_size, guard)

    def generate(self, prompts: Iterable[Prompt]) -> Iterator[Generation]:
        # A generator: runs in the thread that consumes it (the sync-engine worker thread).
        apply_threads("generate")
        # One batch samples alike (generation.sampling_plan can vary it per prompt); similar
        # lengths in a batch waste less compute on padding.
        groups: dict[tuple[float, float], tuple[SamplingParams, list[Prompt]]] = {}
        for prompt in prompts:
            params = self.params.for_prompt(prompt)
            groups.setdefault((params.temperature, params.top_p), (params, []))[1].append(prompt)
        for params, group in groups.values():
            ordered = sorted(group, key=lambda p: len(p.prompt_ids))
            for start in range(0, len(ordered), self.batch_size):
                yield from self._generate_batch(ordered[start : start + self.batch_size], params)

    @torch.inference_mode()
    def _generate_batch(self, batch: list[Prompt], params: SamplingParams) -> list[Generation]:
        width = max(len(p.prompt_ids) for p in batch)
        # Left padding: every prompt ends at the same column, where generation starts.
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, P]
        for row, prompt in enumerate(batch):
            n = len(prompt.prompt_ids)
            input_ids[row, width - n :] = torch.tensor(prompt.prompt_ids)
            attention_mask[row, width - n :] = 1
        sampled = params.temperature > 0
        if sampled:
            torch.manual_seed(params.seed)
        ends = [*self.eos_ids, self.pad_id]
        guard = _LoopGuard(*self.loop_guard, len(batch), ends) if self.loop_guard else None
        output = self.model.generate(
            input_ids=input_ids.to(self.model.device),
            attention_mask=attention_mask.to(self.model.device),
            max_new_tokens=params.max_tokens,
            do_sample=sampled,
            temperature=params.temperature if sampled else None,
            top_p=params.top_p if sampled else None,
            top_k=None,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            stop_strings=params.stop or None,
            tokenizer=self.tokenizer if params.stop else None,
            stopping_criteria=[guard] if guard else None,
        )  # [B, P + new]
        records = []
        for row, prompt in enumerate(batch):
            new_ids = output[row, width:].tolist()
            detector = guard.detectors[row] if guard else None
            if detector is not None and detector.looping:
                looped = new_ids[: len(detector.ids)]
                raw = {"loop": detector.evidence()}
                records.append(Generation.answering(prompt, looped, "loop", self.name, raw=raw))
                continue
            output_ids, finish_reason = _cut_at_end(new_ids, self.eos_ids, self.pad_id)
            records.append(Generation.answering(prompt, output_ids, finish_reason, self.name))
        return records


class _LoopGuard(StoppingCriteria):
    """transformers' per-row stopping criterion for the loop guard: each step's new token of a
    row goes to that row's `LoopDetector`, and a looping row is done. A row that emitted an end
    or padding token (finished; transformers pads it from then on) is fed no more, so padding
    is never taken for a loop."""

    def __init__(self, ngram: int, repeats: int, rows: int, ends: list[int]) -> None:
        self.detectors = [LoopDetector(ngram, repeats) for _ in range(rows)]
        self.ends = set(ends)
        self.open = [True] * rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        for row, token in enumerate(input_ids[:, -1].tolist()):  # input_ids: [B, P + new]
            if not self.open[row]:
                continue
            if token in self.ends:
                self.open[row] = False
            elif self.detectors[row].feed([token]):
                self.open[row] = False
        looping = [detector.looping for detector in self.detectors]
        return torch.tensor(looping, dtype=torch.bool, device=input_ids.device)  # [B]


def _cut_at_end(new_ids: list[int], eos_ids: list[int], pad_id: int) -> tuple[list[int], str]:
    """Keep tokens up to and including the first end token; after it comes only padding."""
    for index, token in enumerate(new_ids):
        if token in eos_ids:
            return new_ids[: index + 1], "stop"
    return new_ids, "length"
