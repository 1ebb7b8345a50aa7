"""Generation client throughput: eaglet's engine against plain client loops.

Two measurements, printed as tables with ratios (no asserts on time):

1. Against one real vLLM server (the vLLM venv, serving a model folder) at the same
   concurrency: eaglet's `run_generation` with the vllm engine (on httpx2 and on httpx), a
   minimal asyncio + httpx loop, the same on httpx2, and an `openai`-SDK loop (AsyncOpenAI;
   skipped when the package is not installed). Median of --repeats alternating runs.
2. Against a zero-latency stub (an ASGI app in its own process, on another core), the
   requests/s that one client core sustains, and client CPU seconds per 1,000 requests.

    python benchmarks/generation.py --model DIR [--requests 400] [--concurrency 64]
    python benchmarks/generation.py --stub-only

The client and the server share this machine's cores: every client CPU-second is taken from
generation, which is why the CPU column matters as much as requests/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglet.config import PipelineConfig  # noqa: E402
from eaglet.engines.vllm import VLLMEngine  # noqa: E402
from eaglet.generation import run_generation  # noqa: E402
from eaglet.records.prompts import Prompt  # noqa: E402

# --- prompts --------------------------------------------------------------------------


def fixture_prompts(model_dir: Path, n: int) -> list[Prompt]:
    """Rendered prompts of the fixture's held-out conversations, cycled up to n."""
    from eaglet.config import TargetConfig
    from eaglet.fixture.corpus import generate_conversations, prompt_and_target
    from eaglet.target import load_tokenizer

    tokenizer = load_tokenizer(TargetConfig(model=str(model_dir)))
    prompts = []
    conversations = generate_conversations(min(n, 200), 1, stream="eval")
    for i in range(n):
        context, _ = prompt_and_target(conversations[i % len(conversations)])
        text = tokenizer.apply_chat_template(
            context["messages"], tools=context.get("tools"), add_generation_prompt=True,
            tokenize=False,
        )  # fmt: skip
        prompts.append(
            Prompt(
                sample_id=f"b{i:05d}",
                source="bench",
                prompt_ids=tokenizer(text, add_special_tokens=False)["input_ids"],
                prompt_text=text,
                messages=context["messages"],
            )
        )
    return prompts


def stub_prompts(n: int) -> list[Prompt]:
    return [
        Prompt(
            sample_id=f"b{i:05d}",
            source="bench",
            prompt_ids=[1, 2, 3 + i % 50, 4, 5],
            prompt_text="",
            messages=[{"role": "user", "content": "hi"}],
        )
        for i in range(n)
    ]


# --- clients: each sends every prompt once and returns the number of answers --------


def completion_body(prompt: Prompt, max_tokens: int) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt.prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }


async def eaglet_client(url, prompts, concurrency, max_tokens, library: str) -> int:
    config = PipelineConfig.model_validate(
        {
            "generation": {
                "engine": "vllm",
                "endpoints": [url],
                "concurrency": concurrency,
                "max_tokens": max_tokens,
                "max_retries": 0,
            }
        }
    )
    engine = VLLMEngine(config, end_ids=[2], http_library=library)
    with tempfile.TemporaryDirectory() as folder:
        summary = await run_generation(
            engine, prompts, Path(folder) / "out.jsonl", Path(folder) / "failed.jsonl"
        )
    return summary.written


async def raw_client(url, prompts, concurrency, max_tokens, library: str) -> int:
    """The minimal loop: one AsyncClient, a semaphore, gather."""
    http = __import__(library)
    limits = http.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    async with http.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(prompt: Prompt) -> int:
            async with semaphore:
                response = await client.post(
                    "/v1/completions", json=completion_body(prompt, max_tokens)
                )
                response.raise_for_status()
                return len(response.json()["choices"][0]["token_ids"]) > 0

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def openai_client(url, prompts, concurrency, max_tokens, library: str = "") -> int:
    """The seeds' style: AsyncOpenAI + asyncio.gather + a semaphore."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    semaphore = asyncio.Semaphore(concurrency)

    async def one(prompt: Prompt) -> int:
        async with semaphore:
            completion = await client.completions.create(
                model="tiny",
                prompt=prompt.prompt_ids,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            return len(completion.choices[0].model_extra.get("token_ids") or [0]) > 0

    try:
        return sum(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await client.close()


def clients() -> dict[str, Callable]:
    found = {
        "eaglet run_generation (httpx2)": lambda *a: eaglet_client(*a, library="httpx2"),
        "eaglet run_generation (httpx 0.28)": lambda *a: eaglet_client(*a, library="httpx"),
        "minimal asyncio + httpx2": lambda *a: raw_client(*a, library="httpx2"),
        "minimal asyncio + httpx 0.28": lambda *a: raw_client(*a, library="httpx"),
    }
    try:
        import openai  # noqa: F401

        found["openai SDK AsyncOpenAI loop"] = openai_client
    except ImportError:
        print("(openai is not installed: `pip install openai` to include the SDK loop)")
    return found


def measure(client, url, prompts, concurrency, max_tokens) -> tuple[float, float, int]:
    """(requests/s, client CPU s per 1k requests, answers)."""
    cpu, wall = time.process_time(), time.perf_counter()
    answered = asyncio.run(client(url, prompts, concurrency, max_tokens))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return answered / wall, 1000 * cpu / max(1, answered), answered


def compare(title: str, url: str, prompts, concurrency: int, max_tokens: int, repeats: int):
    styles = clients()
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in styles}
    warm = prompts[: min(len(prompts), 2 * concurrency)]
    for client in styles.values():  # connections, caches, imports
        asyncio.run(client(url, warm, concurrency, max_tokens))
    for repeat in range(repeats):
        order = list(styles.items())
        if repeat % 2:
            order.reverse()
        for name, client in order:
            rate, cpu, answered = measure(client, url, prompts, concurrency, max_tokens)
            if answered != len(prompts):
                print(f"  {name}: only {answered} of {len(prompts)} answered")
            figures[name].append((rate, cpu))
    base = statistics.median(r for r, _ in figures["eaglet run_generation (httpx2)"])
    print(f"\n{title}: {len(prompts)} requests, concurrency {concurrency}, median of {repeats}")
    print(f"  {'client':<36} {'req/s':>8} {'vs eaglet':>10} {'CPU s/1k req':>13}")
    for name, runs in figures.items():
        rate = statistics.median(r for r, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        print(f"  {name:<36} {rate:>8.1f} {rate / base:>9.2f}x {cpu:>13.2f}")
    return figures


# --- the zero-latency stub ------------------------------------------------------------

STUB_ANSWER = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "text_completion",
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": "The answer is 4.",
                "token_ids": list(range(10, 42)) + [2],
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 33},
    }
).encode()


async def stub_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = STUB_ANSWER if scope["path"] == "/v1/completions" else b"{}"
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def serve_stub(port: int) -> None:
    import uvicorn

    uvicorn.run(stub_app, host="127.0.0.1", port=port, log_level="error", access_log=False)


def run_stub(args) -> None:
    from tests.vllm_server import free_port

    port = free_port()
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = cores[-1], cores[0]
    stub = subprocess.Popen(
        [sys.executable, __file__, "--serve-stub", str(port)],
        preexec_fn=lambda: os.sched_setaffinity(0, {server_core}),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url)
        os.sched_setaffinity(0, {client_core})
        compare(
            f"zero-latency stub (client on core {client_core}, stub on core {server_core})",
            url,
            stub_prompts(args.stub_requests),
            args.concurrency,
            args.max_tokens,
            args.repeats,
        )
    finally:
        os.sched_setaffinity(0, set(cores))
        stub.terminate()
        stub.wait()


def _wait_healthy(url: str, timeout: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up")


def run_vllm(args) -> None:
    from tests.vllm_server import vllm_python, vllm_server

    if vllm_python() is None:
        print("no vLLM venv (make vllm-venv): skipping the vLLM comparison")
        return
    model_dir = Path(args.model)
    prompts = fixture_prompts(model_dir, args.requests)
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "vllm.log"
        with vllm_server(model_dir, log) as url:
            compare(
                f"vLLM {url} serving {model_dir.name}",
                url,
                prompts,
                args.concurrency,
                args.max_tokens,
                args.repeats,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder for vLLM (e.g. from `eaglet fixture-model`)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--stub-requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stub-only", action="store_true")
    parser.add_argument("--vllm-only", action="store_true")
    parser.add_argument("--serve-stub", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_stub:
        serve_stub(args.serve_stub)
        return
    if not args.stub_only:
        if not args.model:
            parser.error("--model DIR is needed for the vLLM comparison (or use --stub-only)")
        run_vllm(args)
    if not args.vllm_only:
        run_stub(args)


if __name__ == "__main__":
    main()
