"""Reasoning formats: how a target marks its thinking and its tool calls, and the split of
output token ids into parts.

The split works on token ids, never on a server's text fields, so it is the same whatever
reasoning parser a server ran (or did not run). One class per format; each returns the output
as ordered parts that concatenate back to the output ids exactly. Every part is something the
model wrote (all of it is trained); the kinds only tell reasoning, answer, tool calls and the
format's own markers apart. `detect_format` picks the format from the tokenizer and template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Hermes/Qwen tool calls: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` after the
# reasoning. Qwen tokenizers hold the tags as single tokens; others spell them in text pieces.
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# DeepSeek (V3/R1, V3.1+, V4) and Kimi-K2 write tool calls between special tokens, from their
# chat templates and tokenizer configs: a section holds one or more calls.
# DeepSeek-V3/R1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
#   ```json\nARGS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>; V3.1 and later drop the type and the
#   code fence: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>.
DEEPSEEK_TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
DEEPSEEK_TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DEEPSEEK_TOOL_CALL_END = "<｜tool▁call▁end｜>"
DEEPSEEK_TOOL_SEP = "<｜tool▁sep｜>"
# Kimi-K2: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
#   <|tool_call_argument_begin|>ARGS<|tool_call_end|><|tool_calls_section_end|>
KIMI_TOOL_CALLS_BEGIN = "<|tool_calls_section_begin|>"
KIMI_TOOL_CALLS_END = "<|tool_calls_section_end|>"
KIMI_TOOL_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_TOOL_CALL_END = "<|tool_call_end|>"
KIMI_TOOL_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
_JSON_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)

# OpenAI harmony (gpt-oss), from the harmony format guide: a message is
# `<|start|>{header}<|message|>{body}<|end|>`; the header holds the role, `<|channel|>` and the
# channel name, an optional recipient `to=...` and an optional `<|constrain|>` content type.
# The model stops with `<|return|>` after its answer and `<|call|>` after a tool call.
HARMONY_START = "<|start|>"
HARMONY_CHANNEL = "<|channel|>"
HARMONY_MESSAGE = "<|message|>"
HARMONY_END = "<|end|>"
HARMONY_RETURN = "<|return|>"
HARMONY_CALL = "<|call|>"
HARMONY_ASSISTANT_PROMPT_END = "<|start|>assistant"  # how a prompt for the assistant ends
_HARMONY_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_HARMONY_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class Part:
    """A run of output ids of one kind. `recipient` names the tool a harmony tool call is
    addressed to (its header says so, outside the part); None elsewhere."""

    kind: str
    ids: list[int]
    recipient: str | None = None


@dataclass(frozen=True)
class ReasoningSplit:
    parts: list[Part]
    reasoning_closed: bool  # the format's closing marker was seen (True where nothing to close)
    flags: list[str] = field(default_factory=list)

    def ids(self, kind: str) -> list[int]:
        return [token for part in self.parts if part.kind == kind for token in part.ids]

    def of_kind(self, kind: str) -> list[Part]:
        return [part for part in self.parts if part.kind == kind]

    def all_ids(self) -> list[int]:
        return [token for part in self.parts for token in part.ids]


def _split_end(output_ids: list[int], end_ids: set[int]) -> tuple[list[int], list[int]]:
    if output_ids and output_ids[-1] in end_ids:
        return output_ids[:-1], output_ids[-1:]
    return output_ids, []


def _parts(*pairs: tuple[str, list[int]]) -> list[Part]:
    return [Part(kind, ids) for kind, ids in pairs if ids]


def _index(ids: list[int], token: int, start: int = 0) -> int | None:
    try:
        return ids.index(token, start)
    except ValueError:
        return None


def _answer_parts(
    ids: list[int], tool_open: int | None, tool_close: int | None
) -> tuple[list[Part], list[str]]:
    """The answer as `content` and `tool_call` parts (each call with its two tags); all
    `content` when the tags are not single tokens of the tokenizer."""
    if tool_open is None or tool_close is None:
        return _parts(("content", ids)), []
    parts: list[Part] = []
    position = 0
    while (start := _index(ids, tool_open, position)) is not None:
        parts += _parts(("content", ids[position:start]))
        close = _index(ids, tool_close, start + 1)
        if close is None:
            return parts + _parts(("tool_call", ids[start:])), ["tool_call_not_closed"]
        parts.append(Part("tool_call", ids[start : close + 1]))
        position = close + 1
    return parts + _parts(("content", ids[position:])), []


def _loads_call(name: str, arguments: str) -> dict[str, Any]:
    try:
        return {"name": name, "arguments": json.loads(arguments)}
    except json.JSONDecodeError:
        return {"name": name, "unparsed": arguments}


class ToolCallSyntax:
    """Base: how a target marks tool calls in its answer with special tokens. `split` cuts
    answer ids into parts (each call a `tool_call` part, its own markers included); `parse`
    reads one call from the text of a `tool_call` part (special tokens kept)."""

    name: ClassVar[str]
    part_kinds: ClassVar[tuple[str, ...]]

    def split(self, ids: list[int]) -> tuple[list[Part], list[str]]:
        raise NotImplementedError

    def parse(self, text: str) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class HermesToolCalls(ToolCallSyntax):
    """Hermes/Qwen: `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, one per call."""

    open_id: int
    close_id: int
    name: ClassVar[str] = "hermes"
    part_kinds: ClassVar[tuple[str, ...]] = ("content", "tool_call")

    def split(self, ids: list[int]) -> tuple[list[Part], list[str]]:
        return _answer_parts(ids, self.open_id, self.close_id)

    def parse(self, text: str) -> dict[str, Any]:
        inner = text.strip().removeprefix(TOOL_CALL_OPEN).removesuffix(TOOL_CALL_CLOSE).strip()
        try:
            return json.loads(inner)
        except json.JSONDecodeError:
            return {"unparsed": inner}


@dataclass(frozen=True)
class _SectionToolCalls(ToolCallSyntax):
    """Calls inside a section: `SECTION_BEGIN (CALL_BEGIN ... CALL_END)+ SECTION_END`. The
    section markers are `tool_section` parts, each call a `tool_call` part; a call or section
    the output cuts off runs to the end and is flagged."""

    section_open_id: int
    section_close_id: int
    call_open_id: int
    call_close_id: int
    part_kinds: ClassVar[tuple[str, ...]] = ("content", "tool_section", "tool_call")

    def split(self, ids: list[int]) -> tuple[list[Part], list[str]]:
        parts: list[Part] = []
        flags: list[str] = []
        position = 0
        in_section = False
        while position < len(ids):
            token = ids[position]
            if token == self.call_open_id:
                close = _index(ids, self.call_close_id, position + 1)
                if close is None:
                    parts.append(Part("tool_call", ids[position:]))
                    return parts, [*flags, "tool_call_not_closed"]
                parts.append(Part("tool_call", ids[position : close + 1]))
                position = close + 1
                continue
            if token in (self.section_open_id, self.section_close_id):
                in_section = token == self.section_open_id
                parts.append(Part("tool_section", [token]))
                position += 1
                continue
            stop = position
            markers = (self.call_open_id, self.section_open_id, self.section_close_id)
            while stop < len(ids) and ids[stop] not in markers:
                stop += 1
            # Text between the calls of a section (DeepSeek puts a newline there) is the
            # section's; outside a section it is the answer.
            parts.append(Part("tool_section" if in_section else "content", ids[position:stop]))
            position = stop
        if in_section:
            flags.append("tool_section_not_closed")
        return _merged(parts), flags


def _merged(parts: list[Part]) -> list[Part]:
    """Adjacent answer text joined (separate tool calls and section pieces stay apart)."""
    out: list[Part] = []
    for part in parts:
        if out and part.kind == out[-1].kind == "content":
            out[-1] = Part("content", out[-1].ids + part.ids)
        else:
            out.append(part)
    return out


@dataclass(frozen=True)
class DeepSeekToolCalls(_SectionToolCalls):
    """DeepSeek-V3/R1 (`function<｜tool▁sep｜>NAME` and a ```json block) and V3.1+/V4
    (`NAME<｜tool▁sep｜>ARGS`)."""

    name: ClassVar[str] = "deepseek"

    def parse(self, text: str) -> dict[str, Any]:
        body = text.strip().removeprefix(DEEPSEEK_TOOL_CALL_BEGIN)
        body = body.removesuffix(DEEPSEEK_TOOL_CALL_END)
        head, sep, rest = body.partition(DEEPSEEK_TOOL_SEP)
        if not sep:
            return {"unparsed": body}
        if head.strip() == "function":  # V3/R1: the name, a newline, the fenced arguments
            name, _, arguments = rest.partition("\n")
            fenced = _JSON_FENCE.search(arguments)
            return _loads_call(name.strip(), fenced.group(1) if fenced else arguments.strip())
        return _loads_call(head.strip(), rest.strip())


@dataclass(frozen=True)
class KimiToolCalls(_SectionToolCalls):
    """Kimi-K2: `functions.NAME:IDX<|tool_call_argument_begin|>ARGS` in each call."""

    name: ClassVar[str] = "kimi"

    def parse(self, text: str) -> dict[str, Any]:
        body = text.strip().removeprefix(KIMI_TOOL_CALL_BEGIN).removesuffix(KIMI_TOOL_CALL_END)
        call_id, sep, arguments = body.partition(KIMI_TOOL_ARGUMENT_BEGIN)
        if not sep:
            return {"unparsed": body}
        name = call_id.strip().removeprefix("functions.").rsplit(":", 1)[0]
        return _loads_call(name, arguments.strip())


TOOL_CALL_SYNTAXES: tuple[type[ToolCallSyntax], ...] = (
    HermesToolCalls,
    DeepSeekToolCalls,
    KimiToolCalls,
)


class ReasoningFormat:
    """Base: a format names itself and splits output ids into parts."""

    name: ClassVar[str]
    reasons: ClassVar[bool] = True  # whether records are expected to carry reasoning
    part_kinds: ClassVar[tuple[str, ...]]  # every kind `split` may return
    # How the texts of several parts of one kind join (harmony writes one message per part).
    part_separator: ClassVar[str] = ""

    def split(self, output_ids: list[int], end_ids: set[int]) -> ReasoningSplit:
        raise NotImplementedError

    def tool_syntax(self) -> ToolCallSyntax | None:
        """How this target's answers mark tool calls in special tokens (None: not at all, or
        in a form the split does not read from ids)."""
        tool_calls = getattr(self, "tool_calls", None)
        if tool_calls is not None:
            return tool_calls
        open_id = getattr(self, "tool_call_open_id", None)
        close_id = getattr(self, "tool_call_close_id", None)
        if open_id is None or close_id is None:
            return None
        return HermesToolCalls(open_id, close_id)

    def _answer(self, ids: list[int]) -> tuple[list[Part], list[str]]:
        syntax = self.tool_syntax()
        return syntax.split(ids) if syntax is not None else (_parts(("content", ids)), [])


@dataclass(frozen=True)
class _ThinkTags(ReasoningFormat):
    """The token ids the `<think>` formats split on."""

    open_id: int
    close_id: int
    tool_call_open_id: int | None = None
    tool_call_close_id: int | None = None
    tool_calls: ToolCallSyntax | None = None  # a special-token syntax (DeepSeek, Kimi-K2)


@dataclass(frozen=True)
class ThinkOpenInPrompt(_ThinkTags):
    """Qwen3-thinking, DeepSeek-R1/V3.1+, Kimi-K2: `<think>` ends the prompt; the model writes
    `reasoning </think> answer [<tool_call>...</tool_call>] <end>`."""

    name: ClassVar[str] = "think_open_in_prompt"
    part_kinds: ClassVar[tuple[str, ...]] = (
        "reasoning",
        "think_close",
        "content",
        "tool_section",
        "tool_call",
        "end",
    )

    def split(self, output_ids: list[int], end_ids: set[int]) -> ReasoningSplit:
        body, end = _split_end(output_ids, end_ids)
        cut = _index(body, self.close_id)
        if cut is None:
            return ReasoningSplit(_parts(("reasoning", body), ("end", end)), False)
        answer, flags = self._answer(body[cut + 1 :])
        parts = [
            *_parts(("reasoning", body[:cut]), ("think_close", body[cut : cut + 1])),
            *answer,
            *_parts(("end", end)),
        ]
        return ReasoningSplit(parts, True, flags)


@dataclass(frozen=True)
class ThinkInOutput(_ThinkTags):
    """Qwen3 hybrid: the model itself writes `<think> reasoning </think> answer <end>`; a
    turn without the opening tag has no reasoning (thinking switched off)."""

    name: ClassVar[str] = "think_in_output"
    part_kinds: ClassVar[tuple[str, ...]] = (
        "think_open",
        "reasoning",
        "think_close",
        "content",
        "tool_section",
        "tool_call",
        "end",
    )

    def split(self, output_ids: list[int], end_ids: set[int]) -> ReasoningSplit:
        body, end = _split_end(output_ids, end_ids)
        if self.open_id not in body[:4]:
            answer, flags = self._answer(body)
            return ReasoningSplit([*answer, *_parts(("end", end))], True, ["no_think", *flags])
        start = body.index(self.open_id)
        lead, rest = body[: start + 1], body[start + 1 :]
        cut = _index(rest, self.close_id)
        if cut is None:
            return ReasoningSplit(
                _parts(("think_open", lead), ("reasoning", rest), ("end", end)), False
            )
        answer, flags = self._answer(rest[cut + 1 :])
        parts = [
            *_parts(
                ("think_open", lead),
                ("reasoning", rest[:cut]),
                ("think_close", rest[cut : cut + 1]),
            ),
            *answer,
            *_parts(("end", end)),
        ]
        return ReasoningSplit(parts, True, flags)


@dataclass(frozen=True)
class NoReasoning(ReasoningFormat):
    """Models without a thinking phase: the whole output is the answer (and its tool calls)."""

    tool_call_open_id: int | None = None
    tool_call_close_id: int | None = None
    tool_calls: ToolCallSyntax | None = None
    name: ClassVar[str] = "none"
    reasons: ClassVar[bool] = False
    part_kinds: ClassVar[tuple[str, ...]] = ("content", "tool_section", "tool_call", "end")

    def split(self, output_ids: list[int], end_ids: set[int]) -> ReasoningSplit:
        body, end = _split_end(output_ids, end_ids)
        answer, flags = self._answer(body)
        return ReasoningSplit([*answer, *_parts(("end", end))], True, flags)


@dataclass(frozen=True)
class Harmony(ReasoningFormat):
    """gpt-oss (OpenAI harmony): the prompt ends with `<|start|>assistant`; the model writes
    messages `<|channel|>analysis<|message|>...<|end|>`, each later one opened by
    `<|start|>assistant`, and stops with `<|return|>` (answer) or `<|call|>` (tool call).

    Parts: each message's `header` (from its first token through `<|message|>`), its body, and
    its `message_end` (`<|end|>`, or `<|return|>`/`<|call|>` when they are not end ids); a body
    that runs into `<|start|>`, `<|channel|>` or `<|message|>` ends there, unended, flagged. A body
    on the `analysis` channel is `reasoning` (built-in tool calls there too, as vLLM reports
    them); one addressed to a recipient (`to=functions.get_weather`, in the header) is a
    `tool_call`; `final` and `commentary` without a recipient (a preamble) are `content`.
    `decode` turns header ids into text to read the channel and recipient."""

    start_id: int
    channel_id: int
    message_id: int
    end_id: int
    return_id: int
    call_id: int
    decode: Callable[[list[int]], str] = field(compare=False, repr=False)
    name: ClassVar[str] = "harmony"
    part_kinds: ClassVar[tuple[str, ...]] = (
        "header",
        "reasoning",
        "content",
        "tool_call",
        "message_end",
        "end",
    )
    part_separator: ClassVar[str] = "\n"  # messages of one channel, joined as vLLM joins them

    def _read_header(self, header: list[int]) -> tuple[str | None, str | None]:
        """(channel, recipient) of a header, None where it does not say."""
        text = self.decode(header)
        channel = _HARMONY_CHANNEL_NAME.search(text)
        recipient = _HARMONY_RECIPIENT.search(text)
        return (
            channel.group(1) if channel else None,
            recipient.group(1) if recipient else None,
        )

    def _body_kind(self, header: list[int]) -> tuple[str, str | None, bool]:
        """(part kind of the message body, recipient of a tool call, channel known)."""
        channel, recipient = self._read_header(header)
        if channel == "analysis":
            return "reasoning", None, True
        if recipient is not None:
            return "tool_call", recipient, True
        return "content", None, channel in ("final", "commentary")

    def split(self, output_ids: list[int], end_ids: set[int]) -> ReasoningSplit:
        body, end = _split_end(output_ids, end_ids)
        stops = {self.end_id, self.return_id, self.call_id}
        header_stops = stops | {self.message_id}
        # A message the model did not end: the next header starts where it opens.
        body_stops = stops | {self.start_id, self.channel_id, self.message_id}
        parts: list[Part] = []
        flags: list[str] = []
        reasoning_closed = True
        position = 0
        while position < len(body):
            header_end = position
            while header_end < len(body) and body[header_end] not in header_stops:
                header_end += 1
            if header_end == len(body):  # the output stops inside a header
                channel, _ = self._read_header(body[position:])
                parts.append(Part("header", body[position:]))
                reasoning_closed = channel != "analysis"
                break
            if body[header_end] != self.message_id:  # a header without <|message|>
                flags.append("harmony_header_without_message")
                parts += _parts(
                    ("header", body[position:header_end]),
                    ("message_end", body[header_end : header_end + 1]),
                )
                position = header_end + 1
                continue
            header = body[position : header_end + 1]
            kind, recipient, known_channel = self._body_kind(header)
            if not known_channel:
                flags.append("harmony_unknown_channel")
            stop = header_end + 1
            while stop < len(body) and body[stop] not in body_stops:
                stop += 1
            parts.append(Part("header", header))
            if stop > header_end + 1:
                parts.append(Part(kind, body[header_end + 1 : stop], recipient))
            if stop == len(body):  # ends unterminated, or terminated by the end token
                reasoning_closed = kind != "reasoning" or bool(end)
                break
            if body[stop] not in stops:
                flags.append("harmony_message_not_ended")
                position = stop
                continue
            parts.append(Part("message_end", body[stop : stop + 1]))
            position = stop + 1
        return ReasoningSplit([*parts, *_parts(("end", end))], reasoning_closed, sorted(set(flags)))


FORMATS: tuple[type[ReasoningFormat], ...] = (
    ThinkOpenInPrompt,
    ThinkInOutput,
    NoReasoning,
    Harmony,
)


def _single_token_id(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def special_tool_syntax(tokenizer) -> ToolCallSyntax | None:
    """DeepSeek's or Kimi-K2's tool-call syntax when its four markers are single tokens of
    the tokenizer; None otherwise (Hermes `<tool_call>` tags are read by the formats)."""
    candidates: tuple[tuple[type[_SectionToolCalls], tuple[str, ...]], ...] = (
        (
            DeepSeekToolCalls,
            (
                DEEPSEEK_TOOL_CALLS_BEGIN,
                DEEPSEEK_TOOL_CALLS_END,
                DEEPSEEK_TOOL_CALL_BEGIN,
                DEEPSEEK_TOOL_CALL_END,
            ),
        ),
        (
            KimiToolCalls,
            (KIMI_TOOL_CALLS_BEGIN, KIMI_TOOL_CALLS_END, KIMI_TOOL_CALL_BEGIN, KIMI_TOOL_CALL_END),
        ),
    )
    for cls, markers in candidates:
        ids = [_single_token_id(tokenizer, marker) for marker in markers]
        if all(i is not None for i in ids):
            return cls(*ids)
    return None


def _harmony_format(tokenizer) -> Harmony | None:
    """The harmony format when all its markers are single tokens of the tokenizer."""
    markers = (HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE, HARMONY_END)
    stops = (HARMONY_RETURN, HARMONY_CALL)
    ids = {text: _single_token_id(tokenizer, text) for text in markers + stops}
    if any(i is None for i in ids.values()):
        return None
    return Harmony(
        start_id=ids[HARMONY_START],
        channel_id=ids[HARMONY_CHANNEL],
        message_id=ids[HARMONY_MESSAGE],
        end_id=ids[HARMONY_END],
        return_id=ids[HARMONY_RETURN],
        call_id=ids[HARMONY_CALL],
        decode=lambda header: tokenizer.decode(header, skip_special_tokens=False),
    )


def detect_format(
    tokenizer, requested: str = "auto", chat_template_kwargs: dict[str, Any] | None = None
) -> ReasoningFormat:
    """The format named in the config, or the one the tokenizer and chat template imply."""
    open_id = _single_token_id(tokenizer, THINK_OPEN)
    close_id = _single_token_id(tokenizer, THINK_CLOSE)
    tools = (
        _single_token_id(tokenizer, TOOL_CALL_OPEN),
        _single_token_id(tokenizer, TOOL_CALL_CLOSE),
    )
    special = special_tool_syntax(tokenizer)
    has_tags = open_id is not None and close_id is not None
    if requested == "none":
        return NoReasoning(*tools, tool_calls=special)
    if requested == "harmony":
        harmony = _harmony_format(tokenizer)
        if harmony is None:
            raise ValueError(
                "reasoning.format=harmony needs <|start|>, <|channel|>, <|message|>, <|end|>, "
                "<|return|> and <|call|> to be single tokens of the target's tokenizer; "
                "they are not"
            )
        return harmony
    if requested in ("think_open_in_prompt", "think_in_output") and not has_tags:
        raise ValueError(
            f"reasoning.format={requested} needs {THINK_OPEN} and {THINK_CLOSE} to be single "
            "tokens of the target's tokenizer; they are not"
        )
    if requested == "think_open_in_prompt":
        return ThinkOpenInPrompt(open_id, close_id, *tools, tool_calls=special)
    if requested == "think_in_output":
        return ThinkInOutput(open_id, close_id, *tools, tool_calls=special)
    harmony = _harmony_format(tokenizer)
    if not has_tags and harmony is None:
        return NoReasoning(*tools, tool_calls=special)
    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=False,
        **(chat_template_kwargs or {}),
    ).rstrip()
    if harmony is not None and probe.endswith(HARMONY_ASSISTANT_PROMPT_END):
        return harmony
    if not has_tags:
        return NoReasoning(*tools, tool_calls=special)
    if probe.endswith(THINK_OPEN):
        return ThinkOpenInPrompt(open_id, close_id, *tools, tool_calls=special)
    if probe.endswith(THINK_CLOSE):  # thinking switched off: an empty block injected
        return NoReasoning(*tools, tool_calls=special)
    return ThinkInOutput(open_id, close_id, *tools, tool_calls=special)
