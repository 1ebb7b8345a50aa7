"""Reasoning formats split output token ids into parts that rebuild the output exactly."""

from hypothesis import given
from hypothesis import strategies as st

from eaglet.reasoning import NoReasoning, ThinkInOutput, ThinkOpenInPrompt

OPEN, CLOSE, END = 5, 6, 7
END_IDS = {END}
token_lists = st.lists(st.integers(min_value=0, max_value=12), max_size=60)


@given(token_lists)
def test_every_format_splits_into_parts_that_concatenate_back(output_ids):
    for reasoning_format in (
        ThinkOpenInPrompt(OPEN, CLOSE),
        ThinkInOutput(OPEN, CLOSE),
        NoReasoning(),
    ):
        split = reasoning_format.split(output_ids, END_IDS)
        assert split.all_ids() == output_ids


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
