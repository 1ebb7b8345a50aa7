"""The preflight canary: a handful of real requests that prove a server setup before a long run.

`run_canary(config, tokenizer, prompts)` checks, in order, stopping at the first broken layer:

1. every endpoint answers (and, where it lists models, serves `generation.served_model`);
2. a few prompts go through the configured engine and come back as records;
3. the server saw the same prompt token ids as eaglet;
4. the answers have the closing think token where the reasoning format requires one;
5. reasoning text the server split out agrees with eaglet's split of the token ids;
6. (openai engine) the thinking did not land in `content` because no reasoning parser ran.

Every failure says what is wrong and how to fix it, and the report keeps one raw server
response for a person to look at (`eaglet doctor` prints it). Requests are retried at most
once and endpoints get a short timeout, so a broken setup fails within the first minute.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from eaglet.config import PipelineConfig
from eaglet.engines.http import HTTPEngine, make_http_engine, server_message
from eaglet.extract import LEAKED_THINKING, server_reasoning_text
from eaglet.generation import Failure, run_sync
from eaglet.reasoning import THINK_CLOSE, detect_format
from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt

REACH_TIMEOUT_S = 10.0
PARSER_HINT = (
    "server returned the thinking text inside `content`: start it with --reasoning-parser, "
    "or use the vllm/sglang engine which splits from token ids"
)


class CanaryError(RuntimeError):
    """The canary found a broken setup; the message lists every problem and its fix."""


@dataclass
class CanaryReport:
    engine: str
    endpoints: list[str]
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)  # checks that held, for display
    sample_response: dict[str, Any] | None = None  # one raw server answer, as received
    generations: list[Generation] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def render(self, max_ids: int = 12) -> str:
        """A report for a terminal: verdict, checks, problems, one raw response."""
        verdict = "OK" if self.ok else f"FAILED ({len(self.failures)} problems)"
        lines = [
            f"canary: engine {self.engine} at {', '.join(self.endpoints)}: {verdict} "
            f"({len(self.generations)} answers in {self.elapsed_s:.1f} s)"
        ]
        lines += [f"  ok:      {line}" for line in self.passed]
        lines += [f"  warning: {line}" for line in self.warnings]
        lines += [f"  problem: {line}" for line in self.failures]
        if self.sample_response is not None:
            shown = json.dumps(_shorten(self.sample_response, max_ids), indent=2)
            lines.append("  one raw response:")
            lines += [f"    {line}" for line in shown.splitlines()]
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if self.failures:
            raise CanaryError(
                "preflight canary failed:\n  " + "\n  ".join(self.failures) + "\n(run "
                "`eaglet doctor CONFIG` to see one raw server response)"
            )


def _shorten(value: Any, max_ids: int) -> Any:
    """Long token id lists cut for display."""
    if isinstance(value, dict):
        return {k: _shorten(v, max_ids) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > max_ids and all(isinstance(v, int) for v in value):
            return [*value[:max_ids], f"... {len(value)} ids in all"]
        return [_shorten(v, max_ids) for v in value]
    return value


def _canary_config(config: PipelineConfig, n: int) -> PipelineConfig:
    generation = config.generation.model_copy(
        update={"max_retries": min(config.generation.max_retries, 1), "concurrency": max(1, n)}
    )
    return config.model_copy(update={"generation": generation})


def _failure_hint(engine: str, failure: Failure) -> str:
    message = failure.message.lower()
    if failure.status in (401, 403):
        return (
            "the server wants an API key (or refused the one sent): set generation.api_key_env "
            "to the name of an environment variable that holds the key"
        )
    if failure.status == 404:
        if "model" in message:
            return "the server does not serve this model name: set generation.served_model"
        paths = {"vllm": "/v1/completions", "sglang": "/generate", "openai": "/v1/chat/completions"}
        return (
            f"the server has no {paths.get(engine, 'such')} path: check generation.endpoints and "
            f"that generation.engine={engine} speaks this server's protocol"
        )
    if failure.status in (400, 422):
        if "model" in message and ("not exist" in message or "not found" in message):
            return "the server does not serve this model name: set generation.served_model"
        if "context" in message or "max_tokens" in message or "too long" in message:
            return (
                "prompt + generation.max_tokens exceed the server's context: lower "
                "generation.max_tokens or tokenize.max_prompt_tokens, or raise the server's "
                "--max-model-len / --context-length"
            )
        return "the server rejected the request: check generation settings against the server"
    if failure.status == 200:
        return (
            f"the server's answers are not what the {engine} engine reads: is "
            f"generation.engine={engine} the right protocol for this server?"
        )
    return (
        "check that the server is up and healthy, and that generation.request_timeout_s "
        "allows a full answer"
    )


async def _check_endpoints(engine: HTTPEngine, report: CanaryReport) -> None:
    """Each endpoint answers its health path; an OpenAI model list names served_model."""
    served = engine.config.generation.served_model
    async with engine.open_pool() as pool:
        for endpoint in pool.endpoints:
            where = f"{endpoint.url}{engine.health_path}"
            try:
                async with asyncio.timeout(REACH_TIMEOUT_S):
                    response = await endpoint.client.get(engine.health_path)
            except (TimeoutError, engine.http.TransportError) as exc:
                report.failures.append(
                    f"endpoint {endpoint.url} is not reachable ({type(exc).__name__} on GET "
                    f"{where}): start the server, or fix generation.endpoints"
                )
                continue
            status = response.status_code
            if status in (401, 403):
                report.failures.append(
                    f"endpoint {endpoint.url} answered HTTP {status} to GET {where} "
                    f"({engine.scrub(server_message(response.content))}): set "
                    "generation.api_key_env to the name of an environment variable holding "
                    "the server's key"
                )
                continue
            if status != 200:
                report.warnings.append(f"GET {where} answered HTTP {status}; going on")
                continue
            models = _model_ids(response)
            if models is not None and engine.name != "sglang" and served not in models:
                report.failures.append(
                    f"endpoint {endpoint.url} serves {models}, not generation.served_model="
                    f"{served!r}: set generation.served_model to one of them"
                )
                continue
            report.passed.append(f"endpoint {endpoint.url} answers")


def _model_ids(response: Any) -> list[str] | None:
    try:
        data = response.json()
        return [str(m["id"]) for m in data["data"]]
    except (ValueError, KeyError, TypeError):
        return None


def _check_prompt_ids(engine: str, generations: list[Generation], report: CanaryReport) -> None:
    for g in generations:
        theirs = g.raw.get("server_prompt_token_ids")
        if not g.raw.get("prompt_ids_mismatch"):
            continue
        detail = ""
        if isinstance(theirs, list):
            first = next(
                (i for i, (a, b) in enumerate(zip(theirs, g.prompt_ids, strict=False)) if a != b),
                min(len(theirs), len(g.prompt_ids)),
            )
            detail = (
                f": the server has {len(theirs)} prompt ids, eaglet {len(g.prompt_ids)}, "
                f"first difference at position {first}"
            )
        fix = (
            "the server renders the chat template differently: give it the target's template "
            "(--chat-template) and the same tokenize.chat_template_kwargs, or use the vllm "
            "engine, which sends eaglet's token ids"
            if engine == "openai"
            else "the server changed the token ids it was sent (e.g. added a BOS token): "
            "check the server's tokenizer settings"
        )
        report.failures.append(
            f"sample {g.sample_id}: the server saw other prompt token ids than eaglet{detail}; "
            f"{fix}"
        )
        return
    if any(g.token_exact for g in generations):
        report.passed.append("the server saw eaglet's prompt token ids")


def _check_reasoning(
    config: PipelineConfig, tokenizer: Any, engine: HTTPEngine, report: CanaryReport
) -> None:
    try:
        reasoning_format = detect_format(
            tokenizer, config.reasoning.format, config.tokenize.chat_template_kwargs
        )
    except ValueError as exc:
        report.failures.append(f"{exc}: set reasoning.format to auto or none")
        return
    end_ids = set(engine.end_ids or [])
    generations = report.generations
    finished = [g for g in generations if g.finish_reason == "stop"]
    if len(finished) < len(generations):
        report.warnings.append(
            f"{len(generations) - len(finished)} of {len(generations)} answers hit "
            f"generation.max_tokens={config.generation.max_tokens}"
        )
    if engine.name == "openai" and reasoning_format.reasons:
        leaked = [g for g in generations if _thinking_in_content(g, reasoning_format, end_ids)]
        if leaked:
            report.failures.append(f"{PARSER_HINT} (samples {[g.sample_id for g in leaked]})")
            return
    if reasoning_format.reasons:
        if not finished:
            report.failures.append(
                f"all {len(generations)} answers hit generation.max_tokens="
                f"{config.generation.max_tokens} before the end, so the closing {THINK_CLOSE} "
                "cannot be checked: raise generation.max_tokens"
            )
            return
        unclosed = [
            g.sample_id
            for g in finished
            if not reasoning_format.split(g.output_ids, end_ids).reasoning_closed
        ]
        if unclosed:
            report.failures.append(
                f"{len(unclosed)} of {len(finished)} finished answers have no closing "
                f"{THINK_CLOSE} token (samples {unclosed}), yet reasoning.format is "
                f"{reasoning_format.name}: check tokenize.chat_template_kwargs (e.g. "
                "enable_thinking) and reasoning.format, and that the server does not strip "
                "the tag from its output"
            )
            return
        report.passed.append(
            f"every finished answer closes its reasoning with {THINK_CLOSE} "
            f"(format {reasoning_format.name})"
        )
    disagreements = []
    for g in finished:  # parsers differ on unclosed reasoning: compare finished answers only
        server_text = server_reasoning_text(g.raw)
        if server_text is None:
            continue
        split = reasoning_format.split(g.output_ids, end_ids)
        ours = tokenizer.decode(split.ids("reasoning")).strip()
        if server_text.strip() != ours:
            disagreements.append((g.sample_id, server_text.strip(), ours))
    if disagreements:
        sample_id, theirs, ours = disagreements[0]
        report.failures.append(
            f"{len(disagreements)} answers: the server's reasoning text differs from eaglet's "
            f"split of the token ids (sample {sample_id}: server {theirs[:80]!r}, tokens "
            f"{ours[:80]!r}): the server's --reasoning-parser does not match the model "
            "(check reasoning.format too); eaglet trains on its own token split"
        )
    elif any(server_reasoning_text(g.raw) is not None for g in finished):
        report.passed.append("the server's reasoning text agrees with eaglet's token split")


def _thinking_in_content(g: Generation, reasoning_format: Any, end_ids: set[int]) -> bool:
    """No reasoning field from the server, yet content carries think tags or the token
    split finds reasoning."""
    if server_reasoning_text(g.raw):
        return False
    content = g.raw.get("content") or ""
    if any(tag in content for tag in LEAKED_THINKING):
        return True
    if not g.token_exact or g.finish_reason != "stop" or not content:
        return False
    return bool(reasoning_format.split(g.output_ids, end_ids).ids("reasoning"))


async def run_canary_async(
    config: PipelineConfig,
    tokenizer: Any,
    prompts: list[Prompt],
    engine: HTTPEngine | None = None,
    api_key: str | None = None,
) -> CanaryReport:
    """The canary's checks; see `run_canary`."""
    started = time.monotonic()
    n = min(len(prompts), config.generation.canary_requests)
    report = CanaryReport(config.generation.engine, list(config.generation.endpoints))
    if config.generation.engine == "local":
        report.passed.append("the local engine runs in-process: no server to check")
        return report
    if n == 0:
        report.failures.append("no prompts to send: the canary needs at least one prompt")
        return report
    if engine is None:
        try:
            engine = make_http_engine(_canary_config(config, n), tokenizer, api_key=api_key)
        except (ValueError, OSError) as exc:
            report.failures.append(str(exc))
            return report
    await _check_endpoints(engine, report)
    if report.failures:
        report.elapsed_s = time.monotonic() - started
        return report
    failures: list[Failure] = []
    async for item in engine.generate_async(prompts[:n]):
        if isinstance(item, Failure):
            failures.append(item)
        else:
            report.generations.append(item)
    report.sample_response = engine.sample_response
    for failure in failures[:3]:
        report.failures.append(
            f"sample {failure.sample_id}: {failure.message}; {_failure_hint(engine.name, failure)}"
        )
    if report.generations and not failures:
        report.passed.append(f"{len(report.generations)} requests answered")
    if report.generations:
        _check_prompt_ids(engine.name, report.generations, report)
        if not report.failures:
            _check_reasoning(config, tokenizer, engine, report)
        rebuilt = [g for g in report.generations if g.raw.get("rebuilt_from_text")]
        if rebuilt:
            report.warnings.append(
                "the server returned no token ids: records are rebuilt from its text and "
                "re-tokenized (token_exact=False); the vllm or sglang engine gives exact ids"
            )
    report.elapsed_s = time.monotonic() - started
    return report


def run_canary(
    config: PipelineConfig,
    tokenizer: Any,
    prompts: list[Prompt],
    engine: HTTPEngine | None = None,
    api_key: str | None = None,
) -> CanaryReport:
    """Send `generation.canary_requests` of `prompts` through the configured engine and check
    the answers (see the module docstring). Never raises for a broken server: the report
    lists the failures (`report.raise_if_failed()` turns them into a `CanaryError`)."""
    return run_sync(run_canary_async(config, tokenizer, list(prompts), engine, api_key))
