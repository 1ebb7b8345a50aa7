"""`train`: the draft method, its shape and variants, the optimizer and schedule, held-out
samples, where and how training runs (`TrainConfig`); the block drafters' own sections
(`train.dflash`, `train.dspark`) are their settings modules' (`eaglet.draft.methods.settings`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from eaglet.config_fields import CACHE_NEUTRAL, Strict
from eaglet.draft.methods.registry import DEFAULT_METHOD, MethodName
from eaglet.draft.methods.settings import DFlashSettings, DSparkSettings


class TrainConfig(Strict):
    model_config = ConfigDict(title="Draft training")  # the UI form's heading

    method: MethodName = Field(
        DEFAULT_METHOD,
        description="The draft method: eagle3 (a chain of k one-token steps, training-time "
        "test), peagle (EAGLE-3 trained for vLLM's parallel_drafting: k tokens in one pass, "
        "k <= train.ttt_length), dflash (a block of k tokens in one pass; train.dflash) or "
        "dspark (a block of k tokens in one pass, then a Markov head drafting them left to "
        "right; train.dspark).",
    )
    dflash: DFlashSettings = Field(
        default_factory=DFlashSettings, description="DFlash: used with train.method=dflash."
    )
    dspark: DSparkSettings = Field(
        default_factory=DSparkSettings, description="DSpark: used with train.method=dspark."
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
    init_from_vocab: Literal["keep", "grow"] = Field(
        "keep",
        description="With init_from: keep the starting draft's vocabulary, or grow it by the "
        "tokens of this run's data it lacks (the most frequent first, up to "
        "draft_vocab_size), their lm_head rows the target's: a draft that follows a changed "
        "target (a refresh) can then propose the words the new target uses.",
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
    nnodes: int = Field(
        1,
        ge=1,
        le=4096,
        description="Machines that train together, nproc_per_node processes each. > 1: each "
        "runs the same `eaglet run` (the one that holds the work dir leads the pipeline; the "
        "others join its training) and they meet at train.rdzv_endpoint (torchrun's c10d "
        "rendezvous); the work dir must be on a file system every machine mounts at the same "
        "path.",
        json_schema_extra=CACHE_NEUTRAL,  # where it runs: the loss curve is one process's
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="host:port of torchrun's c10d rendezvous, reachable from every training "
        "machine (the leading machine hosts it when its name or address matches host); "
        "required when train.nnodes > 1.",
        json_schema_extra=CACHE_NEUTRAL,
    )
    rdzv_id: str | None = Field(
        None,
        description="The rendezvous id the machines share; blank (null) = one derived from the "
        "work dir's path.",
        json_schema_extra=CACHE_NEUTRAL,
    )
    rdzv_timeout_s: float = Field(
        900.0,
        gt=0.0,
        le=86_400.0,
        description="Seconds the machines wait for each other at the rendezvous before the "
        "training fails (and the nodes that joined stop).",
        json_schema_extra=CACHE_NEUTRAL,
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
    def _nodes_need_a_rendezvous(self) -> TrainConfig:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"train.nnodes={self.nnodes} needs train.rdzv_endpoint (host:port every "
                "training machine reaches, e.g. the first machine's name and port 29500)"
            )
        if self.nnodes == 1 and (self.rdzv_endpoint or self.rdzv_id):
            raise ValueError(
                "train.rdzv_endpoint and train.rdzv_id do nothing with train.nnodes=1: remove "
                "them, or set train.nnodes to the machines that train together"
            )
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"train.rdzv_endpoint={self.rdzv_endpoint!r} is not host:port (e.g. "
                    "node001:29500)"
                )
        return self

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
