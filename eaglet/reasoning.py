"""Reasoning formats: how a target marks its thinking, and the split of output token ids.

The split works on token ids, never on a server's text fields, so it is the same whatever
reasoning parser a server ran (or did not run). One class per format; each returns the output
as ordered parts that concatenate back to the output ids exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class Part:
    kind: str  # "think_open" | "reasoning" | "think_close" | "content" | "end"
    ids: list[int]


@dataclass(frozen=True)
class ReasoningSplit:
    parts: list[Part]
    reasoning_closed: bool  # the format's closing marker was seen (True where nothing to close)
    flags: list[str] = field(default_factory=list)

    def ids(self, kind: str) -> list[int]:
        return [token for part in self.parts if part.kind == kind for token in part.ids]

    def all_ids(self) -> list[int]:
        return [token for part in self.parts for token in part.ids]


def _split_end(output_ids: list[int], end_ids: set[int]) -> tuple[list[int], list[int]]:
    if output_ids and output_ids[-1] in end_ids:
        return output_ids[:-1], output_ids[-1:]
    return output_ids, []


def _parts(*pairs: tuple[str, list[int]]) -> list[Part]:
    return [Part(kind, ids) for kind, ids in pairs if ids]


class ReasoningFormat:
    """Base: a format names itself and splits output ids into parts."""

    name: ClassVar[str]
    reasons: ClassVar[bool] = True  # whether records are expected to carry reasoning

    def split(self, output_ids: list[int], end_ids: set[int]) -> ReasoningSplit:
        raise NotImplementedError


@dataclass(frozen=True)
class ThinkOpenInPrompt(ReasoningFormat):
    """Qwen3-thinking, DeepSeek-R1, Kimi-K2: `<think>` ends the prompt; the model writes
    `reasoning </think> answer <end>`."""

    open_id: int
    close_id: int
    name: ClassVar[str] = "think_open_in_prompt"

    def split(self, output_ids: list[int], end_ids: set[int]) -> ReasoningSplit:
        body, end = _split_end(output_ids, end_ids)
        if self.close_id not in body:
            return ReasoningSplit(_parts(("reasoning", body), ("end", end)), False)
        cut = body.index(self.close_id)
        parts = _parts(
            ("reasoning", body[:cut]),
            ("think_close", body[cut : cut + 1]),
            ("content", body[cut + 1 :]),
            ("end", end),
        )
        return ReasoningSplit(parts, True)


@dataclass(frozen=True)
class ThinkInOutput(ReasoningFormat):
    """Qwen3 hybrid: the model itself writes `<think> reasoning </think> answer <end>`; a
    turn without the opening tag has no reasoning (thinking switched off)."""

    open_id: int
    close_id: int
    name: ClassVar[str] = "think_in_output"

    def split(self, output_ids: list[int], end_ids: set[int]) -> ReasoningSplit:
        body, end = _split_end(output_ids, end_ids)
        if self.open_id not in body[:4]:
            return ReasoningSplit(_parts(("content", body), ("end", end)), True, ["no_think"])
        start = body.index(self.open_id)
        lead, rest = body[: start + 1], body[start + 1 :]
        if self.close_id not in rest:
            return ReasoningSplit(
                _parts(("think_open", lead), ("reasoning", rest), ("end", end)), False
            )
        cut = rest.index(self.close_id)
        parts = _parts(
            ("think_open", lead),
            ("reasoning", rest[:cut]),
            ("think_close", rest[cut : cut + 1]),
            ("content", rest[cut + 1 :]),
            ("end", end),
        )
        return ReasoningSplit(parts, True)


@dataclass(frozen=True)
class NoReasoning(ReasoningFormat):
    """Models without a thinking phase: the whole output is the answer."""

    name: ClassVar[str] = "none"
    reasons: ClassVar[bool] = False

    def split(self, output_ids: list[int], end_ids: set[int]) -> ReasoningSplit:
        body, end = _split_end(output_ids, end_ids)
        return ReasoningSplit(_parts(("content", body), ("end", end)), True)


def _single_token_id(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def detect_format(
    tokenizer, requested: str = "auto", chat_template_kwargs: dict[str, Any] | None = None
) -> ReasoningFormat:
    """The format named in the config, or the one the tokenizer and chat template imply."""
    open_id = _single_token_id(tokenizer, THINK_OPEN)
    close_id = _single_token_id(tokenizer, THINK_CLOSE)
    has_tags = open_id is not None and close_id is not None
    if requested == "none":
        return NoReasoning()
    if requested in ("think_open_in_prompt", "think_in_output") and not has_tags:
        raise ValueError(
            f"reasoning.format={requested} needs {THINK_OPEN} and {THINK_CLOSE} to be single "
            "tokens of the target's tokenizer; they are not"
        )
    if requested == "think_open_in_prompt":
        return ThinkOpenInPrompt(open_id, close_id)
    if requested == "think_in_output":
        return ThinkInOutput(open_id, close_id)
    if not has_tags:
        return NoReasoning()
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=False,
        **(chat_template_kwargs or {}),
    )
    if probe.rstrip().endswith(THINK_OPEN):
        return ThinkOpenInPrompt(open_id, close_id)
    if probe.rstrip().endswith(THINK_CLOSE):  # thinking switched off: an empty block injected
        return NoReasoning()
    return ThinkInOutput(open_id, close_id)
