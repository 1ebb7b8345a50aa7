"""The embedded engine: the target in-process with transformers, batched, greedy or sampled.

It is the default so the whole pipeline runs on a laptop with no server; output ids are the
model's own tokens, so its records are token-exact like those of the vLLM and SGLang engines.
Sampled, each row draws from its own generator, seeded from `generation.seed` and the sample
id (`sample_seed`): a sample's tokens are the same whichever batch it is in and whatever the
batch size, so a sample regenerated alone gets the tokens a fresh run gives it (as vLLM's
per-request seed does).
With `generation.loop_guard` each row's new tokens go through a `LoopDetector` as they are
generated; a looping row ends there (finish_reason "loop", the ids so far), and a batch whose
other rows are done stops instead of running its loops to max_tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from transformers import LogitsProcessor, StoppingCriteria

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
        ends = [*self.eos_ids, self.pad_id]
        guard = _LoopGuard(*self.loop_guard, len(batch), ends) if self.loop_guard else None
        sampler = None
        if params.temperature > 0:  # each row its own draws; transformers then picks greedily
            seeds = [sample_seed(params.seed, p.sample_id) for p in batch]
            sampler = _PerSampleSampler(seeds, params.temperature, params.top_p)
        output = self.model.generate(
            input_ids=input_ids.to(self.model.device),
            attention_mask=attention_mask.to(self.model.device),
            max_new_tokens=params.max_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            logits_processor=[sampler] if sampler else None,
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


def sample_seed(seed: int, sample_id: str) -> int:
    """The seed of one sample's draws: a function of the run's seed and the sample id only."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()[:8], "little")


class _PerSampleSampler(LogitsProcessor):
    """Samples each row's next token with the row's own generator (temperature, then top-p
    as transformers applies them) and returns scores where only that token is finite, so
    greedy decoding takes it: a row's draws never depend on the other rows of its batch."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float) -> None:
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float() / self.temperature  # [B, V]
        if self.top_p < 1.0:  # keep the smallest set of tokens whose mass reaches top_p
            ordered, order = torch.sort(logits, descending=True)  # [B, V]
            mass = ordered.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
            drop = mass - ordered.softmax(dim=-1) >= self.top_p  # the mass before it suffices
            logits = logits.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
        probs = logits.softmax(dim=-1).cpu()  # [B, V]
        chosen = torch.full_like(scores, float("-inf"))  # [B, V]
        for row, generator in enumerate(self.generators):
            token = torch.multinomial(probs[row], 1, generator=generator)
            chosen[row, token] = 0.0
        return chosen


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
