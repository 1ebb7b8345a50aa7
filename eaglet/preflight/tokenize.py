"""`tokenize`: the target's chat template renders a prompt with
`tokenize.chat_template_kwargs` and reads every key (a misspelt `enable_thinkng` is
otherwise silently ignored), the sampling plan's reasoning efforts each render a prompt of
their own, `reasoning.format` fits the template, and `tokenize.max_prompt_tokens +
generation.max_tokens` fits the target's context.
"""

from __future__ import annotations

import json
from typing import Any

from eaglet.config.pipeline import PipelineConfig
from eaglet.preflight.report import PreflightReport, first_line

PROBE = [{"role": "user", "content": "What is 2 + 2?"}]


def check_template(config: PipelineConfig, tokenizer: Any, report: PreflightReport) -> None:
    from eaglet.reasoning import detect_format

    kwargs = config.tokenize.chat_template_kwargs
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        report.problems.append(
            "target.model: the tokenizer has no chat template: eaglet renders prompts with "
            "it; use a chat (instruct/reasoning) model or add chat_template to its "
            "tokenizer_config.json"
        )
        return
    texts = template if isinstance(template, str) else json.dumps(template)
    unread = [key for key in kwargs if key not in texts]
    if unread:
        report.problems.append(
            f"tokenize.chat_template_kwargs: the target's chat template never reads {unread} "
            f"(misspelt? it is ignored silently, so the prompts would not be what you meant): "
            "fix or remove the key"
        )
    try:
        text = tokenizer.apply_chat_template(
            PROBE, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as exc:
        report.problems.append(
            f"tokenize.chat_template_kwargs={kwargs}: the chat template cannot render a "
            f"prompt with them ({first_line(exc)})"
        )
        return
    effort_problem = _plan_effort_problem(config, tokenizer, texts)
    if effort_problem:
        report.problems.append(effort_problem)
    try:
        reasoning_format = detect_format(tokenizer, config.reasoning.format, kwargs)
    except ValueError as exc:
        report.problems.append(f"reasoning.format: {exc}: set reasoning.format to auto or none")
        return
    if not unread:
        report.passed.append(
            f"chat template renders a prompt ({len(text)} chars) with {kwargs or 'no kwargs'}; "
            f"reasoning format {reasoning_format.name}"
        )


def _plan_effort_problem(config: PipelineConfig, tokenizer: Any, template: str) -> str | None:
    """Why the sampling plan's reasoning efforts would not reach the prompts (None when each
    one renders a prompt of its own): a template that never reads `reasoning_effort`, or two
    efforts that render the same prompt. Every record would claim an effort it never had."""
    efforts = sorted({e.reasoning_effort for e in config.generation.sampling_plan} - {""})
    if not efforts:
        return None
    setting = f"generation.sampling_plan (reasoning_effort {', '.join(efforts)})"
    if "reasoning_effort" not in template:
        return (
            f"{setting}: the target's chat template never reads reasoning_effort, so every "
            "prompt would be the same whatever the plan says: remove reasoning_effort from "
            "the plan's entries, or use a target whose template reads it (gpt-oss)"
        )
    kwargs = config.tokenize.chat_template_kwargs
    rendered: dict[str, str] = {}
    for effort in efforts:
        try:
            text = tokenizer.apply_chat_template(
                PROBE, add_generation_prompt=True, tokenize=False,
                **{**kwargs, "reasoning_effort": effort},
            )  # fmt: skip
        except Exception as exc:
            return f"{setting}: the chat template cannot render {effort} ({first_line(exc)})"
        same = next((e for e, t in rendered.items() if t == text), None)
        if same is not None:
            return (
                f"{setting}: the chat template renders the same prompt for reasoning_effort "
                f"{same} and {effort}: keep one of them"
            )
        rendered[effort] = text
    return None


def check_lengths(config: PipelineConfig, model_config: Any, report: PreflightReport) -> None:
    from eaglet.prompt_rendering import context_length

    context = context_length(model_config)
    if context is None:
        report.warnings.append("the target's config names no context length; lengths not checked")
        return
    prompt, output = config.tokenize.max_prompt_tokens, config.generation.max_tokens
    if prompt + output > context:
        report.problems.append(
            f"tokenize.max_prompt_tokens ({prompt}) + generation.max_tokens ({output}) = "
            f"{prompt + output} exceeds the target's context of {context} tokens "
            "(max_position_embeddings): lower one of them"
        )
        return
    report.passed.append(f"max lengths {prompt} + {output} fit the context of {context}")
