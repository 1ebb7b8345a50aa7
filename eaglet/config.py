"""The pipeline's configuration: one pydantic model, `PipelineConfig`, and how to load it.

`PipelineConfig` is the flow's parameter (the Prefect UI renders it as a form) and loads from
YAML with `--set a.b=value` overrides. Every model forbids unknown keys, so a typo is an error
that names the key instead of a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from eaglet.config_fields import CACHE_NEUTRAL, BaseUrl, Strict, is_local_path
from eaglet.config_fields import bounds_text as bounds_text  # re-exported (docs, tests)
from eaglet.config_fields import is_cache_neutral as is_cache_neutral  # re-exported
from eaglet.draft.methods import MethodName
from eaglet.errors import PermanentError
from eaglet.hidden_states.backends import BACKENDS, BackendName, hidden_states_backend
from eaglet.local_paths import absolute, is_hub_dataset, is_hub_id


class ConfigError(PermanentError, ValueError):
    """A configuration file or override that cannot be used; the message says where and why."""


class DatasetSpec(Strict):
    model_config = ConfigDict(title="Dataset")  # the UI form's heading

    source: str = Field(
        description="Tag carried into every record (e.g. 'arith', 'glaive'): letters, digits, "
        "'.', '_' and '-', not starting with '.' (it may name files, so never a path).",
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]*$",
    )
    path: str = Field(
        description="Hugging Face hub dataset id, or a local .json/.jsonl/.parquet file.",
    )
    split: str = Field("train", description="Dataset split to read.")
    limit: int | None = Field(None, ge=1, description="Read at most this many rows (blank: all).")
    revision: str | None = Field(None, description="Hub revision (commit or tag) to pin.")
    name: str | None = Field(None, description="Hub dataset config name, if any.")


class TargetConfig(Strict):
    model_config = ConfigDict(title="Target model")  # the UI form's heading

    model: str = Field(
        "runs/demo/models/fixture", description="Target model: a local folder or a hub model id."
    )
    trust_remote_code: bool = Field(
        False, description="Allow the model's own Python code to run. Only for models you trust."
    )
    revision: str | None = Field(None, description="Hub revision to pin (hub ids only).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype the embedded engine, feature extraction, training and the vLLM "
        "servers eaglet starts load the target in. auto = bfloat16 on a CUDA GPU that computes "
        "in it (float16 on one that does not), float32 on the CPU (most CPUs emulate "
        "bfloat16). Stage keys hold the dtype auto picked.",
    )
    device: str = Field(
        "auto",
        description="Device the stages that run the target in-process load it on: auto = the "
        "first CUDA GPU when there is one, else cpu; or cpu, cuda, cuda:1, ...",
    )


class TokenizeConfig(Strict):
    model_config = ConfigDict(title="Tokenize (chat template)")  # the UI form's heading

    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments for apply_chat_template (e.g. enable_thinking).",
    )
    max_prompt_tokens: int = Field(
        768, ge=8, description="Prompts longer than this are dropped and counted in the manifest."
    )
    regenerate: Literal["last", "all"] = Field(
        "last",
        description="Which assistant turns to regenerate: 'last' drops the final assistant turn "
        "and asks the target to answer the conversation so far; 'all' regenerates every "
        "assistant turn in order, feeding the target its own earlier answers (one training "
        "example per turn).",
    )


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


class ReasoningConfig(Strict):
    model_config = ConfigDict(title="Reasoning split")  # the UI form's heading

    format: Literal["auto", "think_open_in_prompt", "think_in_output", "harmony", "none"] = Field(
        "auto",
        description="How the target marks its reasoning. auto = detect from the tokenizer and "
        "chat template; think_open_in_prompt = the prompt ends with <think> (Qwen3-thinking, "
        "DeepSeek-R1); think_in_output = the model writes <think> itself (Qwen3 hybrid); "
        "harmony = gpt-oss analysis/final channels; none = no reasoning.",
    )
    min_capture_rate: float = Field(
        0.8,
        ge=0.0,
        le=1.0,
        description="Quality gate: fail when, in any source, fewer records than this have "
        "their reasoning split out and closed (formats that reason; truncated records are "
        "judged by max_truncation_rate). 0.8 lets a model's sporadic quirk pass (the demo's "
        "2M-parameter target leaves about one tool answer in eight unclosed) and stops a "
        "systematic fault (a stripped tag or wrong template kwargs capture ~0%).",
    )
    max_truncation_rate: float = Field(
        0.2, ge=0.0, le=1.0, description="Quality gate: fail when more records hit max_tokens."
    )
    looped_rows: Literal["drop", "keep"] = Field(
        "drop",
        description="Records the loop guard stopped (finish_reason 'loop'): drop = no "
        "training example (counted as looped in the quality report); keep = train on the "
        "answer up to where it was stopped, like a truncated one.",
    )
    max_thinking_in_answer_rate: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="Quality gate: fail when, in any source, more records than this have no "
        "reasoning split out yet think tags in the answer (the seeds' signature: thinking "
        "trained as the answer, e.g. reasoning.format or chat_template_kwargs wrong).",
    )
    max_prompt_mismatch_rate: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="Quality gate: fail when, in any source, more records than this were "
        "generated from other prompt ids than the configured chat template renders (a server "
        "that rendered with its own template or kwargs, as in SpecForge #296).",
    )


# The keys hidden_states held itself before each backend had its section (issue 35), and the
# backend whose section holds each now. Older configs still write them flat: they are read into
# the section, and a stage key holds them flat, as it did (eaglet.cache). Never extended: a new
# backend's keys live in its section only.
FLAT_BACKEND_KEYS: dict[str, str] = {
    "device_map": "hf",
    **dict.fromkeys(
        ("endpoints", "connector_path", "served_model", "concurrency", "request_timeout_s",
         "vllm_python", "vllm_args", "startup_timeout_s"),
        "vllm",
    ),
}  # fmt: skip


class _HiddenStatesSettings(Strict):
    """`hidden_states` but the backends' sections, which `HiddenStatesConfig` adds, one per
    backend of the registry (`eaglet.hidden_states.backends`)."""

    model_config = ConfigDict(title="Hidden states")  # the UI form's heading

    aux_layer_ids: list[int] | None = Field(
        None,
        description="Target layers whose states feed the draft, in the vLLM/speculators "
        "convention (id i = HF hidden_states[i], the input of layer i; 0 = the embeddings, "
        "which SGLang's convention cannot name). Blank (null) = (2, N//2, N-3).",
    )
    shard_tokens: int = Field(
        65536, ge=256, description="Tokens per safetensors shard before a new one is started."
    )
    batch_size: int = Field(
        8,
        ge=1,
        le=1024,
        description="Sequences per target forward.",
        json_schema_extra=CACHE_NEUTRAL,
    )
    batch_tokens: int = Field(
        16384,
        ge=16,
        le=10_000_000,
        description="Padded tokens per target forward at most (hf backend): batches are "
        "bucketed by length, so padding stays small.",
        json_schema_extra=CACHE_NEUTRAL,
    )
    storage: Literal["float32", "bfloat16", "int8", "fp8"] = Field(
        "int8",
        description="How feature values are stored: float32 (16·H bytes per token), bfloat16 "
        "(8·H), int8 or fp8 with per-token absmax scales (4·H). int8 is the default: half of "
        "bf16's bytes; benchmarks/hidden_states.py measured 0.7% relative error and 99.7% of "
        "the target's greedy tokens unchanged against float32 on the fixture (fp8: 2.6%, 99.2%).",
    )
    backend: BackendName = Field(
        "hf",
        description="What computes the target's states; its settings are the section of its "
        "name: hf = transformers in-process (target.device, target.dtype; hidden_states.hf); "
        "vllm = vLLM servers started with the extract_hidden_states speculative method and a "
        "hidden-states KV connector (hidden_states.vllm; see the README). Older configs' keys "
        "of a backend written in hidden_states itself (hidden_states.endpoints, "
        "hidden_states.vllm_python, hidden_states.device_map, ...) are still read into its "
        "section.",
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_into_sections(cls, data: Any) -> Any:
        """An older config's backend key written in hidden_states itself (FLAT_BACKEND_KEYS)
        moves into its backend's section; written in both places with two values, it is an
        error (which would win is anybody's guess)."""
        if not isinstance(data, dict) or not any(key in data for key in FLAT_BACKEND_KEYS):
            return data
        data = dict(data)
        for key in [key for key in data if key in FLAT_BACKEND_KEYS]:
            name, value = FLAT_BACKEND_KEYS[key], data.pop(key)
            section = data.get(name)
            if isinstance(section, BaseModel):
                section = section.model_dump(exclude_unset=True)
            section = dict(section or {})
            if key in section and section[key] != value:
                raise ValueError(
                    f"hidden_states.{key} (the older spelling) and hidden_states.{name}.{key} "
                    f"are both set, to {value!r} and {section[key]!r}: keep "
                    f"hidden_states.{name}.{key}"
                )
            section[key] = value
            data[name] = section
        return data

    @model_validator(mode="after")
    def _chosen_backend_can_run(self) -> _HiddenStatesSettings:
        problem = getattr(self, self.backend).problem_when_chosen()
        if problem:
            raise ValueError(problem)
        return self


def _backend_section(name: str) -> tuple[type, Any]:
    settings = hidden_states_backend(name).settings
    description = " ".join((settings.__doc__ or "").split())
    return settings, Field(default_factory=settings, description=description)


# `hidden_states`: the settings above and one section per backend of the registry, named as the
# backend and typed as its `settings` (hidden_states.vllm: eaglet.hidden_states.backends.vllm.
# VllmSettings). Built from the registry, so that adding a backend edits no line here.
HiddenStatesConfig = create_model(
    "HiddenStatesConfig",
    __base__=_HiddenStatesSettings,
    __doc__="The hidden_states stage's settings: layers, storage, the backend and its section.",
    __module__=__name__,
    **{name: _backend_section(name) for name in BACKENDS},
)


class DFlashSettings(Strict):
    model_config = ConfigDict(title="DFlash draft")  # the UI form's heading

    block_size: int = Field(
        5,
        ge=2,
        le=33,
        description="Tokens per block: the target's token and block_size - 1 masks, so each "
        "round drafts block_size - 1 tokens (vLLM's num_speculative_tokens; "
        "evaluate.num_speculative_tokens must equal it).",
    )
    num_layers: int = Field(
        2, ge=1, le=16, description="Draft decoder layers (2 on the demo: τ 3.56; 1: τ 1.38)."
    )
    anchors: int = Field(
        32,
        ge=1,
        le=4096,
        description="Blocks trained per sequence per step, their anchors drawn among the "
        "positions whose next token is model output.",
    )
    mask_token_id: int | None = Field(
        None,
        ge=0,
        description="The token id of the mask slots (its embedding is the target's). Blank: the "
        "target's pad token, else its last token id.",
    )


class TrainConfig(Strict):
    model_config = ConfigDict(title="Draft training")  # the UI form's heading

    method: MethodName = Field(
        "eagle3",
        description="The draft method: eagle3 (a chain of k one-token steps, training-time "
        "test), peagle (EAGLE-3 trained for vLLM's parallel_drafting: k tokens in one pass, "
        "k <= train.ttt_length) or dflash (a block of k tokens in one pass; train.dflash).",
    )
    dflash: DFlashSettings = Field(
        default_factory=DFlashSettings, description="DFlash: used with train.method=dflash."
    )
    epochs: int = Field(
        8,
        ge=1,
        le=1000,
        description="Passes over the training tokens. 8 keeps the demo short; 20 emitted 0.04 "
        "more tokens per round on 2,000 samples (benchmarks/README.md, Against speculators).",
    )
    lr: float = Field(
        3e-3,
        gt=0.0,
        le=1.0,
        description="Peak learning rate. 3e-3: with Muon, tau within 0.01 from 3e-3 to 1e-2 on "
        "2,000 samples x 4 epochs, while 1e-3 fell 0.9 tau behind on 192 x 12 "
        "(benchmarks/README.md, Against speculators).",
    )
    optimizer: Literal["adamw", "muon"] = Field(
        "muon",
        description="muon = Muon for the draft's weight matrices (update scaled to AdamW's RMS, "
        "weight decay 0.1) and AdamW for norms and lm_head, as speculators trains by default; "
        "adamw = AdamW over every weight. Muon gave +0.14 tau on 2,000 samples x 4 epochs "
        "(benchmarks/README.md, Against speculators).",
    )
    batch_size: int = Field(8, ge=1, le=4096, description="Sequences per step.")
    ttt_length: int = Field(4, ge=1, le=16, description="Training-time-test unroll steps.")
    length_buckets: bool = Field(
        False,
        description="Batch samples of about the same length (sorted within runs of 32 "
        "batches of the epoch's random order, batches shuffled). Measured before steps were "
        "split into length groups: 1.7x the tokens/s of padded batches, but a lower tau in "
        "benchmarks/training.py (3.396 against 3.554).",
    )
    draft_vocab_size: int = Field(
        32000, ge=2, description="Draft vocabulary size (capped at the distinct tokens seen)."
    )
    max_seq_len: int = Field(
        1024,
        ge=16,
        description="Training window length: a longer sample is cut into consecutive windows of "
        "this many tokens (each window keeps the features of its full prefix); nothing is "
        "dropped.",
    )
    holdout_fraction: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="Fraction of samples (by sample_id hash) kept out of training for evaluation.",
    )
    seed: int = Field(0, description="Training seed.")
    hidden_noise: float = Field(
        0.0,
        ge=0.0,
        le=100.0,
        description="Standard deviation of Gaussian noise added to every element of the aux "
        "hidden states during training (never at evaluation), as EAGLE trains its drafts to "
        "tolerate the target's numeric noise; 0 = none (speculators 0.9.0 adds none).",
    )
    keep_best: Literal["off", "loss", "tau"] = Field(
        "off",
        description="Export the epoch that was best on the held-out samples (holdout_fraction), "
        "measured at each epoch's end: loss = the lowest TTT loss (as speculators keeps its "
        "best checkpoint); tau = the highest acceptance length of the evaluator (vLLM's rounds, "
        "greedy, k = ttt_length) on keep_best_prompts held-out prompts, the loaded target "
        "checking the draft (the loss can keep falling while tau drops). Per epoch, both are "
        "in the train summary. Offline hidden states only. (true = loss, false = off.)",
    )
    keep_best_prompts: int = Field(
        8,
        ge=1,
        le=1024,
        description="With keep_best: tau, the held-out prompts the draft is evaluated on at each "
        "epoch's end (the first ones of the held-out samples).",
    )
    keep_best_max_new_tokens: int = Field(
        64,
        ge=1,
        le=4096,
        description="With keep_best: tau, the tokens generated per held-out prompt.",
    )
    intermediate_size: int | None = Field(
        None,
        ge=1,
        description="Draft MLP width; blank (null) = the target's, as published drafts do.",
    )
    init_from: str | None = Field(
        None,
        description="A trained draft to start from (fine-tuning a published one): a folder "
        "with config.json and model.safetensors in eaglet's, vLLM/EAGLE-3's, SpecForge's or "
        "speculators' format. Its shape, variants, vocabulary and weights are kept; it must "
        "read this target's hidden size, vocabulary and hidden_states.aux_layer_ids (checked "
        "before the first stage). Blank (null) = a fresh draft.",
    )
    init_from_layer_convention: Literal["auto", "vllm", "sglang"] = Field(
        "auto",
        description="The convention of the starting draft's layer ids when its config does "
        "not say (a vLLM or SpecForge checkpoint that names ids): vllm = HF hidden_states "
        "indices, sglang = outputs of layer i (one less). auto: eaglet's label, speculators' "
        "format, or EAGLE-3's default when it names none; otherwise the run is refused.",
    )
    lm_head_init: Literal["random", "target"] = Field(
        "random",
        description="Initial draft lm_head: random, or the target's lm_head rows of the draft "
        "vocabulary (trained on from there).",
    )
    norm_before_fc: bool = Field(
        False,
        description="Draft variant (speculators' eagle3 default): RMSNorm over the three aux "
        "states before fc. vLLM serves it; SGLang is not known to, so no draft-sglang export.",
    )
    norm_before_residual: bool = Field(
        False,
        description="Draft variant (speculators' eagle3 default): the decoder layer's residual "
        "is the normed hidden input. No draft-sglang export.",
    )
    norm_output: bool = Field(
        False,
        description="Draft variant (speculators' eagle3 default): each step feeds the next its "
        "post-norm state. No draft-sglang export.",
    )
    warmup_steps: int = Field(
        10, ge=0, le=1_000_000, description="Optimizer steps of linear learning-rate warmup."
    )
    lr_floor: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="After warmup the learning rate follows a cosine from the peak down to "
        "lr_floor x the peak at the last step (0 measured the same tau as 0.1 at 20 epochs: "
        "benchmarks/README.md, Against speculators).",
    )
    grad_clip: float = Field(
        1.0, gt=0.0, le=1e6, description="Maximum global gradient norm per optimizer step."
    )
    ttt_step_weight: float = Field(
        0.8, gt=0.0, le=1.0, description="Loss weight of TTT step i is ttt_step_weight ** i."
    )
    loss: Literal["kl", "tv", "kl_tv"] = Field(
        "kl",
        description="Per-position loss against the target's distribution: kl = soft "
        "cross-entropy (forward KL); tv = total variation (1 - acceptance of a sampled draft "
        "token); kl_tv = their sum.",
    )
    grad_accumulation: int = Field(
        1,
        ge=1,
        le=1024,
        description="Micro-batches per optimizer step: batch_size is split into this many "
        "pieces run one after another (same result, less memory).",
    )
    precision: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="bfloat16 = autocast the draft's matmuls to bf16 where the device supports "
        "it (falls back to float32 with a warning elsewhere); weights and optimizer stay fp32.",
    )
    device: str = Field(
        "auto",
        description="Training device: auto = the first CUDA GPU when there is one, else "
        "cpu; or cpu, cuda, cuda:1, ... (under torchrun each process takes cuda:LOCAL_RANK).",
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="torch intra-op threads per training process; blank (null) = eaglet's "
        "choice, as in every torch stage: the CPUs the process may use (affinity, cgroup "
        "quota) less those other processes keep busy when the stage starts (OMP_NUM_THREADS, "
        "when set, wins).",
        json_schema_extra=CACHE_NEUTRAL,
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        le=64,
        description="Training processes on this machine; > 1 launches torchrun (data parallel, "
        "NCCL on GPUs, gloo on CPU) with the same global batch_size.",
    )
    log_every: int = Field(10, ge=1, le=1_000_000, description="Optimizer steps per log line.")
    save_every: int = Field(
        0,
        ge=0,
        le=10_000_000,
        description="Optimizer steps between checkpoints (resume points); 0 = every epoch's end.",
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Stop (and save) after this many steps in total; blank (null) = all.",
    )
    hidden_states: Literal["offline", "online"] = Field(
        "offline",
        description="offline = train on the feature shards the hidden_states stage stored; "
        "online = skip storing them: the target computes each batch's features as training "
        "goes (no disk, more compute per epoch), in the training process when "
        "hidden_states.backend is hf, on the vLLM servers when it is vllm.",
    )
    online_prefetch: int = Field(
        4,
        ge=0,
        le=1024,
        description="Online with hidden_states.backend=vllm: micro-batches of features fetched "
        "ahead of the trainer (a bounded queue; the fetching waits when it is full). 0 = fetch "
        "each when the trainer needs it.",
    )

    @field_validator("keep_best", mode="before")
    @classmethod
    def _keep_best_from_a_switch(cls, value: Any) -> Any:
        """The earlier switch: true kept the lowest held-out loss."""
        return {True: "loss", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _keep_best_needs_held_out_shards(self) -> TrainConfig:
        if self.keep_best != "off" and self.hidden_states != "offline":
            raise ValueError(
                "train.keep_best reads the held-out samples' features from the offline shards: "
                "set train.hidden_states=offline, or train.keep_best=off"
            )
        if self.keep_best != "off" and self.holdout_fraction == 0:
            raise ValueError("train.keep_best needs held-out samples: train.holdout_fraction > 0")
        return self


class EvalSet(Strict):
    model_config = ConfigDict(title="Evaluation set")  # the UI form's heading

    name: Literal["mt-bench", "gsm8k", "math-500", "humaneval", "speed-bench", "custom"] = Field(
        description="The set's format: mt-bench (question_id, category, turns: the second turn "
        "asked after the target's own first answer), gsm8k (question), math-500 (problem), "
        "humaneval (prompt), speed-bench (category and turns or prompt), custom (any row "
        "download reads: ShareGPT or OpenAI messages, its first user turns)."
    )
    path: str = Field(
        description="A local .jsonl/.json/.parquet copy of the set in its format, or a hub "
        "dataset id (evaluate.sets names each set's own hub id and split in its docs)."
    )
    limit: int | None = Field(None, ge=1, description="At most this many prompts (blank: all).")


DEMO_EVAL_SETS = [  # the demo's evaluation sets, beside its datasets (eaglet.fixture.sample_data)
    {"name": "mt-bench", "path": "runs/demo/data/mt-bench.jsonl"},
    {"name": "gsm8k", "path": "runs/demo/data/gsm8k.jsonl"},
]


class EvaluateConfig(Strict):
    model_config = ConfigDict(title="Evaluation")  # the UI form's heading

    sets: list[EvalSet] = Field(
        default_factory=list,
        description="Named evaluation sets measured beside the held-out prompts: τ, emitted τ "
        "and acceptance per position per set and category, with the prompts' sha256. "
        "Default: the demo's two sets with the demo's datasets, else none.",
    )
    num_speculative_tokens: int = Field(
        4, ge=1, le=16, description="Draft chain length k (offline tau is also reported for 1..k)."
    )
    max_new_tokens: int = Field(128, ge=1, description="Tokens generated per held-out prompt.")
    max_prompts: int = Field(24, ge=1, description="Held-out prompts evaluated.")
    temperature: float = Field(
        0.0,
        ge=0.0,
        le=2.0,
        description="Also measure tau with the target sampled at this temperature (0 = greedy "
        "only): a greedy draft verified by vLLM's rejection rule, as a sampling server accepts "
        "it; greedy tau overstates that. The served check (serving: vllm) then samples too.",
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Top-p of the sampled target when temperature > 0 (Qwen3 with thinking: "
        "temperature 0.6, top_p 0.95).",
    )
    sampling_seed: int = Field(
        0, ge=0, description="Seed of the sampled evaluation's draws (and the served requests')."
    )
    serving: Literal["none", "vllm"] = Field(
        "none",
        description="Also measure tau inside a real serving engine: vllm = serve the target with "
        "the draft as its eagle3 speculative model and read vLLM's spec-decode counters.",
    )
    serving_endpoint: BaseUrl | None = Field(
        None,
        description="Base URL of a running vLLM server that already serves the target with this "
        "draft (k = num_speculative_tokens); blank (null) = eaglet starts one with vllm_python.",
    )
    vllm_python: str | None = Field(
        None,
        description="Python interpreter of a vLLM installation (its own venv), used to start the "
        "server when serving_endpoint is not set.",
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="Extra arguments for the vLLM server eaglet starts (e.g. --enforce-eager).",
    )
    serving_startup_timeout_s: float = Field(
        600.0,
        gt=0,
        le=7200,
        description="Seconds to wait for the started server's /health.",
        json_schema_extra=CACHE_NEUTRAL,
    )
    speedup_concurrency: list[int] = Field(
        default_factory=lambda: [1, 4, 16],
        description="With serving: vllm and a server eaglet starts: the same prompts served "
        "with and without the draft at each of these concurrencies: output tokens/s, time per "
        "output token and the speed-up, with served τ from this run's counter differences. "
        "Empty: no speed-up table.",
        json_schema_extra=CACHE_NEUTRAL,
    )
    max_serving_gap: float = Field(
        0.25,
        ge=0.0,
        description="Largest |served tau - offline tau| at the same k (and temperature) before "
        "the stage fails (greedy float32 on the fixture draft: 0.01-0.02; sampled tau is a "
        "draw: leave room for its noise).",
    )

    @model_validator(mode="after")
    def _serving_needs_a_server(self) -> EvaluateConfig:
        if self.serving == "vllm" and not (self.serving_endpoint or self.vllm_python):
            raise ValueError(
                "evaluate.serving=vllm needs evaluate.serving_endpoint (a running server) or "
                "evaluate.vllm_python (the python of a vLLM venv, to start one)"
            )
        return self


class ExecutionConfig(Strict):
    model_config = ConfigDict(title="Execution")  # the UI form's heading

    task_runner: Literal["default", "dask"] = Field(
        "default",
        description="How the hidden_states stage's shard tasks run: default = one after "
        "another in the flow's process; dask = mapped over a Dask cluster (prefect-dask).",
    )
    dask_address: str | None = Field(
        None,
        description="Address of an existing Dask scheduler (tcp://host:8786); blank (null) with "
        "task_runner=dask starts a local cluster of dask_workers processes.",
    )
    dask_workers: int = Field(
        2, ge=1, le=1024, description="Worker processes of the local Dask cluster."
    )


class PipelineConfig(Strict):
    """Everything one eaglet run needs. Each stage reads only its own sub-model."""

    model_config = ConfigDict(title="eaglet config")  # the UI form's heading

    name: str = Field("demo", description="Run name, shown in Prefect and in reports.")
    work_dir: str = Field("runs/demo", description="Folder for every stage's outputs.")
    target: TargetConfig = Field(
        default_factory=TargetConfig, description="The model the draft is trained for."
    )
    datasets: list[DatasetSpec] = Field(
        default_factory=lambda: [
            DatasetSpec(source="arith", path="runs/demo/data/arith.jsonl"),
            DatasetSpec(source="tools", path="runs/demo/data/tools.jsonl"),
            DatasetSpec(source="mixed", path="runs/demo/data/mixed.parquet"),
        ],
        description="Datasets to regenerate answers for.",
    )

    @model_validator(mode="before")
    @classmethod
    def _demo_sets_with_the_demo_data(cls, data: Any) -> Any:
        """The demo is the defaults: with the demo's datasets (left unset), evaluate.sets
        defaults to the demo's evaluation sets; with any datasets of your own, to none."""
        if not isinstance(data, dict) or "datasets" in data:
            return data
        evaluate = data.get("evaluate")
        if evaluate is None or (isinstance(evaluate, dict) and "sets" not in evaluate):
            data = {**data, "evaluate": {**(evaluate or {}), "sets": DEMO_EVAL_SETS}}
        return data

    tokenize: TokenizeConfig = Field(
        default_factory=TokenizeConfig, description="Chat-template rendering of the prompts."
    )
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig,
        description="How the target answers: the engine, its servers, sampling and limits.",
    )
    reasoning: ReasoningConfig = Field(
        default_factory=ReasoningConfig,
        description="How reasoning is split from the answer, and the quality gate.",
    )
    hidden_states: HiddenStatesConfig = Field(
        default_factory=HiddenStatesConfig,
        description="The target's features the draft learns from: layers, backend, storage.",
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="Draft training.")
    evaluate: EvaluateConfig = Field(
        default_factory=EvaluateConfig,
        description="Acceptance length of the trained draft on held-out prompts.",
    )
    execution: ExecutionConfig = Field(
        default_factory=ExecutionConfig,
        description="Where the stages run: task runner, Dask cluster.",
    )

    @field_validator("datasets")
    @classmethod
    def _unique_sources(cls, datasets: list[DatasetSpec]) -> list[DatasetSpec]:
        tags = [d.source for d in datasets]
        duplicated = sorted({t for t in tags if tags.count(t) > 1})
        if duplicated:
            raise ValueError(f"dataset source tags must be unique; repeated: {duplicated}")
        seen: dict[tuple, int] = {}
        for i, spec in enumerate(datasets):
            what = (spec.path, spec.name, spec.split, spec.revision)
            if what in seen:
                raise ValueError(
                    f"datasets {seen[what]} and {i} read the same data ({spec.path}) under two "
                    "source tags: every row would be trained on twice; keep one"
                )
            seen[what] = i
        return datasets


def _format_validation_error(error: ValidationError, origin: str) -> str:
    lines = [f"invalid configuration in {origin}:"]
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"  unknown key '{where}'")
        else:
            lines.append(f"  {where}: {item['msg']}")
    return "\n".join(lines)


def parse_override(override: str) -> tuple[list[str], Any]:
    """Split 'a.b=value' into (['a', 'b'], value), the value parsed as YAML (so 3, true, [..])."""
    if "=" not in override:
        raise ConfigError(f"override '{override}' is not of the form key.path=value")
    dotted, raw = override.split("=", 1)
    path = [part for part in dotted.strip().split(".") if part]
    if not path:
        raise ConfigError(f"override '{override}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        raise ConfigError(
            f"override '{override}': the value is not valid YAML ({problem}); quote it, e.g. "
            f"{dotted}='\"...\"'"
        ) from None
    return path, value


def _list_index(override: str, path: list[str], depth: int, items: list) -> int:
    """The list index `path[depth]` names, or a ConfigError naming the override."""
    where = ".".join(path[:depth]) or "(top level)"
    part = path[depth]
    try:
        index = int(part)
    except ValueError:
        raise ConfigError(
            f"override '{override}': '{where}' is a list; '{part}' is not an index (use "
            f"{where}.0, {where}.1, ...)"
        ) from None
    if not -len(items) <= index < len(items):
        raise ConfigError(
            f"override '{override}': '{where}' has {len(items)} item(s); index {index} is out "
            f"of range (valid: 0..{len(items) - 1}; to add an item, set the whole list: "
            f"{where}=[...])"
        )
    return index


def _current_spelling(path: list[str]) -> list[str]:
    """An override's key as the config holds it now: an older config's backend key written in
    hidden_states itself (`hidden_states.endpoints`) in its backend's section
    (`hidden_states.vllm.endpoints`), where the config it applies to holds it."""
    if len(path) >= 2 and path[0] == "hidden_states" and path[1] in FLAT_BACKEND_KEYS:
        return [path[0], FLAT_BACKEND_KEYS[path[1]], *path[1:]]
    return path


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for override in overrides:
        path, value = parse_override(override)
        path = _current_spelling(path)
        node: Any = data
        for depth, part in enumerate(path[:-1]):
            if isinstance(node, list):
                node = node[_list_index(override, path, depth, node)]
            else:
                if part not in node or node[part] is None:
                    node[part] = {}
                node = node[part]
            if not isinstance(node, dict | list):
                raise ConfigError(
                    f"override '{override}': '{'.'.join(path[: depth + 1])}' is not a section"
                )
        if isinstance(node, list):
            node[_list_index(override, path, len(path) - 1, node)] = value
        else:
            node[path[-1]] = value
    return data


def resolve_paths(config: PipelineConfig, base: str | Path) -> PipelineConfig:
    """The config with its relative local paths made absolute against `base` (the folder of
    the config file they were written in): `work_dir`, a hidden-state backend's local paths
    (`hidden_states.vllm.connector_path`: its section's fields marked `LOCAL_PATH`), and a
    `target.model` or dataset `path` unless it is a hub id (eaglet/local_paths.py: the one
    rule; a local folder that does not exist yet is still local)."""
    base = Path(base).expanduser().absolute()
    updates: dict[str, Any] = {"work_dir": absolute(config.work_dir, base, hub_id=False)}
    target = config.target
    model = absolute(target.model, base, hub_id=is_hub_id(target.model, base))
    updates["target"] = target.model_copy(update={"model": model})
    updates["datasets"] = [
        spec.model_copy(
            update={"path": absolute(spec.path, base, hub_id=is_hub_dataset(spec.path, base))}
        )
        for spec in config.datasets
    ]
    sections = {}
    for name in BACKENDS:
        section = getattr(config.hidden_states, name)
        paths = {
            key: absolute(value, base, hub_id=False)
            for key, field in type(section).model_fields.items()
            if is_local_path(field) and (value := getattr(section, key))
        }
        if paths:
            sections[name] = section.model_copy(update=paths)
    if sections:
        updates["hidden_states"] = config.hidden_states.model_copy(update=sections)
    sets = [
        spec.model_copy(
            update={"path": absolute(spec.path, base, hub_id=is_hub_dataset(spec.path, base))}
        )
        for spec in config.evaluate.sets
    ]
    updates["evaluate"] = config.evaluate.model_copy(update={"sets": sets})
    return config.model_copy(update=updates)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (plain YAML keeps the
    last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice (lines {seen[key]} and {line}); keep one",
                    key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> PipelineConfig:
    """Read a YAML file (or the defaults when `path` is None) and apply `a.b=value` overrides.

    Relative paths written in the file resolve against the file's folder; those given in
    overrides (or left at their defaults) against the current directory. The config returned
    holds absolute paths, so the copy a run saves (`WORK_DIR/config.yaml`) works from
    anywhere."""
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        try:
            loaded = yaml.load(Path(path).read_text(encoding="utf-8"), _UniqueKeyLoader)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except IsADirectoryError:
            raise ConfigError(f"{path} is a folder; give the path of a YAML config file") from None
        except UnicodeDecodeError as exc:
            problem = f"{exc.reason} at byte {exc.start}"
            raise ConfigError(f"{path}: not UTF-8 text ({problem})") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if loaded is None and not overrides:
            raise ConfigError(
                f"{path}: the file is empty; write at least `name:` and the keys that differ "
                "from the defaults (`eaglet demo` runs the defaults)"
            )
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys")
        data = loaded or {}  # empty with --set overrides: every value is in the overrides
    try:
        config = PipelineConfig.model_validate(data)
        if path is not None:
            config = resolve_paths(config, Path(path).parent)
        if overrides:
            origin += " with overrides " + " ".join(overrides)
            said = [parse_override(o)[0] for o in overrides]
            sets_said = "sets" in (data.get("evaluate") or {}) or any(
                p[:2] == ["evaluate", "sets"] or p == ["evaluate"] for p in said
            )
            data = apply_overrides(config.model_dump(), overrides)
            if any(p[0] == "datasets" for p in said) and not sets_said:
                data["evaluate"]["sets"] = []  # the demo's sets go with the demo's datasets
            config = PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, origin)) from None
    return resolve_paths(config, Path.cwd())
