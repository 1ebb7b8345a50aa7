"""The fixture target is servable by a real vLLM server and decodes there as it does locally."""

from __future__ import annotations

import httpx
import pytest

from eaglet.config import DatasetSpec
from eaglet.datasets import read_samples
from eaglet.engines.base import SamplingParams
from eaglet.engines.local import LocalEngine
from eaglet.prompts import load_tokenizer, render_prompt
from tests.vllm_server import vllm_python, vllm_server

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)"),
]


def test_vllm_serves_the_fixture_with_the_same_greedy_tokens_as_the_local_engine(
    tmp_path, fixture_model_dir, sample_data_dir
):
    tokenizer = load_tokenizer(str(fixture_model_dir))
    samples = list(
        read_samples(
            DatasetSpec(source="arith", path=str(sample_data_dir / "arith.jsonl"), limit=6)
        )
    )
    prompts = [render_prompt(s, tokenizer, {}) for s in samples]
    local = {
        g.sample_id: g.output_ids
        for g in LocalEngine(
            str(fixture_model_dir), SamplingParams(max_tokens=128), batch_size=1
        ).generate(prompts)
    }
    close_id = tokenizer.convert_tokens_to_ids("</think>")
    with vllm_server(fixture_model_dir, tmp_path / "vllm.log") as base_url:
        served = {}
        for prompt in prompts:
            response = httpx.post(
                f"{base_url}/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": prompt.prompt_ids,
                    "max_tokens": 128,
                    "temperature": 0,
                    "return_token_ids": True,
                },
                timeout=60,
            )
            response.raise_for_status()
            served[prompt.sample_id] = response.json()["choices"][0]["token_ids"]
    assert all(close_id in ids for ids in served.values())
    assert served == local
