"""The target model, loaded one way everywhere: its tokenizer, its config, the model itself.

Every stage that touches the target goes through these functions with the run's
`TargetConfig`, so `revision`, `trust_remote_code`, `dtype` and `device` reach all of them
(and remote code runs only when the config says so).
"""

from __future__ import annotations

from typing import Any

import torch

from eaglet.config.target import TargetConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_device(device: str) -> str:
    """`auto` = the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def target_dtype(target: TargetConfig) -> str:
    """The dtype the target is loaded in: `target.dtype`, or what `auto` picks for the device
    (`target.device`): bfloat16 on a CUDA GPU with bfloat16 arithmetic, float16 on an older
    one, float32 on the CPU, where most processors emulate bfloat16 (a hundred times slower,
    eaglet/preflight/devices.py) and float16's range overflows."""
    if target.dtype != "auto":
        return target.dtype
    if resolve_device(target.device).startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def load_tokenizer(target: TargetConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        target.model, trust_remote_code=target.trust_remote_code, revision=target.revision
    )


def end_token_ids(target: TargetConfig, tokenizer) -> list[int]:
    """Token ids that end the target's turn: its generation config's eos ids, else the
    tokenizer's eos token."""
    from transformers import GenerationConfig

    try:
        configured = GenerationConfig.from_pretrained(
            target.model, revision=target.revision, trust_remote_code=target.trust_remote_code
        ).eos_token_id
    except OSError:  # no generation_config.json
        configured = None
    if configured is None:
        configured = tokenizer.eos_token_id
    ids = configured if isinstance(configured, list) else [configured]
    return [int(i) for i in ids if i is not None]


def load_config(target: TargetConfig):
    """The target's transformers config (its text config for multimodal models)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        target.model, trust_remote_code=target.trust_remote_code, revision=target.revision
    )
    return config.get_text_config()


def load_model(target: TargetConfig, device: str | None = None, **kwargs: Any):
    """The target as an `AutoModelForCausalLM` in eval mode, in `target_dtype`, on `device`
    (default: `target.device`). Extra keyword arguments go to `from_pretrained` (for example
    `device_map="auto"` for a model larger than one GPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        target.model,
        dtype=DTYPES[target_dtype(target)],
        trust_remote_code=target.trust_remote_code,
        revision=target.revision,
        **kwargs,
    ).eval()
    if "device_map" not in kwargs:
        model = model.to(resolve_device(device or target.device))
    return model
