"""Reasoning formats split output token ids into parts that rebuild the output exactly."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eaglet.reasoning import (
    FORMATS,
    TOOL_CALL_SYNTAXES,
    DeepSeekToolCalls,
    Harmony,
    HermesToolCalls,
    KimiToolCalls,
    NoReasoning,
    ReasoningFormat,
    ThinkInOutput,
    ThinkOpenInPrompt,
    detect_format,
)

OPEN, CLOSE, END = 5, 6, 7
TOOL_OPEN, TOOL_CLOSE = 8, 9
SECTION_OPEN, SECTION_CLOSE = 10, 11  # DeepSeek/Kimi: calls (8 ... 9) inside a section
DEEPSEEK = DeepSeekToolCalls(SECTION_OPEN, SECTION_CLOSE, TOOL_OPEN, TOOL_CLOSE)
KIMI = KimiToolCalls(SECTION_OPEN, SECTION_CLOSE, TOOL_OPEN, TOOL_CLOSE)
END_IDS = {END}
token_lists = st.lists(st.integers(min_value=0, max_value=12), max_size=60)

# A stand-in harmony vocabulary: marker ids and the header words they decode to.
H_START, H_CHANNEL, H_MESSAGE, H_END, H_RETURN, H_CALL, H_CONSTRAIN = range(20, 27)
ASSISTANT, ANALYSIS, FINAL, COMMENTARY, TO_WEATHER, JSON = range(30, 36)
HARMONY_TEXT = {
    H_START: "<|start|>",
    H_CHANNEL: "<|channel|>",
    H_MESSAGE: "<|message|>",
    H_END: "<|end|>",
    H_RETURN: "<|return|>",
    H_CALL: "<|call|>",
    H_CONSTRAIN: "<|constrain|>",
    ASSISTANT: "assistant",
    ANALYSIS: "analysis",
    FINAL: "final",
    COMMENTARY: "commentary",
    TO_WEATHER: " to=functions.get_weather ",
    JSON: "json",
}
HARMONY = Harmony(
    start_id=H_START,
    channel_id=H_CHANNEL,
    message_id=H_MESSAGE,
    end_id=H_END,
    return_id=H_RETURN,
    call_id=H_CALL,
    decode=lambda ids: "".join(HARMONY_TEXT.get(i, f"w{i}") for i in ids),
)
HARMONY_END_IDS = {H_RETURN, H_CALL}
harmony_lists = st.lists(
    st.one_of(st.sampled_from(sorted(HARMONY_TEXT)), st.integers(min_value=0, max_value=12)),
    max_size=60,
)

EVERY_FORMAT = (
    ThinkOpenInPrompt(OPEN, CLOSE),
    ThinkOpenInPrompt(OPEN, CLOSE, TOOL_OPEN, TOOL_CLOSE),
    ThinkInOutput(OPEN, CLOSE),
    ThinkInOutput(OPEN, CLOSE, TOOL_OPEN, TOOL_CLOSE),
    NoReasoning(),
    NoReasoning(TOOL_OPEN, TOOL_CLOSE),
    ThinkOpenInPrompt(OPEN, CLOSE, tool_calls=DEEPSEEK),
    ThinkInOutput(OPEN, CLOSE, tool_calls=KIMI),
    NoReasoning(tool_calls=DEEPSEEK),
    ThinkOpenInPrompt(OPEN, CLOSE, tool_calls=KIMI),
)


def test_every_format_class_is_covered_by_the_property_tests():
    covered = {type(f) for f in EVERY_FORMAT} | {Harmony}

    def concrete(cls):  # every format class, below private shared bases too
        for sub in cls.__subclasses__():
            yield from concrete(sub)
            if not sub.__name__.startswith("_"):
                yield sub

    assert covered == set(FORMATS) == set(concrete(ReasoningFormat))
    syntaxes = {type(f.tool_syntax()) for f in EVERY_FORMAT if f.tool_syntax() is not None}
    assert (
        syntaxes == set(TOOL_CALL_SYNTAXES) == {HermesToolCalls, DeepSeekToolCalls, KimiToolCalls}
    )


@given(token_lists)
def test_every_format_splits_into_parts_that_concatenate_back(output_ids):
    for reasoning_format in EVERY_FORMAT:
        split = reasoning_format.split(output_ids, END_IDS)
        assert split.all_ids() == output_ids
        assert {part.kind for part in split.parts} <= set(reasoning_format.part_kinds)
        assert all(part.ids for part in split.parts)
        syntax = reasoning_format.tool_syntax()
        if syntax is not None:
            assert {p.kind for p in split.parts} - {
                "reasoning",
                "think_open",
                "think_close",
                "end",
            } <= set(syntax.part_kinds)
            for part in split.of_kind("tool_call"):  # a call starts with its own marker
                assert part.ids[0] == TOOL_OPEN


@given(harmony_lists, st.sampled_from([HARMONY_END_IDS, set()]))
def test_harmony_splits_into_parts_that_concatenate_back(output_ids, end_ids):
    split = HARMONY.split(output_ids, end_ids)
    assert split.all_ids() == output_ids
    assert {part.kind for part in split.parts} <= set(Harmony.part_kinds)
    assert all(part.ids for part in split.parts)
    # Markers never leak into reasoning, answer or tool-call bodies.
    markers = {H_START, H_CHANNEL, H_MESSAGE, H_END, H_RETURN, H_CALL}
    for part in split.parts:
        if part.kind in ("reasoning", "content", "tool_call"):
            assert not markers & set(part.ids), part


def test_open_in_prompt_splits_at_the_closing_tag():
    output = [10, 11, CLOSE, 12, 13, END]
    split = ThinkOpenInPrompt(OPEN, CLOSE).split(output, END_IDS)
    assert split.ids("reasoning") == [10, 11]
    assert split.ids("think_close") == [CLOSE]
    assert split.ids("content") == [12, 13]
    assert split.ids("end") == [END]
    assert split.reasoning_closed


def test_open_in_prompt_without_closing_tag_is_all_reasoning_and_not_closed():
    split = ThinkOpenInPrompt(OPEN, CLOSE).split([10, 11, 12], END_IDS)
    assert split.ids("reasoning") == [10, 11, 12]
    assert split.ids("content") == []
    assert not split.reasoning_closed


def test_think_in_output_needs_the_opening_tag_for_reasoning():
    fmt = ThinkInOutput(OPEN, CLOSE)
    with_thinking = fmt.split([OPEN, 10, CLOSE, 12, END], END_IDS)
    assert with_thinking.ids("reasoning") == [10]
    assert with_thinking.ids("content") == [12]
    without = fmt.split([12, 13, END], END_IDS)
    assert without.ids("reasoning") == []
    assert without.ids("content") == [12, 13]
    assert "no_think" in without.flags


def test_only_the_first_closing_tag_ends_reasoning():
    split = ThinkOpenInPrompt(OPEN, CLOSE).split([10, CLOSE, 12, CLOSE, END], END_IDS)
    assert split.ids("reasoning") == [10]
    assert split.ids("content") == [12, CLOSE]


def test_tool_calls_after_the_reasoning_are_their_own_parts_tags_included():
    output = [10, CLOSE, 12, TOOL_OPEN, 1, 2, TOOL_CLOSE, 3, TOOL_OPEN, 4, TOOL_CLOSE, END]
    split = ThinkOpenInPrompt(OPEN, CLOSE, TOOL_OPEN, TOOL_CLOSE).split(output, END_IDS)
    assert [(p.kind, p.ids) for p in split.parts] == [
        ("reasoning", [10]),
        ("think_close", [CLOSE]),
        ("content", [12]),
        ("tool_call", [TOOL_OPEN, 1, 2, TOOL_CLOSE]),
        ("content", [3]),
        ("tool_call", [TOOL_OPEN, 4, TOOL_CLOSE]),
        ("end", [END]),
    ]
    assert split.flags == []


def test_tool_call_tags_that_are_not_single_tokens_leave_the_answer_whole():
    output = [10, CLOSE, 12, TOOL_OPEN, 1, TOOL_CLOSE, END]
    split = ThinkOpenInPrompt(OPEN, CLOSE).split(output, END_IDS)
    assert split.ids("content") == [12, TOOL_OPEN, 1, TOOL_CLOSE]
    assert split.ids("tool_call") == []


def test_a_truncated_tool_call_runs_to_the_end_and_is_flagged():
    split = ThinkInOutput(OPEN, CLOSE, TOOL_OPEN, TOOL_CLOSE).split(
        [OPEN, 10, CLOSE, TOOL_OPEN, 1, 2], END_IDS
    )
    assert split.ids("tool_call") == [TOOL_OPEN, 1, 2]
    assert split.flags == ["tool_call_not_closed"]


def test_harmony_analysis_then_final_splits_headers_from_reasoning_and_answer():
    output = [
        *(H_CHANNEL, ANALYSIS, H_MESSAGE), 10, 11, H_END,
        *(H_START, ASSISTANT, H_CHANNEL, FINAL, H_MESSAGE), 12, H_RETURN,
    ]  # fmt: skip
    split = HARMONY.split(output, HARMONY_END_IDS)
    assert [(p.kind, p.ids) for p in split.parts] == [
        ("header", [H_CHANNEL, ANALYSIS, H_MESSAGE]),
        ("reasoning", [10, 11]),
        ("message_end", [H_END]),
        ("header", [H_START, ASSISTANT, H_CHANNEL, FINAL, H_MESSAGE]),
        ("content", [12]),
        ("end", [H_RETURN]),
    ]
    assert split.reasoning_closed and split.flags == []


def test_harmony_commentary_to_a_function_is_a_tool_call_naming_its_recipient():
    output = [
        *(H_CHANNEL, ANALYSIS, H_MESSAGE), 10, H_END,
        *(H_START, ASSISTANT, H_CHANNEL, COMMENTARY, TO_WEATHER, H_CONSTRAIN, JSON, H_MESSAGE),
        1, 2, H_CALL,
    ]  # fmt: skip
    split = HARMONY.split(output, HARMONY_END_IDS)
    (call,) = split.of_kind("tool_call")
    assert call.ids == [1, 2] and call.recipient == "functions.get_weather"
    assert split.ids("end") == [H_CALL]
    assert split.ids("content") == []


def test_harmony_recipient_in_the_role_part_of_the_header_is_read_too():
    # As the gpt-oss chat template renders calls: `<|start|>assistant to=functions.x<|channel|>`.
    output = [H_START, ASSISTANT, TO_WEATHER, H_CHANNEL, COMMENTARY, JSON, H_MESSAGE, 1, H_CALL]
    (call,) = HARMONY.split(output, HARMONY_END_IDS).of_kind("tool_call")
    assert call.recipient == "functions.get_weather"


def test_harmony_commentary_without_recipient_is_a_preamble_in_the_answer():
    output = [H_CHANNEL, COMMENTARY, H_MESSAGE, 12, H_END]
    split = HARMONY.split(output, HARMONY_END_IDS)
    assert split.ids("content") == [12]
    assert split.ids("message_end") == [H_END]


def test_harmony_stopping_inside_the_analysis_leaves_reasoning_not_closed():
    assert not HARMONY.split([H_CHANNEL, ANALYSIS, H_MESSAGE, 10], HARMONY_END_IDS).reasoning_closed
    assert not HARMONY.split([H_CHANNEL, ANALYSIS], HARMONY_END_IDS).reasoning_closed
    truncated_answer = [H_CHANNEL, ANALYSIS, H_MESSAGE, 10, H_END, H_START, ASSISTANT]
    truncated_answer += [H_CHANNEL, FINAL, H_MESSAGE, 12]
    assert HARMONY.split(truncated_answer, HARMONY_END_IDS).reasoning_closed


def test_harmony_message_running_into_a_new_header_ends_there_and_is_flagged():
    output = [H_CHANNEL, ANALYSIS, H_MESSAGE, 10, H_START, ASSISTANT, H_CHANNEL, FINAL, H_MESSAGE]
    split = HARMONY.split([*output, 12, H_RETURN], HARMONY_END_IDS)
    assert [p.kind for p in split.parts] == ["header", "reasoning", "header", "content", "end"]
    assert split.ids("reasoning") == [10]
    assert split.flags == ["harmony_message_not_ended"]


def test_harmony_without_return_among_end_ids_ends_the_last_message_itself():
    output = [H_CHANNEL, FINAL, H_MESSAGE, 12, H_RETURN]
    split = HARMONY.split(output, set())
    assert split.ids("message_end") == [H_RETURN] and split.ids("end") == []


class _VocabTokenizer:
    """Encodes only whole vocabulary strings; enough for `detect_format`'s probes."""

    def __init__(self, vocab: dict[str, int], prompt_end: str) -> None:
        self.vocab, self.prompt_end = vocab, prompt_end

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.vocab[text]] if text in self.vocab else [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs) -> str:
        return f"<|start|>user<|message|>hi<|end|>{self.prompt_end}"


HARMONY_VOCAB = {text: 200000 + i for i, text in enumerate(HARMONY_TEXT.values())}


def test_detect_format_finds_harmony_from_its_tokens_and_prompt_end():
    found = detect_format(_VocabTokenizer(HARMONY_VOCAB, "<|start|>assistant"))
    assert isinstance(found, Harmony)
    assert found.message_id == HARMONY_VOCAB["<|message|>"]
    assert found.return_id == HARMONY_VOCAB["<|return|>"]


def test_detect_format_refuses_harmony_when_its_markers_are_not_single_tokens():
    with pytest.raises(ValueError, match="harmony"):
        detect_format(_VocabTokenizer({}, ""), "harmony")


def test_deepseek_and_kimi_calls_are_parts_inside_their_section_markers():
    # reasoning </think> text <section> <call> a b </call> <call> c </call> </section> <end>
    output = [1, CLOSE, 2, SECTION_OPEN, TOOL_OPEN, 3, 4, TOOL_CLOSE, TOOL_OPEN, 12, TOOL_CLOSE]
    output += [SECTION_CLOSE, END]
    for syntax in (DEEPSEEK, KIMI):
        split = ThinkOpenInPrompt(OPEN, CLOSE, tool_calls=syntax).split(output, END_IDS)
        assert [(p.kind, p.ids) for p in split.parts] == [
            ("reasoning", [1]),
            ("think_close", [CLOSE]),
            ("content", [2]),
            ("tool_section", [SECTION_OPEN]),
            ("tool_call", [TOOL_OPEN, 3, 4, TOOL_CLOSE]),
            ("tool_call", [TOOL_OPEN, 12, TOOL_CLOSE]),
            ("tool_section", [SECTION_CLOSE]),
            ("end", [END]),
        ]
        assert split.flags == []


def test_a_cut_off_section_call_runs_to_the_end_and_is_flagged():
    split = NoReasoning(tool_calls=KIMI).split([SECTION_OPEN, TOOL_OPEN, 3, 4], END_IDS)
    assert split.of_kind("tool_call")[0].ids == [TOOL_OPEN, 3, 4]
    assert "tool_call_not_closed" in split.flags
    split = NoReasoning(tool_calls=KIMI).split([SECTION_OPEN, TOOL_OPEN, 3, TOOL_CLOSE], END_IDS)
    assert split.flags == ["tool_section_not_closed"]


def test_deepseek_call_texts_parse_in_both_generations_of_the_format():
    v3 = (
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris"}\n```<｜tool▁call▁end｜>'
    )
    v31 = '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
    expected = {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert DEEPSEEK.parse(v3) == expected and DEEPSEEK.parse(v31) == expected
    bad = "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{not json<｜tool▁call▁end｜>"
    assert DEEPSEEK.parse(bad) == {"name": "f", "unparsed": "{not json"}


def test_kimi_call_text_parses_name_and_arguments():
    text = (
        "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|>'
    )
    assert KIMI.parse(text) == {"name": "get_weather", "arguments": {"city": "Paris"}}
