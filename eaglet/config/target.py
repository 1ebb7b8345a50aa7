"""`target`: the model the draft is trained for, and how the stages that run it in-process
load it (`TargetConfig`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from eaglet.config_fields import Strict


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
