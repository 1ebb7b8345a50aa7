"""What the engine and canary tests share: the toy tokenizer, prompts, configs and engines
pointed at the fake servers of tests/fake_servers.py; the fixture target's own conversations as
prompts (`fixture_prompts`)."""

from __future__ import annotations

import asyncio

from eaglet.config import PipelineConfig
from eaglet.engines.registry import make_engine
from eaglet.generation import Failure
from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt
from tests.fake_servers import EOS_ID, ToyTokenizer

TOKENIZER = ToyTokenizer()


def make_prompt(i: int, tools: bool = False) -> Prompt:
    messages = [{"role": "user", "content": f"What is {i} + {i}?"}]
    tool_list = [{"type": "function", "function": {"name": "add"}}] if tools else None
    text = TOKENIZER.apply_chat_template(messages, tools=tool_list, add_generation_prompt=True)
    return Prompt(
        sample_id=f"s{i:03d}",
        source="toy",
        prompt_ids=TOKENIZER.encode(text),
        prompt_text=text,
        messages=messages,
        tools=tool_list,
    )


def make_config(endpoints: list[str], engine: str = "vllm", **generation) -> PipelineConfig:
    """A config for the HTTP engine `engine` at `endpoints`: short timeouts and backoff."""
    settings = {
        "engine": engine,
        "endpoints": endpoints,
        "retry_backoff_s": 0.01,
        "request_timeout_s": 5,
        "max_tokens": 128,
        **generation,
    }
    return PipelineConfig.model_validate({"generation": settings})


def engine_for(config: PipelineConfig, **kwargs):
    """The configured engine with the toy tokenizer and its end token."""
    return make_engine(config, TOKENIZER, end_ids=[EOS_ID], **kwargs)


def collect(engine, prompts) -> list[Generation | Failure]:
    async def run():
        return [item async for item in engine.generate_async(prompts)]

    return asyncio.run(run())


def fixture_prompts(tokenizer, n: int, stream: str = "eval") -> list[Prompt]:
    """Fixture conversations (plain, multi-turn and tool calls), as the tokenize stage renders
    them."""
    from eaglet.fixture.corpus import generate_conversations, prompt_and_target

    prompts = []
    for i, conversation in enumerate(generate_conversations(n, 1, stream=stream)):
        context, _ = prompt_and_target(conversation)
        text = tokenizer.apply_chat_template(
            context["messages"], tools=context["tools"], add_generation_prompt=True,
            tokenize=False,
        )  # fmt: skip
        prompts.append(
            Prompt(
                sample_id=f"v{i}",
                source=stream,
                prompt_ids=tokenizer(text, add_special_tokens=False)["input_ids"],
                prompt_text=text,
                messages=context["messages"],
                tools=context["tools"],
            )
        )
    return prompts
