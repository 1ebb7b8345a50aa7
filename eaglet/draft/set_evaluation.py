"""τ of a draft on named evaluation sets (`evaluate.sets`, `eaglet.eval_sets`), per set and per
category, saying what was measured: the set, the sha256 of its exact prompts, k, temperature
and top_p, the chat template's arguments (thinking on or off), the engine.

Each prompt is rendered with the target's chat template (`tokenize.chat_template_kwargs`) and
decoded with vLLM's rounds (`eaglet.draft.evaluate.speculative_generate`: greedy, the output is
the target's own greedy answer; sampled, vLLM's rejection rule). A set with two turns
(MT-Bench) asks its second turn after the target's own first answer, both turns' rounds
counted. The hash covers the first turns' token ids and the later turns' text: the same hash
means the same prompts, token for token.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eaglet.config.evaluate import EvalSet, EvaluateConfig
from eaglet.config.target import TargetConfig
from eaglet.draft.evaluate import Verifier, load_target, resolve_aux_ids, speculative_generate
from eaglet.draft.methods import method_of_draft
from eaglet.draft.rejection import Sampling
from eaglet.draft.serving import emitted_tau
from eaglet.eval_sets import EvalPrompt, read_set, too_long_to_tokenize
from eaglet.prompt_rendering import context_length

ENGINE = "eaglet offline evaluator (vLLM's rounds)"


def render(tokenizer: Any, messages: list[dict[str, str]], chat_kwargs: dict) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **chat_kwargs
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return [int(i) for i in ids]


def figures(accepted: list[int], new_tokens: int, prompts: int, k: int) -> dict[str, Any]:
    rounds = len(accepted)
    reached = [sum(n >= j for n in accepted) for j in range(k + 1)]
    return {
        "tau": 1 + sum(accepted) / max(rounds, 1),
        "emitted_tau": emitted_tau(new_tokens, prompts, rounds),
        "rounds": rounds,
        "prompts": prompts,
        "per_position_acceptance": [reached[j] / max(reached[0], 1) for j in range(1, k + 1)],
    }


def measurable(
    prompts: list[EvalPrompt],
    tokenizer: Any,
    chat_kwargs: dict[str, Any],
    context: int | None,
    max_new_tokens: int,
) -> tuple[list[EvalPrompt], list[dict[str, Any]]]:
    """The prompts whose first turn and `max_new_tokens` fit the target's context, and the
    others named (prompt id, why): a prompt over the context is never scored. The hard bound
    (`too_long_to_tokenize`) is checked before any tokenizing."""
    kept, skipped = [], []
    for prompt in prompts:
        why = too_long_to_tokenize(prompt, context)
        if why is None and context is not None:
            tokens = len(render(tokenizer, [{"role": "user", "content": prompt.turns[0]}],
                                chat_kwargs))  # fmt: skip
            if tokens + max_new_tokens > context:
                why = (
                    f"{tokens} prompt tokens + {max_new_tokens} new (evaluate.max_new_tokens) "
                    f"over the {context}-token context"
                )
        if why is None:
            kept.append(prompt)
        else:
            skipped.append({"prompt_id": prompt.prompt_id, "why": why})
    return kept, skipped


def evaluate_sets(
    sets: list[EvalSet],
    draft_dir: Path,
    target: TargetConfig,
    tokenizer: Any,
    settings: EvaluateConfig,
    chat_kwargs: dict[str, Any],
    eos_token_ids: list[int],
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per set name: greedy τ, emitted τ, rounds, prompts, per-position acceptance, per
    category, the prompts' sha256 and what was measured; `sampled` too at temperature > 0."""
    config_json = json.loads((Path(draft_dir) / "config.json").read_text())
    method = method_of_draft(config_json)
    draft, _ = method.load(Path(draft_dir))
    k = method.evaluation_k(config_json, settings.num_speculative_tokens)
    model = load_target(target)
    embed = model.get_input_embeddings().weight
    draft = draft.to(device=model.device, dtype=embed.dtype).eval()
    aux_ids = resolve_aux_ids(config_json, None, Path(draft_dir) / "config.json")
    eos = set(eos_token_ids)
    passes: dict[str, Verifier] = {"greedy": Verifier()}
    if settings.temperature > 0:
        generator = torch.Generator(device=model.device).manual_seed(settings.sampling_seed)
        passes["sampled"] = Verifier(Sampling(settings.temperature, settings.top_p), generator)
    context = context_length(model.config.get_text_config())
    out = {}
    for spec in sets:
        prompts, skipped = measurable(
            read_set(spec), tokenizer, chat_kwargs, context, settings.max_new_tokens
        )
        if skipped and progress is not None:
            progress(
                f"evaluation set {spec.name}: {len(skipped)} prompt(s) over the target's "
                f"context left out ({', '.join(s['prompt_id'] for s in skipped[:5])}"
                f"{', ...' if len(skipped) > 5 else ''}): {skipped[0]['why']}"
            )
        hashed: list[Any] = []
        result: dict[str, Any] = {}
        for name, verifier in passes.items():
            accepted: dict[str | None, list[int]] = defaultdict(list)
            new_tokens: dict[str | None, int] = defaultdict(int)
            counted: dict[str | None, int] = defaultdict(int)
            for prompt in prompts:
                messages: list[dict[str, str]] = []
                for turn, text in enumerate(prompt.turns):
                    messages.append({"role": "user", "content": text})
                    ids = render(tokenizer, messages, chat_kwargs)
                    if turn and context and len(ids) + settings.max_new_tokens > context:
                        break  # the conversation outgrew the context: its later turns not asked
                    if name == "greedy":
                        hashed.append(ids if turn == 0 else text)
                    run = speculative_generate(
                        model, draft, embed, ids, k, settings.max_new_tokens, eos, aux_ids,
                        True, verifier,
                    )  # fmt: skip
                    accepted[prompt.category] += run.accepted
                    new_tokens[prompt.category] += len(run.tokens)
                    answer = tokenizer.decode(run.tokens, skip_special_tokens=True)
                    messages.append({"role": "assistant", "content": answer})
                counted[prompt.category] += 1
            every = [n for rows in accepted.values() for n in rows]
            whole = figures(every, sum(new_tokens.values()), len(prompts), k)
            categories = {
                str(c): figures(accepted[c], new_tokens[c], counted[c], k)
                for c in sorted(accepted, key=str)
                if c is not None
            }
            result[name] = {**whole, **({"categories": categories} if categories else {})}
            if progress is not None:
                progress(f"evaluation set {spec.name} ({name}): tau {whole['tau']:.3f}")
        greedy = result.pop("greedy")
        out[spec.name] = {
            **greedy,
            **({"sampled": result["sampled"]} if "sampled" in result else {}),
            "prompts_sha256": hashlib.sha256(json.dumps(hashed).encode()).hexdigest(),
            "path": spec.path,
            "limit": spec.limit,
            "turns": max((len(p.turns) for p in prompts), default=0),
            "num_speculative_tokens": k,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "chat_template_kwargs": dict(chat_kwargs),
            "thinking": chat_kwargs.get("enable_thinking"),
            "engine": ENGINE,
            "method": method.name,
            "max_new_tokens": settings.max_new_tokens,
            **({"skipped": skipped} if skipped else {}),
        }
    return out
