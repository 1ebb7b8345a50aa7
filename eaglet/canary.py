"""The preflight canary: a handful of real requests that prove a server setup before a long run.

`run_canary(config, tokenizer, prompts)` checks, in order, stopping at the first broken layer:

1. every endpoint answers (and, where it lists models, serves `generation.served_model`);
2. `generation.canary_requests` prompts go through the configured engine and come back;
3. the server saw the same prompt token ids as eaglet;
4. (openai engine) the server returned token ids, not only text to re-tokenize;
5. (openai engine) the thinking did not land in `content` because no reasoning parser ran;
6. the answers have the closing think token where the reasoning format requires one;
7. reasoning text the server split out agrees with eaglet's split of the token ids.

Its own limits, whatever the run's: the whole canary (health checks and requests) ends within
`generation.canary_timeout_s` (default 45 s); each request asks for at most
`min(generation.max_tokens, generation.canary_max_tokens)` tokens (default 512), may take at
most `min(request_timeout_s, canary_timeout_s)`, and is retried at most once, inside the same
budget. A server that accepts connections and never answers therefore fails the canary in
`canary_timeout_s`, not in `request_timeout_s` (default 1800 s) per try.

It judges the setup, not the model's quirks: checks 3 to 7 fail only when the problem is
systematic, i.e. shown by more than half of the answers judged (`SYSTEMATIC_SHARE`); a problem in
fewer answers (one of four answers never closed its reasoning) is a warning and left to the
extract stage's quality gate, which counts it over the whole data. Answers cut at the canary's
own token limit are not judged on their closing tag.

Every failure says what is wrong and how to fix it, and the report keeps one raw server
response for a person to look at (`eaglet doctor` prints it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from eaglet.config import PipelineConfig
from eaglet.engines.http import HTTPEngine, server_message
from eaglet.engines.registry import ENGINES, engine_spec, make_engine
from eaglet.errors import PermanentError
from eaglet.extract import LEAKED_THINKING, server_reasoning_text
from eaglet.generation import Failure, run_sync
from eaglet.reasoning import THINK_CLOSE, ReasoningFormat, detect_format
from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt
from eaglet.stages import SERVER_DISAGREEMENTS_FILE

REACH_TIMEOUT_S = 10.0  # a health check's own limit, inside the canary's budget
# More than this share of the answers judged showing a problem fails the canary; fewer is a
# warning (a model's quirk on one prompt, for the quality gate to count over the whole data).
SYSTEMATIC_SHARE = 0.5
PARSER_HINT = (
    "server returned the thinking text inside `content`: start it with --reasoning-parser, "
    "or use the vllm/sglang engine which splits from token ids"
)


class CanaryError(PermanentError, RuntimeError):
    """The canary found a broken setup; the message lists every problem and its fix. Like
    every `PermanentError` it is never retried, and the advice says so: Retry with the same
    parameters fails the same way (a server that did not answer included: the run fails
    fast, naming the endpoint to fix or start)."""


@dataclass
class CanaryReport:
    engine: str
    endpoints: list[str]
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)  # checks that held, for display
    unreachable: int = 0  # how many of the failures are a server that did not answer
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
        if not self.failures:
            return
        server_down = self.unreachable == len(self.failures)  # no raw response to show
        hint = "" if server_down else "\n(`eaglet doctor CONFIG` shows one raw server response)"
        raise CanaryError("preflight canary failed:\n  " + "\n  ".join(self.failures) + hint)


def _shorten(value: Any, max_ids: int) -> Any:
    """Long token id lists cut for display."""
    if isinstance(value, dict):
        return {k: _shorten(v, max_ids) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > max_ids and all(isinstance(v, int) for v in value):
            return [*value[:max_ids], f"... {len(value)} ids in all"]
        return [_shorten(v, max_ids) for v in value]
    return value


def canary_limits(config: PipelineConfig) -> tuple[int, float]:
    """(max_tokens, per-request timeout in seconds) of a canary request."""
    gen = config.generation
    return (
        min(gen.max_tokens, gen.canary_max_tokens),
        min(gen.request_timeout_s, gen.canary_timeout_s),
    )


def _canary_config(config: PipelineConfig, n: int) -> PipelineConfig:
    max_tokens, timeout_s = canary_limits(config)
    generation = config.generation.model_copy(
        update={
            "max_retries": min(config.generation.max_retries, 1),
            "concurrency": max(1, n),
            "max_tokens": max_tokens,
            "request_timeout_s": timeout_s,
        }
    )
    return config.model_copy(update={"generation": generation})


def repeated_tail_token(generations: list[Generation], tail: int = 16) -> int | None:
    """The token every answer ends in, `tail` times over (a degenerate target: token 0
    forever, say); None when any answer ends otherwise or is shorter."""
    ends = set()
    for generation in generations:
        last = generation.output_ids[-tail:]
        if len(last) < tail or len(set(last)) != 1:
            return None
        ends.add(last[0])
    return ends.pop() if len(ends) == 1 else None


def systematic(count: int, judged: int) -> bool:
    """A problem shown by more than `SYSTEMATIC_SHARE` of the answers judged is the setup's."""
    return judged > 0 and count > SYSTEMATIC_SHARE * judged


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
        spec = ENGINES.get(engine)
        served = spec.engine_class() if spec and spec.needs_server else None
        path = getattr(served, "request_path", "") or "such"
        return (
            f"the server has no {path} path: check generation.endpoints and "
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


async def _check_endpoints(engine: HTTPEngine, report: CanaryReport, deadline: float) -> None:
    """Each endpoint answers its health path (within `REACH_TIMEOUT_S` and before
    `deadline`, a `time.monotonic()` value); an OpenAI model list names served_model."""
    served = engine.config.generation.served_model
    async with engine.open_pool() as pool:
        for endpoint in pool.endpoints:
            where = f"{endpoint.url}{engine.health_path}"
            limit = max(0.1, min(REACH_TIMEOUT_S, deadline - time.monotonic()))
            try:
                async with asyncio.timeout(limit):
                    response = await endpoint.client.get(engine.health_path)
            except (TimeoutError, engine.http.TimeoutException) as exc:
                report.failures.append(
                    f"endpoint {endpoint.url} did not answer GET {where} within {limit:.0f} s "
                    f"({type(exc).__name__}): it accepts connections but does not answer "
                    "(hung, overloaded or still loading?): check the server's log, or fix "
                    "generation.endpoints"
                )
                report.unreachable += 1
                continue
            except engine.http.TransportError as exc:
                report.failures.append(
                    f"endpoint {endpoint.url} is not reachable ({type(exc).__name__} on GET "
                    f"{where}): start the server, or fix generation.endpoints"
                )
                report.unreachable += 1
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


def _ids_list(generations: list[Generation]) -> list[str]:
    return [g.sample_id for g in generations]


def _check_prompt_ids(engine: str, generations: list[Generation], report: CanaryReport) -> None:
    """The server saw eaglet's prompt ids (where it says which ids it saw)."""
    judged = [g for g in generations if isinstance(g.raw.get("server_prompt_token_ids"), list)]
    judged += [g for g in generations if g.token_exact and g not in judged]
    mismatched = [g for g in generations if g.raw.get("prompt_ids_mismatch")]
    if not mismatched:
        if any(g.token_exact for g in generations):
            report.passed.append("the server saw eaglet's prompt token ids")
        return
    g = mismatched[0]
    theirs = g.raw.get("server_prompt_token_ids")
    detail = ""
    if isinstance(theirs, list):
        first = next(
            (i for i, (a, b) in enumerate(zip(theirs, g.prompt_ids, strict=False)) if a != b),
            min(len(theirs), len(g.prompt_ids)),
        )
        detail = (
            f": sample {g.sample_id}: the server has {len(theirs)} prompt ids, eaglet "
            f"{len(g.prompt_ids)}, first difference at position {first}"
        )
    fix = (
        "the server renders the chat template differently: give it the target's template "
        "(--chat-template) and the same tokenize.chat_template_kwargs, or use the vllm "
        "engine, which sends eaglet's token ids"
        if engine == "openai"
        else "the server changed the token ids it was sent (e.g. added a BOS token): "
        "check the server's tokenizer settings"
    )
    line = (
        f"{len(mismatched)} of {len(judged)} answers: the server saw other prompt token ids "
        f"than eaglet (samples {_ids_list(mismatched)}){detail}; {fix}"
    )
    if systematic(len(mismatched), len(judged)):
        report.failures.append(line)
    else:
        report.warnings.append(f"{line} (sporadic: the extract stage counts template mismatches)")


def _check_token_ids(config: PipelineConfig, report: CanaryReport) -> None:
    """(openai engine) Answers came with token ids, not only text to re-tokenize."""
    generations = report.generations
    rebuilt = [g for g in generations if g.raw.get("rebuilt_from_text")]
    if not rebuilt:
        return
    line = (
        f"{len(rebuilt)} of {len(generations)} answers came without token ids (samples "
        f"{_ids_list(rebuilt)}): their records would be rebuilt from text and re-tokenized "
        "(token_exact=False), which may not be the tokens the model wrote"
    )
    if systematic(len(rebuilt), len(generations)) and not config.generation.canary_accept_text_only:
        report.failures.append(
            f"{line}: use the vllm or sglang engine (exact ids), or a vLLM that honours "
            "return_token_ids, or set generation.canary_accept_text_only=true to train on "
            "re-tokenized text"
        )
    else:
        report.warnings.append(f"{line}; the vllm or sglang engine gives exact ids")


def _check_reasoning(
    config: PipelineConfig, tokenizer: Any, engine: HTTPEngine, report: CanaryReport
) -> None:
    """Checks 5 to 7 on the answers, stopping at the first that fails."""
    try:
        reasoning_format = detect_format(
            tokenizer, config.reasoning.format, config.tokenize.chat_template_kwargs
        )
    except ValueError as exc:
        report.failures.append(f"{exc}: set reasoning.format to auto or none")
        return
    check = _ReasoningCheck(config, tokenizer, engine, report, reasoning_format)
    check.warn_cut_answers()
    if engine.name == "openai" and reasoning_format.reasons and not check.content_is_clean():
        return
    if reasoning_format.reasons and not check.reasoning_closes():
        return
    check.server_split_agrees()


class _ReasoningCheck:
    """The reasoning checks of `_check_reasoning`, over the report's answers; a check that
    returns False ends them (a failure, or nothing left to judge)."""

    def __init__(
        self,
        config: PipelineConfig,
        tokenizer: Any,
        engine: HTTPEngine,
        report: CanaryReport,
        reasoning_format: ReasoningFormat,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.report = report
        self.format = reasoning_format
        self.max_tokens, _ = canary_limits(config)
        self.capped = self.max_tokens < config.generation.max_tokens  # the canary's own limit
        self.end_ids = set(engine.end_ids or [])
        self.generations = report.generations
        self.finished = [g for g in self.generations if g.finish_reason == "stop"]

    def warn_cut_answers(self) -> None:
        """A warning for the answers cut at the token limit (not those the loop guard ended:
        `_none_finished` and the quality gate say those)."""
        cut = [g for g in self.generations if g.finish_reason == "length"]
        if cut:
            limit_name = "generation.canary_max_tokens" if self.capped else "generation.max_tokens"
            self.report.warnings.append(
                f"{len(cut)} of {len(self.generations)} answers hit {limit_name}={self.max_tokens}"
            )

    def content_is_clean(self) -> bool:
        """(openai engine) Check 5: the thinking did not land in `content`."""
        leaked = [g for g in self.generations if _thinking_in_content(g, self.format, self.end_ids)]
        judged = len(self.finished) + sum(g.finish_reason != "stop" for g in leaked)
        if systematic(len(leaked), judged):
            self.report.failures.append(f"{PARSER_HINT} (samples {_ids_list(leaked)})")
            return False
        if leaked:
            self.report.warnings.append(
                f"{len(leaked)} of {judged} answers have thinking text in `content` (samples "
                f"{_ids_list(leaked)}); sporadic, so not the server's setup: the extract stage "
                "counts it (reasoning.max_thinking_in_content_rate)"
            )
        return True

    def reasoning_closes(self) -> bool:
        """Check 6: the finished answers close their reasoning."""
        if not self.finished:
            self._none_finished()
            return False
        unclosed = [
            g
            for g in self.finished
            if not self.format.split(g.output_ids, self.end_ids).reasoning_closed
        ]
        line = (
            f"{len(unclosed)} of {len(self.finished)} finished answers have no closing "
            f"{THINK_CLOSE} token (samples {_ids_list(unclosed)}), yet reasoning.format is "
            f"{self.format.name}"
        )
        if systematic(len(unclosed), len(self.finished)):
            self.report.failures.append(
                f"{line}: check tokenize.chat_template_kwargs (e.g. enable_thinking) and "
                "reasoning.format, and that the server does not strip the tag from its output"
            )
            return False
        if unclosed:
            self.report.warnings.append(
                f"{line}; sporadic, so not the setup: the quality gate counts it over the "
                "whole data (reasoning.min_capture_rate)"
            )
        else:
            self.report.passed.append(
                f"every finished answer closes its reasoning with {THINK_CLOSE} "
                f"(format {self.format.name})"
            )
        return True

    def _none_finished(self) -> None:
        """No answer ended: stopped by the loop guard, or degenerate (one token over and over)
        whatever the limit, a failure that says a longer limit will not help; otherwise cut at
        the token limit, a warning at the canary's own limit and a failure at the run's."""
        looped = [g for g in self.generations if g.finish_reason == "loop"]
        repeated = repeated_tail_token(self.generations)
        if looped or repeated is not None:
            lengths = sorted(len(g.output_ids) for g in (looped or self.generations))
            how = (
                f"{len(looped)} of {len(self.generations)} answers were stopped by the loop "
                f"guard (finish_reason loop, after {lengths[0]}-{lengths[-1]} tokens)"
                if looped
                else f"all {len(self.generations)} answers ran to the token limit"
            )
            if repeated is not None:
                how += (
                    f"; they end in token {repeated} ({self.tokenizer.decode([repeated])!r}) "
                    "over and over"
                )
            generation, defaults = self.config.generation, type(self.config.generation)()
            guard = f"generation.loop_ngram={generation.loop_ngram}, loop_repeats=" + str(
                generation.loop_repeats
            )
            tight = generation.loop_ngram * generation.loop_repeats < (
                defaults.loop_ngram * defaults.loop_repeats
            )
            if looped and repeated is None and tight:  # the guard's own settings, first
                self.report.failures.append(
                    f"no answer finished: {how}. The loop guard's own settings ({guard}: "
                    f"{generation.loop_ngram * generation.loop_repeats} tokens of repeats, "
                    f"against the defaults' {defaults.loop_ngram} x {defaults.loop_repeats}) "
                    "stop ordinary text, which repeats short n-grams: raise loop_ngram and "
                    "loop_repeats (or set them back to their defaults) before blaming the target"
                )
                return
            self.report.failures.append(
                f"no answer finished: {how}, so the closing {THINK_CLOSE} cannot be checked. "
                "A longer generation.max_tokens will not help: the target repeats itself. "
                "Check the target's weights and target.dtype, the chat template "
                "(tokenize.chat_template_kwargs) and the sampling (generation.temperature); "
                f"the loop guard stops at {guard}"
            )
            return
        if self.capped:
            self.report.warnings.append(
                f"all {len(self.generations)} answers reached the canary's "
                f"generation.canary_max_tokens={self.max_tokens} before the end, so the closing "
                f"{THINK_CLOSE} was not checked: raise generation.canary_max_tokens (and "
                "generation.canary_timeout_s) to check it; the quality gate counts it"
            )
            return
        self.report.failures.append(
            f"all {len(self.generations)} answers hit generation.max_tokens="
            f"{self.config.generation.max_tokens} before the end, so the closing {THINK_CLOSE} "
            "cannot be checked: raise generation.max_tokens"
        )

    def server_split_agrees(self) -> None:
        """Check 7: reasoning text the server split out agrees with eaglet's token split."""
        disagreements, compared = self._disagreements()
        if disagreements:
            sample_id, theirs, ours = disagreements[0]
            line = (
                f"{len(disagreements)} of {compared} answers: the server's reasoning text "
                f"differs from eaglet's split of the token ids (sample {sample_id}: server "
                f"{theirs[:80]!r}, tokens {ours[:80]!r})"
            )
            if systematic(len(disagreements), compared):
                self.report.failures.append(
                    f"{line}: the server's --reasoning-parser does not match the model (check "
                    "reasoning.format too); eaglet trains on its own token split"
                )
            else:
                self.report.warnings.append(
                    f"{line}; sporadic: extract lists every one in {SERVER_DISAGREEMENTS_FILE}"
                )
        elif compared:
            self.report.passed.append(
                "the server's reasoning text agrees with eaglet's token split"
            )

    def _disagreements(self) -> tuple[list[tuple[str, str, str]], int]:
        """(sample id, server text, eaglet's text) where they differ, and how many compared."""
        disagreements = []
        compared = 0
        for g in self.finished:  # parsers differ on unclosed reasoning: compare finished only
            server_text = server_reasoning_text(g.raw)
            if server_text is None:
                continue
            compared += 1
            split = self.format.split(g.output_ids, self.end_ids)
            ours = self.tokenizer.decode(split.ids("reasoning")).strip()
            if server_text.strip() != ours:
                disagreements.append((g.sample_id, server_text.strip(), ours))
        return disagreements, compared


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


async def _collect(
    engine: HTTPEngine, prompts: list[Prompt], report: CanaryReport, deadline: float
) -> list[Failure]:
    """Send `prompts`; records go to the report, failures are returned. Requests still open
    at `deadline` are abandoned: none answered fails the canary, some is a warning."""
    failures: list[Failure] = []
    budget = engine.config.generation.canary_timeout_s
    try:
        async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
            # an async generator, annotated as an iterator in eaglet/engines/http.py (an edit
            # there, if only a type, would re-key what HTTP engines generated)
            items_of = engine.generate_async(prompts)
            async with aclosing(items_of) as items:  # type: ignore[type-var]
                async for item in items:
                    if isinstance(item, Failure):
                        failures.append(item)
                    else:
                        report.generations.append(item)
    except TimeoutError:
        done = {g.sample_id for g in report.generations} | {f.sample_id for f in failures}
        pending = [p.sample_id for p in prompts if p.sample_id not in done]
        line = (
            f"{len(pending)} of {len(prompts)} canary requests got no answer within "
            f"generation.canary_timeout_s={budget:g} s (samples {pending})"
        )
        if report.generations:
            report.warnings.append(f"{line}; judging the {len(report.generations)} that did")
        else:
            max_tokens, _ = canary_limits(engine.config)
            report.failures.append(
                f"{line}: the server accepts the requests but does not answer (hung, "
                "overloaded, still loading?), or it cannot write "
                f"{max_tokens} tokens in that time: check the server's log, or raise "
                "generation.canary_timeout_s / lower generation.canary_max_tokens"
            )
    return failures


async def run_canary_async(
    config: PipelineConfig,
    tokenizer: Any,
    prompts: list[Prompt],
    engine: HTTPEngine | None = None,
    api_key: str | None = None,
) -> CanaryReport:
    """The canary's checks; see `run_canary`."""
    started = time.monotonic()
    deadline = started + config.generation.canary_timeout_s
    n = min(len(prompts), config.generation.canary_requests)
    report = CanaryReport(config.generation.engine, list(config.generation.endpoints))
    if not engine_spec(config.generation.engine).needs_server:
        report.passed.append("the local engine runs in-process: no server to check")
        return report
    if n == 0:
        report.failures.append("no prompts to send: the canary needs at least one prompt")
        return report
    try:
        if engine is None:
            made = make_engine(_canary_config(config, n), tokenizer, api_key=api_key)
            assert isinstance(made, HTTPEngine), "an engine that needs a server speaks HTTP"
            engine = made
        else:  # the caller's engine, with the canary's limits
            engine = dataclasses.replace(engine, config=_canary_config(engine.config, n))
    except (ValueError, OSError) as exc:
        report.failures.append(str(exc))
        return report
    await _check_endpoints(engine, report, deadline)
    if report.failures:
        report.elapsed_s = time.monotonic() - started
        return report
    failures = await _collect(engine, prompts[:n], report, deadline)
    report.sample_response = engine.sample_response
    # Refusals of most requests are the setup's; one refused prompt (too long, say) is the
    # prompt's, and the generate stage lists it in failed.jsonl.
    refused = report.failures if systematic(len(failures), n) else report.warnings
    for failure in failures[:3]:
        refused.append(
            f"sample {failure.sample_id}: {failure.message}; {_failure_hint(engine.name, failure)}"
        )
    if report.generations and not failures and not report.failures:
        report.passed.append(f"{len(report.generations)} requests answered")
    if report.generations and not report.failures:
        _check_prompt_ids(engine.name, report.generations, report)
        if not report.failures:
            _check_reasoning(config, tokenizer, engine, report)
        if not report.failures:
            _check_token_ids(config, report)
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


def dataset_prompts(config: PipelineConfig, tokenizer: Any) -> tuple[list[Prompt], list[str]]:
    """The first `generation.canary_requests` samples of the datasets rendered as prompts,
    for a canary before any run has tokenized them (`eaglet doctor`); and the problems met,
    one line each naming the dataset."""
    from eaglet.datasets import read_samples
    from eaglet.prompt_rendering import render_prompt

    problems: list[str] = []
    prompts: list[Prompt] = []
    wanted = config.generation.canary_requests
    for i, spec in enumerate(config.datasets):
        if len(prompts) >= wanted:
            break
        try:
            for sample in read_samples(spec.model_copy(update={"limit": wanted})):
                prompts.append(
                    render_prompt(sample, tokenizer, config.tokenize.chat_template_kwargs)
                )
        except Exception as exc:  # DatasetError, PromptError, a template that raises
            problems.append(f"datasets[{i}] (source {spec.source!r}): {exc}")
    return prompts[:wanted], problems
