"""The openai engine: any OpenAI-compatible `POST /v1/chat/completions`.

The server renders the chat template itself from the Prompt's `messages` and `tools`. The
request also asks for `"return_token_ids": true`: a server that honours it (vLLM) gives the
exact output ids, and the record is token-exact. Otherwise the output is rebuilt from the
server's text — `message.reasoning` or `message.reasoning_content` (servers use either name),
or think tags left inline in `content` when the server ran no reasoning parser — in the
target's raw format (`{reasoning}\\n</think>\\n\\n{content}<end>` when the prompt ends with
`<think>`), re-tokenized with the target's tokenizer, and flagged `token_exact=False`.

The server's text fields (`content`, `reasoning`, `reasoning_content`, `tool_calls`) are kept
in `raw`, so extraction can cross-check them against the token split.

With `generation.loop_guard` (the default) the answer streams: the events' deltas (text fields,
tool-call pieces by index, `token_ids` where the server sends them) are folded into the body an
unstreamed answer has and read by the same `parse`; the loop guard reads each event's ids (or,
from a server that sends none, its text tokenized) and can end a repeating answer.

Construction: `OpenAIChatEngine(config: PipelineConfig, tokenizer, *, end_ids=None,
http_library=None)`; the tokenizer is required (re-tokenizing, reasoning format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from eaglet.engines.http import (
    HTTPEngine,
    MalformedResponse,
    RetryableResponse,
    int_list,
    prompt_ids_check,
    streamed_choice,
)
from eaglet.loop_guard import LoopDetector
from eaglet.reasoning import (
    HARMONY_CHANNEL,
    HARMONY_END,
    HARMONY_MESSAGE,
    HARMONY_START,
    THINK_CLOSE,
    THINK_OPEN,
    Harmony,
    NoReasoning,
    ReasoningFormat,
    ThinkInOutput,
    detect_format,
)
from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt
from eaglet.sampling_plan import template_kwargs

TEXT_FIELDS = ("content", "reasoning", "reasoning_content", "tool_calls")
FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop"}


def tool_calls_text(tool_calls: Any) -> str:
    """Parsed tool calls back in the Hermes/Qwen `<tool_call>` form the template writes."""
    blocks = []
    for call in tool_calls or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        name = function.get("name", "")
        blocks.append(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>')
    return "\n".join(blocks)


def _wire_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if isinstance(function, dict) and not isinstance(function.get("arguments", ""), str):
        arguments = json.dumps(function["arguments"], ensure_ascii=False)
        return {**call, "function": {**function, "arguments": arguments}}
    return call


def wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the OpenAI schema wants them: tool-call arguments as JSON strings (dataset
    rows often hold dicts; `json.dumps` writes what a template's `tojson` would)."""
    return [
        {**m, "tool_calls": [_wire_tool_call(c) for c in m["tool_calls"]]}
        if m.get("tool_calls")
        else m
        for m in messages
    ]


def _harmony_output_text(reasoning: str, content: str, tool_calls: Any, finished: bool) -> str:
    """gpt-oss's raw output in harmony (the prompt already ends with `<|start|>assistant`):
    an `analysis` message with the reasoning, then either one `commentary` message per tool
    call (`to=functions.NAME <|constrain|>json`) or the `final` answer; messages end with
    `<|end|>` and the next opens with `<|start|>assistant`. The last one is left open: the end
    token the model stopped on (`<|return|>` or `<|call|>`) is added by the caller. A cut-off
    answer (not finished, no content) ends inside its analysis message."""
    messages = []
    if reasoning:
        messages.append(f"{HARMONY_CHANNEL}analysis{HARMONY_MESSAGE}{reasoning}")
    calls = []
    for call in tool_calls or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        arguments = function.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            f"{HARMONY_CHANNEL}commentary to=functions.{function.get('name', '')} "
            f"<|constrain|>json{HARMONY_MESSAGE}{arguments}"
        )
    if calls:
        messages += calls
    elif content or finished or not messages:
        messages.append(f"{HARMONY_CHANNEL}final{HARMONY_MESSAGE}{content}")
    return f"{HARMONY_END}{HARMONY_START}assistant".join(messages)


def rebuild_output_text(
    message: dict[str, Any], reasoning_format: ReasoningFormat, finished: bool
) -> str:
    """The model's raw output text from a chat message's fields (without the end token):
    harmony messages for gpt-oss, else `reasoning </think> content` in the target's format."""
    reasoning = message.get("reasoning") or message.get("reasoning_content") or ""
    content = message.get("content") or ""
    if isinstance(reasoning_format, Harmony):
        return _harmony_output_text(
            reasoning.strip("\n"), content, message.get("tool_calls"), finished
        )
    calls = tool_calls_text(message.get("tool_calls"))
    if calls:
        content = f"{content}\n{calls}" if content else calls
    if isinstance(reasoning_format, NoReasoning):
        return content
    if not reasoning:
        # No parser ran: the thinking, if any, is inline in content, already in raw form.
        return content
    reasoning = reasoning.strip("\n")
    closed = finished or bool(content)
    opening = f"{THINK_OPEN}\n" if isinstance(reasoning_format, ThinkInOutput) else ""
    if not closed:
        return opening + reasoning
    return f"{opening}{reasoning}\n{THINK_CLOSE}\n\n{content.lstrip(chr(10))}"


@dataclass
class OpenAIChatEngine(HTTPEngine):
    name: ClassVar[str] = "openai"
    request_path: ClassVar[str] = "/v1/chat/completions"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError("the openai engine needs the target's tokenizer to re-tokenize text")
        self.reasoning_format = detect_format(
            self.tokenizer,
            self.config.reasoning.format,
            self.config.tokenize.chat_template_kwargs,
        )
        self._ask_token_ids = True

    def request_for(self, prompt: Prompt) -> tuple[str, dict[str, Any]]:
        params = self.params.for_prompt(prompt)
        payload: dict[str, Any] = {
            "model": self.config.generation.served_model,
            "messages": wire_messages(prompt.messages),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
        }
        if prompt.tools:
            # The template renders the tools; "none" keeps the server from parsing tool calls
            # out of the text (vLLM refuses "auto" without --enable-auto-tool-choice).
            payload["tools"] = prompt.tools
            payload["tool_choice"] = "none"
        if params.stop:
            payload["stop"] = list(params.stop)
        if self._ask_token_ids:
            payload["return_token_ids"] = True
        kwargs = template_kwargs(self.config.tokenize.chat_template_kwargs, prompt.sampling)
        if kwargs:
            # vLLM and SGLang render with these, as our tokenize stage did (with the row's
            # reasoning effort from the sampling plan).
            payload["chat_template_kwargs"] = kwargs
        if self.streams():
            payload |= {"stream": True, "stream_options": {"include_usage": True}}
        return self.request_path, payload

    def read_stream_chunk(self, chunk: dict[str, Any], state: dict[str, Any]) -> list[int]:
        if chunk.get("prompt_token_ids") is not None:
            state["prompt_token_ids"] = chunk["prompt_token_ids"]
        choice = streamed_choice(chunk, state)
        if choice is None:
            return []  # the usage event
        delta = choice.get("delta") or {}
        for name in ("content", "reasoning", "reasoning_content"):
            if delta.get(name):
                state.setdefault(name, []).append(delta[name])
        for call in delta.get("tool_calls") or []:  # a call arrives in pieces, by its index
            merged = state.setdefault("tool_calls", {}).setdefault(
                call.get("index", 0), {"type": "function", "function": {"arguments": ""}}
            )
            function = call.get("function") or {}
            if call.get("id"):
                merged["id"] = call["id"]
            if function.get("name"):
                merged["function"]["name"] = function["name"]
            merged["function"]["arguments"] += function.get("arguments") or ""
        if choice.get("prompt_token_ids") is not None:
            state["prompt_token_ids"] = choice["prompt_token_ids"]
        if choice.get("finish_reason") is not None:
            state["finish_reason"] = choice["finish_reason"]
            state["stop_reason"] = choice.get("stop_reason")
        if choice.get("token_ids") is not None:
            new = int_list(choice["token_ids"], "choices[0].token_ids")
            state.setdefault("token_ids", []).extend(new)
            return new
        # A server that sends no ids (the OpenAI API): the delta's text, tokenized, stands in
        # for them in the loop guard; the record is rebuilt from the whole text at the end.
        text = "".join(
            delta.get(name) or "" for name in ("reasoning", "reasoning_content", "content")
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def streamed_body(self, state: dict[str, Any]) -> dict[str, Any]:
        """The streamed events of one answer folded into the body an unstreamed answer has."""
        message: dict[str, Any] = {
            name: "".join(state[name])
            for name in ("content", "reasoning", "reasoning_content")
            if name in state
        }
        if state.get("tool_calls"):
            message["tool_calls"] = [state["tool_calls"][i] for i in sorted(state["tool_calls"])]
        choice: dict[str, Any] = {
            "message": message,
            "finish_reason": state.get("finish_reason"),
            "stop_reason": state.get("stop_reason"),
        }
        if "token_ids" in state:
            choice["token_ids"] = state["token_ids"]
        body = {"choices": [choice], "usage": state.get("usage")}
        if "prompt_token_ids" in state:
            body["prompt_token_ids"] = state["prompt_token_ids"]
        return body

    def finish_stream(self, prompt: Prompt, state: dict[str, Any]) -> Generation:
        if "finish_reason" not in state:
            raise MalformedResponse("the stream ended before its finish_reason")
        generation = self.parse(prompt, self.streamed_body(state))
        generation.raw["streamed"] = True
        return generation

    def looped(self, prompt: Prompt, state: dict[str, Any], detector: LoopDetector) -> Generation:
        body = self.streamed_body(state)
        message = body["choices"][0]["message"]
        raw: dict[str, Any] = {k: message[k] for k in TEXT_FIELDS if k in message}
        raw |= {"finish_reason": "loop", "streamed": True, "loop": detector.evidence()}
        if "token_ids" in state:
            ids = list(state["token_ids"])
            mismatch = prompt_ids_check(prompt.prompt_ids, state.get("prompt_token_ids"))
            raw |= mismatch
            token_exact = not mismatch
        else:
            text = rebuild_output_text(message, self.reasoning_format, finished=False)
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            raw["rebuilt_from_text"] = True
            token_exact = False
        return Generation.answering(
            prompt, ids, "loop", self.name, token_exact=token_exact, raw=raw
        )

    def on_client_error(self, status: int, message: str) -> bool:
        # A strict server (the OpenAI API itself) rejects fields it does not know.
        if status == 400 and self._ask_token_ids and "return_token_ids" in message:
            self._ask_token_ids = False
            return True
        return False

    def parse(self, prompt: Prompt, body: dict[str, Any]) -> Generation:
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices:
            raise MalformedResponse("no choices in the answer")
        choice = choices[0]
        message = choice.get("message")
        if not isinstance(message, dict):
            raise MalformedResponse("choices[0].message is missing")
        finish_reason = FINISH_REASONS.get(choice.get("finish_reason"))
        if finish_reason is None:
            raise RetryableResponse(
                f"request did not finish (finish_reason={choice.get('finish_reason')!r})"
            )
        stop_reason = choice.get("stop_reason")
        raw: dict[str, Any] = {k: message[k] for k in TEXT_FIELDS if k in message}
        raw.update(finish_reason=choice.get("finish_reason"), stop_reason=stop_reason)
        raw["usage"] = body.get("usage")
        stop_token = self.stop_token(finish_reason, stop_reason)
        token_ids = choice.get("token_ids")
        if token_ids is not None:
            ids = int_list(token_ids, "choices[0].token_ids")
            output_ids = self.with_end_token(list(ids), stop_token)
            if output_ids != ids:
                raw["end_token_appended"] = True
            server_prompt = choice.get("prompt_token_ids", body.get("prompt_token_ids"))
            mismatch = prompt_ids_check(prompt.prompt_ids, server_prompt)
            raw.update(mismatch)
            token_exact = not mismatch
        else:
            text = rebuild_output_text(message, self.reasoning_format, finish_reason == "stop")
            output_ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if stop_token is not None:
                output_ids.append(stop_token)
            raw["rebuilt_from_text"] = True
            token_exact = False
        return Generation.answering(
            prompt, output_ids, finish_reason, self.name, token_exact=token_exact, raw=raw
        )
