"""The HTTP engines and the canary against fake servers: faults, protocols, balancing, keys.

The servers are ASGI apps from tests/fake_servers.py run by uvicorn on loopback ports; the
SGLang one is a stand-in that follows SGLang's documented /generate schema.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import typing

import pytest

from eaglet.canary import PARSER_HINT, run_canary
from eaglet.config import GenerationConfig, PipelineConfig
from eaglet.engines.base import SamplingParams
from eaglet.engines.http import bounded_map, retry_after_seconds
from eaglet.engines.openai_chat import OpenAIChatEngine
from eaglet.engines.registry import ENGINES, engine_spec
from eaglet.engines.sglang import SGLangEngine
from eaglet.engines.vllm import VLLMEngine
from eaglet.generation import Failure
from eaglet.records.generations import Generation
from tests.engine_helpers import TOKENIZER, collect, engine_for, make_config, make_prompt
from tests.fake_servers import EOS_ID, FakeServer, free_port, serve


@pytest.fixture(scope="module")
def shared():
    server = FakeServer(TOKENIZER, hang_s=1.0)
    with serve(server) as url:
        yield server, url


@pytest.fixture
def server(shared):
    fake, url = shared
    fake.faults.clear()
    fake.log.clear()
    fake.delay_s = 0.0
    fake.max_in_flight = 0
    return fake, url


def only(items: list) -> Generation | Failure:
    assert len(items) == 1, items
    return items[0]


# --- faults ---------------------------------------------------------------------------


def test_5xx_then_success_is_retried(server):
    fake, url = server
    fake.faults.extend(["500", "503"])
    record = only(collect(engine_for(make_config([url])), [make_prompt(1)]))
    assert isinstance(record, Generation)
    assert [entry["fault"] for entry in fake.log] == ["500", "503", None]


def test_429_waits_for_retry_after(server):
    fake, url = server
    fake.faults.append("429:0.6")
    engine = engine_for(make_config([url], retry_backoff_s=0.0))
    record = only(collect(engine, [make_prompt(2)]))
    assert isinstance(record, Generation)
    first, second = fake.log
    assert second["time"] - first["time"] >= 0.55


def test_retry_after_header_forms():
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert retry_after_seconds("soon") is None


@pytest.mark.serial  # bounds seconds
def test_hang_past_the_timeout_is_retried_then_fails(server):
    fake, url = server
    fake.faults.extend(["hang", "hang"])
    engine = engine_for(make_config([url], request_timeout_s=0.3, max_retries=1))
    started = time.monotonic()
    failure = only(collect(engine, [make_prompt(3)]))
    assert isinstance(failure, Failure)
    assert failure.status is None and failure.attempts == 2
    assert "within 0.3 s" in failure.message
    assert time.monotonic() - started < 2.0


def test_hang_then_success(server):
    fake, url = server
    fake.faults.append("hang")
    engine = engine_for(make_config([url], request_timeout_s=0.3))
    assert isinstance(only(collect(engine, [make_prompt(4)])), Generation)


def test_dropped_connection_is_retried(server):
    fake, url = server
    fake.faults.extend(["drop", "drop"])
    record = only(collect(engine_for(make_config([url])), [make_prompt(5)]))
    assert isinstance(record, Generation)
    assert len(fake.log) == 3


def test_malformed_json_is_retried_a_few_times_then_fails(server):
    fake, url = server
    fake.faults.extend(["malformed"] * 5)
    failure = only(collect(engine_for(make_config([url], max_retries=5)), [make_prompt(6)]))
    assert isinstance(failure, Failure)
    assert failure.attempts == 3 and failure.status == 200
    assert "malformed answer" in failure.message and "502 Bad Gateway" in failure.message


def test_malformed_once_then_success(server):
    fake, url = server
    fake.faults.append("malformed")
    assert isinstance(only(collect(engine_for(make_config([url])), [make_prompt(7)])), Generation)


def test_400_is_not_retried_and_keeps_the_servers_message(server):
    fake, url = server
    fake.faults.append("400")
    failure = only(collect(engine_for(make_config([url])), [make_prompt(8)]))
    assert isinstance(failure, Failure)
    assert failure.status == 400 and failure.attempts == 1
    assert "maximum context length is 1024 tokens" in failure.message
    assert failure.sample_id == "s008" and failure.source == "toy"
    assert len(fake.log) == 1


def test_unreachable_endpoint_fails_after_retries():
    config = make_config([f"http://127.0.0.1:{free_port()}"], max_retries=2)
    failure = only(collect(engine_for(config), [make_prompt(9)]))
    assert isinstance(failure, Failure)
    assert failure.status is None and failure.attempts == 3
    assert "ConnectError" in failure.message


def test_in_flight_requests_are_bounded_by_concurrency():
    fake = FakeServer(TOKENIZER, delay_s=0.05)
    with serve(fake) as url:
        config = make_config([url], concurrency=3)
        items = collect(engine_for(config), map(make_prompt, range(20)))
    assert sorted(i.sample_id for i in items) == [f"s{i:03d}" for i in range(20)]
    assert fake.max_in_flight == 3


def test_bounded_map_reads_lazily_and_raises_errors():
    read = []

    def items():
        for i in range(10):
            read.append(i)
            yield i

    async def double(i: int) -> int:
        await asyncio.sleep(0)
        if i == 7:
            raise RuntimeError("boom")
        return 2 * i

    async def first_two():
        stream = bounded_map(double, items(), limit=2)
        got = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return got

    assert sorted(asyncio.run(first_two())) == [0, 2]
    assert len(read) <= 4

    async def everything():
        return [x async for x in bounded_map(double, items(), limit=3)]

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(everything())


# --- protocols --------------------------------------------------------------------------


def test_vllm_request_and_record(server):
    fake, url = server
    record = only(collect(engine_for(make_config([url], seed=7)), [make_prompt(10)]))
    body = fake.log[0]["body"]
    assert body["prompt"] == make_prompt(10).prompt_ids
    assert body["return_token_ids"] is True and body["model"] == "tiny"
    assert body["max_tokens"] == 128 and body["temperature"] == 0.0 and body["seed"] == 7
    ids, finish = fake.complete(body["prompt"], 128)
    assert record.output_ids == ids and ids[-1] == EOS_ID
    assert record.finish_reason == finish == "stop" and record.token_exact
    assert record.engine == "vllm" and record.prompt_ids == make_prompt(10).prompt_ids
    assert record.raw["text"].startswith("Add up the ids") and record.raw["stop_reason"] is None
    assert "token_ids" not in record.raw


def test_length_finish_is_kept_without_an_end_token(server):
    fake, url = server
    record = only(collect(engine_for(make_config([url], max_tokens=5)), [make_prompt(11)]))
    assert record.finish_reason == "length" and len(record.output_ids) == 5
    assert EOS_ID not in record.output_ids


def test_end_token_is_appended_when_the_server_leaves_it_out():
    fake = FakeServer(TOKENIZER, include_eos=False)
    with serve(fake) as url:
        for engine_name in ("vllm", "sglang"):
            record = only(collect(engine_for(make_config([url], engine_name)), [make_prompt(12)]))
            assert record.output_ids[-1] == EOS_ID
            assert record.output_ids == fake.complete(make_prompt(12).prompt_ids, 128)[0]
            assert record.raw["end_token_appended"] is True


def test_sglang_generate_schema(server):
    fake, url = server
    prompts = [make_prompt(i) for i in range(3)]
    sglang = collect(engine_for(make_config([url], "sglang", temperature=0.5, seed=3)), prompts)
    body = fake.log[0]["body"]
    assert set(body) == {"input_ids", "sampling_params", "stream"}  # streamed: the loop guard
    assert body["sampling_params"] == {
        "max_new_tokens": 128,
        "temperature": 0.5,
        "top_p": 1.0,
        "sampling_seed": 3,
    }
    vllm = collect(engine_for(make_config([url], "vllm")), prompts)
    by_id = {r.sample_id: r for r in vllm}
    for record in sglang:
        assert record.engine == "sglang" and record.token_exact
        assert record.output_ids == by_id[record.sample_id].output_ids
        assert record.raw["finish_reason"] == {"type": "stop", "matched": EOS_ID}
        assert record.raw["prompt_tokens"] == len(record.prompt_ids)


def test_sglang_abort_is_retried(server):
    fake, url = server
    fake.faults.append("abort")
    record = only(collect(engine_for(make_config([url], "sglang")), [make_prompt(13)]))
    assert isinstance(record, Generation) and len(fake.log) == 2


def test_openai_engine_uses_token_ids_when_the_server_returns_them(server):
    fake, url = server
    prompts = [make_prompt(14), make_prompt(15, tools=True)]
    records = collect(engine_for(make_config([url], "openai")), prompts)
    body = fake.log[0]["body"]
    assert body["return_token_ids"] is True and "messages" in body
    assert any("tools" in entry["body"] for entry in fake.log)
    vllm = {r.sample_id: r for r in collect(engine_for(make_config([url])), prompts)}
    for record in records:
        assert record.token_exact and record.engine == "openai"
        assert record.output_ids == vllm[record.sample_id].output_ids
        assert record.raw["reasoning"].startswith("Add up the ids")
        assert record.raw["content"].strip().startswith("The answer is")
        assert "prompt_ids_mismatch" not in record.raw


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", None])
def test_openai_engine_rebuilds_text_without_token_ids(field):
    fake = FakeServer(TOKENIZER, reasoning_field=field, chat_token_ids=False)
    with serve(fake) as url:
        prompt = make_prompt(16)
        record = only(collect(engine_for(make_config([url], "openai")), [prompt]))
    assert record.token_exact is False and record.raw["rebuilt_from_text"] is True
    # The toy tokenizer is character-level, so the rebuilt ids are the generated ones.
    assert record.output_ids == fake.complete(prompt.prompt_ids, 128)[0]
    if field is None:
        assert "</think>" in record.raw["content"]
    else:
        assert record.raw[field].startswith("Add up the ids")


def test_openai_engine_drops_return_token_ids_for_a_strict_server():
    class Strict(FakeServer):
        def _chat(self, request, abort):
            if "return_token_ids" in request:
                raise KeyError("unexpected")
            return super()._chat(request, abort)

    fake = Strict(TOKENIZER)
    fake.faults.append("400-strict")

    async def reject(fault, send, path):  # the OpenAI API's answer to an unknown field
        if fault != "400-strict":
            return False
        from tests.fake_servers import _send_json

        message = "Unrecognized request argument supplied: return_token_ids"
        await _send_json(send, 400, {"error": {"message": message}})
        return True

    fake._fault = reject
    with serve(fake) as url:
        record = only(collect(engine_for(make_config([url], "openai")), [make_prompt(17)]))
    assert isinstance(record, Generation) and not record.token_exact
    assert "return_token_ids" not in fake.log[1]["body"]


def test_prompt_id_mismatch_is_flagged():
    class AddsBos(FakeServer):
        def _completions(self, request, abort):
            answer = super()._completions(request, abort)
            answer["choices"][0]["prompt_token_ids"] = [0, *request["prompt"]]
            return answer

    with serve(AddsBos(TOKENIZER)) as url:
        record = only(collect(engine_for(make_config([url])), [make_prompt(18)]))
    assert record.raw["prompt_ids_mismatch"] is True and not record.token_exact


# --- several endpoints ----------------------------------------------------------------------


def test_least_outstanding_requests_favours_the_faster_endpoint():
    slow, fast = FakeServer(TOKENIZER, delay_s=0.2), FakeServer(TOKENIZER, delay_s=0.01)
    with serve(slow) as slow_url, serve(fast) as fast_url:
        config = make_config([slow_url, fast_url], concurrency=4)
        items = collect(engine_for(config), map(make_prompt, range(40)))
    assert len(items) == 40 and all(isinstance(i, Generation) for i in items)
    assert len(fast.log) > 3 * len(slow.log) > 0


def test_equal_endpoints_share_the_load():
    one, two = FakeServer(TOKENIZER, delay_s=0.02), FakeServer(TOKENIZER, delay_s=0.02)
    with serve(one) as url_one, serve(two) as url_two:
        collect(
            engine_for(make_config([url_one, url_two], concurrency=4)), map(make_prompt, range(40))
        )
    assert abs(len(one.log) - len(two.log)) <= 8


def test_a_dead_endpoint_does_not_take_the_traffic(caplog):
    """An endpoint that refused a connection is marked down and skipped: with one retry per
    prompt, every prompt still succeeds and only the requests sent before the first refusal
    (at most `concurrency`) hit it. Without down-marking the dead endpoint, never busy, wins
    every least-outstanding pick, and prompts fail after hitting it twice."""
    alive = FakeServer(TOKENIZER, delay_s=0.01)
    caplog.set_level(logging.WARNING, logger="eaglet.engines.http")
    with serve(alive) as url:
        config = make_config([f"http://127.0.0.1:{free_port()}", url], concurrency=2, max_retries=1)
        items = collect(engine_for(config), map(make_prompt, range(20)))
    assert all(isinstance(i, Generation) for i in items)
    refused = [r for r in caplog.records if "connection to" in r.getMessage()]
    assert len(refused) <= 2, [r.getMessage() for r in refused]
    assert len(alive.log) == 20


# --- the API key ------------------------------------------------------------------------


def test_api_key_is_sent_but_never_written(monkeypatch, caplog):
    secret = "sk-test-5f3a9c1e"
    monkeypatch.setenv("EAGLET_TEST_API_KEY", secret)
    fake = FakeServer(TOKENIZER, api_key=secret)
    fake.faults.extend(["500", "echo-key-400"])
    caplog.set_level(logging.DEBUG)
    with serve(fake) as url:
        config = make_config([url], api_key_env="EAGLET_TEST_API_KEY")
        engine = engine_for(config)
        items = collect(engine, [make_prompt(20), make_prompt(21)])
    assert all(entry["authorization"] == f"Bearer {secret}" for entry in fake.log)
    failures = [i for i in items if isinstance(i, Failure)]
    records = [i for i in items if isinstance(i, Generation)]
    assert len(failures) == 1 and len(records) == 1
    assert "***" in failures[0].message
    written = "".join(i.model_dump_json() for i in items) + json.dumps(engine.sample_response)
    assert secret not in written
    assert secret not in caplog.text
    assert secret not in repr(engine) and secret not in str(config)


def test_missing_api_key_variable_is_named(monkeypatch):
    monkeypatch.delenv("EAGLET_NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match="EAGLET_NO_SUCH_KEY"):
        engine_for(make_config(["http://127.0.0.1:1"], api_key_env="EAGLET_NO_SUCH_KEY"))


def test_wrong_key_fails_the_canary_with_the_fix(monkeypatch):
    monkeypatch.setenv("EAGLET_TEST_API_KEY", "sk-wrong")
    with serve(FakeServer(TOKENIZER, api_key="sk-right")) as url:
        config = make_config([url], api_key_env="EAGLET_TEST_API_KEY")
        report = run_canary(config, TOKENIZER, [make_prompt(22)], engine=engine_for(config))
    assert not report.ok and "api_key_env" in report.failures[0]
    assert "sk-wrong" not in report.render()


# --- the canary -------------------------------------------------------------------------


def test_canary_passes_for_a_good_vllm_server(server):
    fake, url = server
    config = make_config([url], canary_requests=2)
    report = run_canary(config, TOKENIZER, [make_prompt(i) for i in range(5)], engine_for(config))
    assert report.ok, report.render()
    assert len(report.generations) == 2
    assert report.sample_response["choices"][0]["token_ids"]
    assert "one raw response" in report.render()


def test_canary_openai_with_a_reasoning_parser_passes(server):
    fake, url = server
    config = make_config([url], "openai", canary_requests=2)
    report = run_canary(config, TOKENIZER, [make_prompt(1), make_prompt(2)], engine_for(config))
    assert report.ok, report.render()
    assert any("agrees" in line for line in report.passed)


@pytest.mark.parametrize("token_ids", [True, False])
def test_canary_openai_without_a_reasoning_parser_fails_with_the_fix(token_ids):
    fake = FakeServer(TOKENIZER, reasoning_field=None, chat_token_ids=token_ids)
    with serve(fake) as url:
        config = make_config([url], "openai", canary_requests=2)
        report = run_canary(config, TOKENIZER, [make_prompt(1), make_prompt(2)], engine_for(config))
    assert not report.ok
    assert PARSER_HINT in report.failures[0]
    # The vllm engine splits from token ids: the same server is fine for it.
    with serve(fake) as url:
        config = make_config([url], "vllm", canary_requests=2)
        assert run_canary(config, TOKENIZER, [make_prompt(1)], engine_for(config)).ok


@pytest.mark.serial  # bounds seconds
def test_canary_fails_fast_on_an_unreachable_endpoint():
    config = make_config([f"http://127.0.0.1:{free_port()}"])
    started = time.monotonic()
    report = run_canary(config, TOKENIZER, [make_prompt(1)], engine_for(config))
    assert not report.ok and "not reachable" in report.failures[0]
    assert "generation.endpoints" in report.failures[0]
    assert time.monotonic() - started < 5


def test_canary_names_the_served_model(server):
    fake, url = server
    config = make_config([url], served_model="qwen3")
    report = run_canary(config, TOKENIZER, [make_prompt(1)], engine_for(config))
    assert not report.ok and "generation.served_model" in report.failures[0]
    assert "'tiny'" in report.failures[0] or "['tiny']" in report.failures[0]


def test_canary_reports_a_missing_close_tag_and_truncation(server):
    fake, url = server
    config = make_config([url], max_tokens=6)
    report = run_canary(config, TOKENIZER, [make_prompt(1)], engine_for(config))
    assert not report.ok and "raise generation.max_tokens" in report.failures[0]

    class NoClose(FakeServer):
        def complete(self, prompt_ids, max_tokens):
            return TOKENIZER.encode("no tags here") + [EOS_ID], "stop"

    with serve(NoClose(TOKENIZER)) as url:
        config = make_config([url])
        report = run_canary(config, TOKENIZER, [make_prompt(1)], engine_for(config))
    assert not report.ok and "no closing </think>" in report.failures[0]


def test_canary_explains_a_400(server):
    fake, url = server
    fake.faults.append("400")
    config = make_config([url], canary_requests=1)
    report = run_canary(config, TOKENIZER, [make_prompt(1)], engine_for(config))
    assert not report.ok and "lower generation.max_tokens" in report.failures[0]


def test_engines_are_built_by_name():
    for name, cls in (("vllm", VLLMEngine), ("sglang", SGLangEngine), ("openai", OpenAIChatEngine)):
        engine = engine_for(make_config(["http://127.0.0.1:1"], name))
        assert type(engine) is cls and ENGINES[name].needs_server
        assert engine.request_for(make_prompt(1))[0] == cls.request_path != ""


def test_the_registry_lists_exactly_the_engines_the_config_accepts():
    accepted = typing.get_args(GenerationConfig.model_fields["engine"].annotation)
    assert set(ENGINES) == set(accepted)
    for spec in ENGINES.values():
        cls = spec.engine_class()
        assert cls.name == spec.name and callable(cls.from_config)
    with pytest.raises(ValueError, match="not an engine; choose one of local, vllm"):
        engine_spec("tgi")


@pytest.mark.parametrize(
    ("finish", "matched", "expected"),
    [("stop", None, EOS_ID), ("stop", 7, 7), ("stop", "</answer>", None), ("length", None, None)],
)
def test_stop_token_from_what_the_server_matched(finish, matched, expected):
    engine = engine_for(make_config(["http://127.0.0.1:1"]))
    assert engine.stop_token(finish, matched) == expected


def test_every_engine_sends_the_same_sampling_parameters():
    config = make_config(
        ["http://127.0.0.1:1"], temperature=0.7, top_p=0.9, seed=5, stop=["END"], max_tokens=33
    )
    expected = SamplingParams(max_tokens=33, temperature=0.7, top_p=0.9, seed=5, stop=["END"])
    assert SamplingParams.from_generation(config.generation) == expected
    sent = {}
    for name in ("vllm", "sglang", "openai"):
        generation = config.generation.model_copy(update={"engine": name})
        engine = engine_for(config.model_copy(update={"generation": generation}))
        sent[name] = engine.request_for(make_prompt(1))[1]
    wanted = (33, 0.7, 0.9, 5, ["END"])
    for name in ("vllm", "openai"):
        body = sent[name]
        assert tuple(body[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop")) == (
            wanted
        )
    params = sent["sglang"]["sampling_params"]
    keys = ("max_new_tokens", "temperature", "top_p", "sampling_seed", "stop")
    assert tuple(params[k] for k in keys) == wanted


def test_wire_messages_send_tool_arguments_as_json_strings():
    from eaglet.engines.openai_chat import wire_messages

    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": {"x": "é"}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
    wired = wire_messages(messages)
    assert wired[1]["tool_calls"][0]["function"]["arguments"] == '{"x": "é"}'
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": "é"}  # not mutated
    assert wired[0] is messages[0]


def test_rebuilt_text_follows_the_reasoning_format():
    from eaglet.engines.openai_chat import rebuild_output_text
    from eaglet.reasoning import NoReasoning, ThinkInOutput, ThinkOpenInPrompt

    message = {"reasoning_content": "\nthink\n", "content": "\n\nanswer"}
    assert rebuild_output_text(message, ThinkOpenInPrompt(3, 4), True) == (
        "think\n</think>\n\nanswer"
    )
    assert rebuild_output_text(message, ThinkInOutput(3, 4), True) == (
        "<think>\nthink\n</think>\n\nanswer"
    )
    assert rebuild_output_text(message, NoReasoning(), True) == "\n\nanswer"
    unfinished = {"reasoning": "still thinking", "content": None}
    assert rebuild_output_text(unfinished, ThinkOpenInPrompt(3, 4), False) == "still thinking"
    call = {"function": {"name": "get", "arguments": '{"a": 1}'}}
    with_call = {"reasoning": "r", "content": "", "tool_calls": [call]}
    assert rebuild_output_text(with_call, ThinkOpenInPrompt(3, 4), True) == (
        'r\n</think>\n\n<tool_call>\n{"name": "get", "arguments": {"a": 1}}\n</tool_call>'
    )


def test_canary_has_nothing_to_check_for_the_local_engine():
    report = run_canary(PipelineConfig(), TOKENIZER, [make_prompt(1)])
    assert report.ok and "no server" in report.passed[0]
