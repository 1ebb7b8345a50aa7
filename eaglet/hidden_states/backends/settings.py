"""The backends' settings: each backend's section of `hidden_states` (`hidden_states.hf`,
`hidden_states.vllm`), pydantic only, so that the config and the type checker import them
without the backends' code. Each backend's module names its class as its `settings`; a backend
added later may keep its settings in its own module (the registry reads `settings` there).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from eaglet.config_fields import CACHE_NEUTRAL, LOCAL_PATH, BaseUrl, VllmServerSettings
from eaglet.hidden_states.backends.base import BackendSettings


class HFSettings(BackendSettings):
    """The hf backend (hidden_states.backend: hf): the target in this process, on
    target.device in target.dtype. Older configs wrote device_map in hidden_states itself;
    it is still read there."""

    model_config = ConfigDict(
        title="hf backend (in-process transformers)"
    )  # the UI form's section heading

    device_map: Literal["auto"] | None = Field(
        None,
        description="'auto' spreads a model larger than one GPU over all GPUs (transformers "
        "device_map); blank (null) loads it on target.device. Older configs' "
        "hidden_states.device_map is read here.",
        json_schema_extra=CACHE_NEUTRAL,
    )


class VllmSettings(BackendSettings, VllmServerSettings):
    """The vllm backend (hidden_states.backend: vllm): vLLM servers started with the
    extract_hidden_states speculative method and a hidden-states KV connector (see the
    README), or one eaglet starts itself (vllm_python: with the connector, eaglet's on CPU,
    vLLM's stock one on GPU; also for online training). Older configs wrote these keys in
    hidden_states itself; they are still read there."""

    model_config = ConfigDict(title="vllm backend (a vLLM server)")  # the UI form's heading

    endpoints: list[BaseUrl] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        description="Base URLs of the vLLM servers that extract hidden states.",
        json_schema_extra=CACHE_NEUTRAL,
    )
    connector_path: str | None = Field(
        None,
        description="The connector's shared_storage_path as eaglet sees it (the server writes "
        "one safetensors file per request there); needed for a server eaglet does not start. "
        "eaglet reads and deletes files only there.",
        json_schema_extra=CACHE_NEUTRAL | LOCAL_PATH,
    )
    served_model: str = Field(
        "tiny", description="The served model name.", json_schema_extra=CACHE_NEUTRAL
    )
    concurrency: int = Field(
        8, ge=1, le=4096, description="Requests in flight.", json_schema_extra=CACHE_NEUTRAL
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0.0,
        le=86_400.0,
        description="Seconds one request may take.",
        json_schema_extra=CACHE_NEUTRAL,
    )

    def problem_when_chosen(self) -> str | None:
        # eaglet reads and deletes only files in the connector folder it knows: the one of
        # the server it starts, or this one for a server someone else runs.
        if not self.vllm_python and not self.connector_path:
            return (
                "hidden_states.backend=vllm with a server eaglet does not start (no "
                "hidden_states.vllm.vllm_python) needs hidden_states.vllm.connector_path: the "
                "connector's shared_storage_path as seen from this machine"
            )
        return None
