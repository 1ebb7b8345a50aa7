"""`evaluate`: how the trained draft is measured: held-out prompts, named evaluation sets
(`EvalSet`; the demo's, `DEMO_EVAL_SETS`), sampled τ and the served check in vLLM
(`EvaluateConfig`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from eaglet.config.spellings import move_older_keys
from eaglet.config_fields import BaseUrl, Strict, VllmServerSettings


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


class EvaluateConfig(VllmServerSettings):
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
    speedup_concurrency: list[int] = Field(
        default_factory=lambda: [1, 4, 16, 64],
        description="With serving: vllm and a server eaglet starts: the same prompts served "
        "with and without the draft at each of these concurrencies: output tokens/s, time per "
        "output token and the speed-up, with served τ from this run's counter differences; "
        "the calibration's bands of batch sizes start at them. Empty: no speed-up table.",
    )  # keyed: the table's rows and serving.json's bands are these concurrencies'

    calibration: bool | None = Field(
        None,
        description="With serving: vllm, speedup_concurrency and a server eaglet starts: also "
        "serve the draft at each k of calibration_k at each concurrency, pick the best k per "
        "band of batch sizes and write serving.json (vLLM's --speculative-config with "
        "num_speculative_tokens_per_batch_size) beside the evaluate folder's vLLM export. "
        "Blank (null): wherever it can run; true: refused where it cannot; false: never.",
    )
    calibration_k: list[Annotated[int, Field(ge=1, le=16)]] = Field(
        default_factory=list,
        description="The k values the calibration serves (empty: 1 to the evaluated k).",
    )
    max_serving_gap: float = Field(
        0.25,
        ge=0.0,
        description="Largest |served tau - offline tau| at the same k (and temperature) before "
        "the stage fails (greedy float32 on the fixture draft: 0.01-0.02; sampled tau is a "
        "draw: leave room for its noise).",
    )

    @model_validator(mode="before")
    @classmethod
    def _older_spellings(cls, data: Any) -> Any:
        return move_older_keys(__name__, data)

    @model_validator(mode="after")
    def _one_set_per_name(self) -> EvaluateConfig:
        """A set's name is its key in report.json: two of one name would lose one's τ."""
        names = [s.name for s in self.sets]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(
                f"evaluate.sets names {', '.join(twice)} more than once: each set's τ is kept "
                "under its name; keep one set of each name"
            )
        return self

    @property
    def calibrates(self) -> bool:
        """Whether the served check calibrates k (`calibration`: null is wherever it can: a
        served check in servers eaglet starts, at some concurrency, a server per k)."""
        return self.calibration is not False and bool(
            self.serving == "vllm"
            and self.vllm_python
            and not self.serving_endpoint
            and self.speedup_concurrency
        )

    @model_validator(mode="after")
    def _calibration_can_run(self) -> EvaluateConfig:
        """calibration: true and calibration_k act only where the calibration runs: refused,
        not ignored, elsewhere."""
        if (self.calibration or self.calibration_k) and not self.calibrates:
            raise ValueError(
                "evaluate.calibration (and calibration_k, which only it reads) needs "
                "serving=vllm, vllm_python (eaglet starts the servers at each k), no "
                "serving_endpoint, a non-empty speedup_concurrency, and calibration not false"
            )
        return self

    @model_validator(mode="after")
    def _serving_needs_a_server(self) -> EvaluateConfig:
        if self.serving == "vllm" and not (self.serving_endpoint or self.vllm_python):
            raise ValueError(
                "evaluate.serving=vllm needs evaluate.serving_endpoint (a running server) or "
                "evaluate.vllm_python (the python of a vLLM venv, to start one)"
            )
        return self
