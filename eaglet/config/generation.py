"""`generation`: how the target answers: the engine and its servers, sampling (and the
sampling plan's entries, `SamplingChoice`), limits, the loop guard, retries and the canary
(`GenerationConfig`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from eaglet.config_fields import CACHE_NEUTRAL, BaseUrl, Strict


class SamplingChoice(Strict):
    """One entry of generation.sampling_plan: the sampling a share of the rows is generated
    with."""

    model_config = ConfigDict(title="Sampling choice")  # the UI form's heading

    temperature: float = Field(0.6, ge=0.0, le=10.0, description="0 = greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    reasoning_effort: Literal["", "low", "medium", "high"] = Field(
        "",
        description="For models whose chat template reads it (gpt-oss): rendered into these "
        "rows' prompts as the template argument reasoning_effort; blank = the template's "
        "default (or tokenize.chat_template_kwargs).",
    )
    weight: float = Field(
        1.0, gt=0.0, le=1e6, description="With sampling_plan_mode weighted: its share's weight."
    )


class GenerationConfig(Strict):
    model_config = ConfigDict(title="Generation")  # the UI form's heading

    engine: Literal["local", "vllm", "sglang", "openai"] = Field(
        "local", description="local = transformers in-process; the others are HTTP servers."
    )
    endpoints: list[BaseUrl] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        description="Base URLs of the inference servers (HTTP engines); http://host:port and "
        "http://host:port/v1 name the same server.",
        json_schema_extra=CACHE_NEUTRAL,
    )
    served_model: str = Field(
        "tiny",
        description="Model name the server expects (HTTP engines).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    max_tokens: int = Field(256, ge=1, le=1_000_000, description="Maximum output tokens.")
    temperature: float = Field(0.0, ge=0.0, le=10.0, description="0 = greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int = Field(0, description="Sampling seed.")
    sampling_plan: list[SamplingChoice] = Field(
        default_factory=list,
        description="Varied sampling: each row is generated with one entry (temperature, "
        "top_p, reasoning_effort) chosen when it is tokenized, recorded in its prompt and "
        "generation records and counted per entry in the quality report; a resume sends the "
        "same. Empty = every row with temperature and top_p above.",
    )
    sampling_plan_mode: Literal["cycle", "weighted"] = Field(
        "cycle",
        description="cycle = the entries in turn, in the order of the samples; weighted = an "
        "entry drawn per sample id (seeded by seed) in proportion to the weights.",
    )
    stop: list[str] = Field(default_factory=list, description="Extra stop strings.")
    loop_guard: bool = Field(
        True,
        description="Stop an answer that repeats itself: the HTTP engines (vllm, sglang, "
        "openai) stream each answer and end the request once one n-gram of loop_ngram tokens "
        "has occurred loop_repeats times, recording finish_reason 'loop' with the ids so far "
        "(reasoning.looped_rows says whether extract keeps them); the local engine ends such a "
        "row of its batch the same way. Off: every answer runs to its end or max_tokens, "
        "unstreamed.",
    )
    loop_ngram: int = Field(32, ge=2, le=4096, description="Loop guard: tokens per n-gram.")
    loop_repeats: int = Field(
        8, ge=2, le=10_000, description="Loop guard: occurrences of one n-gram that stop it."
    )
    concurrency: int = Field(
        128,
        ge=1,
        le=100_000,
        description="Requests in flight (HTTP).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    batch_size: int = Field(
        16,
        ge=1,
        le=4096,
        description="Prompts per batch (local engine).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable that holds the server's API key, sent as "
        "'Authorization: Bearer'. The key itself never goes in the config (HTTP engines).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    api_key_secret: str | None = Field(
        None,
        description="Name of a Prefect Secret block that holds the server's API key, read by "
        "the generate task on the worker; an alternative to api_key_env (HTTP engines).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    request_timeout_s: float = Field(
        1800.0,
        gt=0.0,
        le=86_400.0,
        description="Seconds one request may take in all (connect + generate + read) before it "
        "is abandoned and retried. Long reasoning answers need minutes (HTTP engines).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    max_retries: int = Field(
        5,
        ge=0,
        le=100,
        description="Retries of one request after connection errors, timeouts, 429 and 5xx; "
        "other 4xx answers are never retried (HTTP engines).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    retry_backoff_s: float = Field(
        1.0,
        ge=0.0,
        le=600.0,
        description="Base of the exponential backoff between retries (full jitter: a random "
        "wait up to base * 2^attempt, at most 60 s); a 429's Retry-After wins (HTTP engines).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    max_failure_fraction: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="The generate stage fails when more than this fraction of prompts failed "
        "for good; failed prompts are listed in failed.jsonl and retried by a rerun.",
        json_schema_extra=CACHE_NEUTRAL,
    )
    canary_requests: int = Field(
        4,
        ge=1,
        le=64,
        description="Real requests the preflight canary (eaglet doctor, and the generate stage "
        "before its run) sends to check the server's answers.",
        json_schema_extra=CACHE_NEUTRAL,
    )
    canary_timeout_s: float = Field(
        45.0,
        gt=0.0,
        le=3600.0,
        description="The canary's whole budget in seconds: health checks and its requests "
        "(each also capped by request_timeout_s) end by then, so a server that accepts "
        "connections and never answers fails the canary within this time (HTTP engines).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    canary_max_tokens: int = Field(
        512,
        ge=16,
        le=1_000_000,
        description="Output tokens per canary request: min(max_tokens, this). Answers cut "
        "here are not judged on their closing tag; raise it for a model that thinks long "
        "(and canary_timeout_s with it) (HTTP engines).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    canary_accept_text_only: bool = Field(
        False,
        description="Let the canary pass a server that returns text but no token ids (openai "
        "engine): records are then rebuilt from text and re-tokenized, not token-exact. Off: "
        "most canary answers without ids fail the canary (HTTP engines).",
        json_schema_extra=CACHE_NEUTRAL,
    )

    @model_validator(mode="after")
    def _one_key_source(self) -> GenerationConfig:
        if self.api_key_env and self.api_key_secret:
            raise ValueError(
                "set api_key_env or api_key_secret, not both: they name two sources for one key"
            )
        return self
