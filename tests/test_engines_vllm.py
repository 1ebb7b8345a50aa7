"""The vllm and openai engines against a real vLLM server serving the fixture target.

One server at a time (module scope, ~30 s and ~3 GB each): first without a reasoning
parser, then with `--reasoning-parser qwen3`. Greedy records must equal the local engine's,
token for token, including the end token; the canary must pass for the vllm engine in both
cases and for the openai engine only with the parser.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from eaglet.canary import PARSER_HINT, run_canary
from eaglet.config import PipelineConfig, TargetConfig
from eaglet.engines.base import SamplingParams
from eaglet.engines.local import LocalEngine
from eaglet.engines.registry import make_engine
from eaglet.extract import server_reasoning_text
from eaglet.generation import run_generation_sync
from eaglet.reasoning import detect_format
from eaglet.records.generations import Generation
from eaglet.records.io import read_jsonl, repair_and_read_ids, write_jsonl
from eaglet.records.prompts import Prompt
from eaglet.target import load_tokenizer
from tests.engine_helpers import fixture_prompts
from tests.vllm_server import ROOT, vllm_python, vllm_server

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)"),
]

MAX_TOKENS = 128
N_PROMPTS = 8


@pytest.fixture(scope="module")
def tokenizer(fixture_model_dir):
    return load_tokenizer(TargetConfig(model=str(fixture_model_dir)))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[Prompt]:
    prompts = fixture_prompts(tokenizer, N_PROMPTS)
    assert any(p.tools for p in prompts)
    return prompts


@pytest.fixture(scope="module")
def local_records(fixture_model_dir, prompts) -> dict[str, Generation]:
    engine = LocalEngine(
        TargetConfig(model=str(fixture_model_dir)), SamplingParams(max_tokens=MAX_TOKENS), 1
    )
    return {g.sample_id: g for g in engine.generate(prompts)}


@pytest.fixture(scope="module", params=["no_parser", "qwen3_parser"])
def server(request, fixture_model_dir, tmp_path_factory):
    """(base URL, whether a reasoning parser runs); one server at a time."""
    parser = request.param == "qwen3_parser"
    extra = ["--reasoning-parser", "qwen3"] if parser else []
    log = tmp_path_factory.mktemp("vllm") / f"{request.param}.log"
    with vllm_server(fixture_model_dir, log, extra) as url:
        yield url, parser


def config_for(model_dir: Path, url: str, engine: str) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "target": {"model": str(model_dir)},
            "generation": {
                "engine": engine,
                "endpoints": [url],
                "served_model": "tiny",
                "max_tokens": MAX_TOKENS,
                "concurrency": 4,
                "request_timeout_s": 120,
            },
        }
    )


def generate(config, tokenizer, prompts, tmp_path) -> dict[str, Generation]:
    engine = make_engine(config, tokenizer)
    out = tmp_path / f"{config.generation.engine}.jsonl"
    summary = run_generation_sync(engine, prompts, out, tmp_path / "failed.jsonl")
    assert summary.failed == 0 and summary.written == len(prompts)
    return {g.sample_id: g for g in read_jsonl(out, Generation)}


@pytest.mark.parametrize("engine", ["vllm", "openai"])
def test_greedy_records_equal_the_local_engines(
    engine, server, fixture_model_dir, tokenizer, prompts, local_records, tmp_path
):
    url, parser = server
    records = generate(config_for(fixture_model_dir, url, engine), tokenizer, prompts, tmp_path)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for sample_id, local in local_records.items():
        record = records[sample_id]
        assert record.output_ids == local.output_ids, sample_id
        assert record.finish_reason == local.finish_reason
        assert record.prompt_ids == local.prompt_ids
        assert record.token_exact and record.engine == engine
        assert "prompt_ids_mismatch" not in record.raw
        # vLLM keeps the end token in token_ids itself: nothing had to be appended.
        assert "end_token_appended" not in record.raw
        if record.finish_reason == "stop":
            assert record.output_ids[-1] == end_id
    if engine == "openai":
        close_id = tokenizer.convert_tokens_to_ids("</think>")
        reasoning_format = detect_format(tokenizer)
        for record in records.values():
            server_text = server_reasoning_text(record.raw)
            if parser:
                split = reasoning_format.split(record.output_ids, {end_id})
                assert server_text.strip() == tokenizer.decode(split.ids("reasoning")).strip()
            else:
                assert server_text is None
                if close_id in record.output_ids:
                    assert "</think>" in record.raw["content"]


@pytest.mark.parametrize("engine", ["vllm", "openai"])
def test_the_loop_guard_streams_and_ends_looping_requests_in_real_vllm(
    engine, server, fixture_model_dir, tokenizer, prompts, local_records, tmp_path
):
    """The vllm and openai engines stream (the loop guard's default; the test above compares
    those records with the local engine's). A guard set to stop at any repeated bigram ends
    real requests mid-answer: each such record is a prefix of the full answer, finish 'loop';
    the server goes on serving, and the same prompts unstreamed (loop_guard off) come back
    whole."""
    url, _ = server
    config = config_for(fixture_model_dir, url, engine)
    hair_trigger = config.model_copy(
        update={"generation": config.generation.model_copy(
            update={"loop_ngram": 2, "loop_repeats": 2})}
    )  # fmt: skip
    (tmp_path / "guarded").mkdir()
    records = generate(hair_trigger, tokenizer, prompts, tmp_path / "guarded")
    looped = [r for r in records.values() if r.finish_reason == "loop"]
    assert looped, [r.finish_reason for r in records.values()]
    for record in looped:
        full = local_records[record.sample_id].output_ids
        assert len(record.output_ids) < len(full)
        assert full[: len(record.output_ids)] == record.output_ids
        assert record.raw["streamed"] and record.raw["loop"]["repeats"] == 2
    unstreamed = config.model_copy(
        update={"generation": config.generation.model_copy(update={"loop_guard": False})}
    )
    (tmp_path / "plain").mkdir()
    plain = generate(unstreamed, tokenizer, prompts, tmp_path / "plain")
    for sample_id, local in local_records.items():
        assert plain[sample_id].output_ids == local.output_ids, sample_id
        assert "streamed" not in plain[sample_id].raw


def test_a_sampling_plan_reaches_real_vllm_row_by_row(
    server, fixture_model_dir, tokenizer, prompts, local_records, tmp_path
):
    """generation.sampling_plan against real vLLM (one server is enough): with a cycle of
    greedy and temperature 1, the greedy rows come back as the local engine's greedy answers
    and some sampled row differs from it; each record carries its row's entry, and the same
    prompts sent again (a resumed stage sends what the first run sent) come back the same."""
    from eaglet.sampling_plan import choose

    url, parser = server
    if parser:
        pytest.skip("the plan does not depend on the reasoning parser")
    data = config_for(fixture_model_dir, url, "vllm").model_dump()
    data["generation"] |= {
        "sampling_plan": [{"temperature": 0.0}, {"temperature": 1.0}],
        "sampling_plan_mode": "cycle",
    }
    config = PipelineConfig.model_validate(data)
    planned = [
        p.model_copy(update={"sampling": choose(config.generation, p.sample_id, i)})
        for i, p in enumerate(prompts)
    ]
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    first = generate(config, tokenizer, planned, tmp_path / "first")
    again = generate(config, tokenizer, planned, tmp_path / "again")
    differs = 0
    for prompt in planned:
        record, greedy = first[prompt.sample_id], local_records[prompt.sample_id]
        assert record.sampling == prompt.sampling
        assert record.output_ids == again[prompt.sample_id].output_ids, prompt.sample_id
        if prompt.sampling["temperature"] == 0.0:
            assert record.output_ids == greedy.output_ids, prompt.sample_id
        else:
            differs += record.output_ids != greedy.output_ids
    print(f"{differs} of {len(planned) // 2} rows sampled at temperature 1 differ from greedy")
    assert differs > 0


def test_openai_text_rebuild_reads_like_the_tokens(
    server, fixture_model_dir, tokenizer, prompts, local_records
):
    """Without token ids, the openai engine rebuilds the raw output from the text fields;
    decoded, it reads exactly like the model's own tokens (the ids may tokenize differently)."""
    url, parser = server
    engine = make_engine(config_for(fixture_model_dir, url, "openai"), tokenizer)
    engine._ask_token_ids = False

    async def run():
        return [g async for g in engine.generate_async(prompts)]

    records = {g.sample_id: g for g in asyncio.run(run())}
    close_id = tokenizer.convert_tokens_to_ids("</think>")
    compared = 0
    for sample_id, local in local_records.items():
        record = records[sample_id]
        assert not record.token_exact and record.raw["rebuilt_from_text"]
        if parser and local.output_ids.count(close_id) > 1:
            continue  # the parser drops a second </think> from content; nothing can rebuild it
        assert tokenizer.decode(record.output_ids) == tokenizer.decode(local.output_ids)
        compared += 1
    assert compared >= 1


def test_canary(server, fixture_model_dir, tokenizer, prompts):
    url, parser = server
    vllm = run_canary(config_for(fixture_model_dir, url, "vllm"), tokenizer, prompts)
    assert vllm.ok, vllm.render()
    assert vllm.sample_response["choices"][0]["token_ids"]
    openai = run_canary(config_for(fixture_model_dir, url, "openai"), tokenizer, prompts)
    if parser:
        assert openai.ok, openai.render()
        assert any("agrees" in line for line in openai.passed)
    else:
        assert not openai.ok
        assert PARSER_HINT in openai.failures[0], openai.render()


KILL_CHILD = """
import sys
from pathlib import Path
from eaglet.config import PipelineConfig, TargetConfig
from eaglet.engines.registry import make_engine
from eaglet.generation import run_generation_sync
from eaglet.target import load_tokenizer
from eaglet.records.io import read_jsonl
from eaglet.records.prompts import Prompt

config_json, prompts_path, out, failed = sys.argv[1:5]
config = PipelineConfig.model_validate_json(config_json)
engine = make_engine(config, load_tokenizer(config.target))
prompts = list(read_jsonl(Path(prompts_path), Prompt))
run_generation_sync(engine, prompts, Path(out), Path(failed))
"""


def server_counts(url: str) -> tuple[float, float]:
    """(requests the server finished for any reason, their prompt tokens) from `/metrics`."""
    finished = prompt_tokens = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            finished += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:request_prompt_tokens_sum{"):
            prompt_tokens += float(line.rsplit(" ", 1)[1])
    return finished, prompt_tokens


def wait_until_idle(url: str, timeout: float = 60) -> None:
    """Requests cut off by the kill are aborted or finish; wait until none runs or waits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = sum(
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
        )
        if busy == 0:
            return
        time.sleep(0.2)
    raise TimeoutError("vLLM still busy a minute after the client was killed")


def test_sigkill_mid_run_then_resume_sends_no_finished_sample_again(
    server, fixture_model_dir, tokenizer, tmp_path
):
    """Kill -9 the generating process mid-run, resume: every sample is written exactly once,
    and the server's own counters show that the resume sent exactly the unfinished samples."""
    url, _ = server
    prompts = fixture_prompts(tokenizer, 96, stream="kill")
    prompts_path, out, failed = tmp_path / "prompts.jsonl", tmp_path / "gen.jsonl", tmp_path / "f"
    write_jsonl(prompts_path, prompts)
    config = config_for(fixture_model_dir, url, "vllm")
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, config.model_dump_json(), str(prompts_path),
         str(out), str(failed)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not out.exists() or out.read_text().count("\n") < 20:
        assert child.poll() is None, "the child finished before it could be killed"
        assert time.monotonic() < deadline, "the child wrote fewer than 20 records in 5 min"
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    wait_until_idle(url)
    finished = repair_and_read_ids(out)
    assert 20 <= len(finished) < len(prompts)
    count_before, tokens_before = server_counts(url)

    summary = run_generation_sync(make_engine(config, tokenizer), prompts, out, failed)

    count_after, tokens_after = server_counts(url)
    unfinished = [p for p in prompts if p.sample_id not in finished]
    assert summary.already_done == len(finished) and summary.failed == 0
    assert count_after - count_before == len(unfinished), "the resume sent a finished sample"
    assert tokens_after - tokens_before == sum(len(p.prompt_ids) for p in unfinished)
    counts = Counter(g.sample_id for g in read_jsonl(out, Generation))
    assert set(counts) == {p.sample_id for p in prompts}
    assert max(counts.values()) == 1, "a sample was written twice"
