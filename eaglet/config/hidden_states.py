"""`hidden_states`: the target's features the draft learns from: layers, storage, the backend,
and one section per backend of the registry (`eaglet.hidden_states.backends`), each typed
as the backend's own `settings` (`HiddenStatesConfig`). The keys older configs wrote flat in
`hidden_states` are read into their sections (`eaglet.config.spellings`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field, create_model, model_validator

from eaglet.config.spellings import move_older_keys
from eaglet.config_fields import Strict
from eaglet.hidden_states.backends import BACKENDS, BackendName, hidden_states_backend

# Keys hidden_states no longer has, with the value each had by default: a config that holds
# that value (every WORK_DIR/config.yaml an earlier run wrote) loads as before, the key
# dropped; one that sets another is refused with `REMOVED_WHY` (it would do nothing).
REMOVED_KEYS = {"batch_size": 8, "batch_tokens": 16384}
REMOVED_WHY = (
    "the hf backend runs each sample in a forward of its own, so that its features do not "
    "depend on the samples beside it (an incremental run then stores what a fresh one does); "
    "remove the key"
)


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
    def _no_removed_keys(cls, data: Any) -> Any:
        """A key that no longer does anything is refused, saying why, unless it holds the value
        it had by default (an earlier run's config.yaml): then it is dropped."""
        if not isinstance(data, dict) or not any(key in data for key in REMOVED_KEYS):
            return data
        data = dict(data)
        for key, default in REMOVED_KEYS.items():
            if key in data and data.pop(key) != default:
                raise ValueError(f"hidden_states.{key} is no longer a setting: {REMOVED_WHY}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_into_sections(cls, data: Any) -> Any:
        """An older config's backend key written in hidden_states itself moves into its
        backend's section (`eaglet.config.spellings`)."""
        return move_older_keys(__name__, data)

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


if TYPE_CHECKING:
    # What the type checker and go-to-definition see: the registry's sections today, declared
    # by hand (tests/test_config.py checks this list against the registry, so a backend added
    # without its line here fails there, not in a user's editor only).
    from eaglet.hidden_states.backends.settings import HFSettings, VllmSettings

    class HiddenStatesConfig(_HiddenStatesSettings):
        hf: HFSettings = Field(default_factory=HFSettings)
        vllm: VllmSettings = Field(default_factory=VllmSettings)

else:
    # `hidden_states`: the settings above and one section per backend of the registry, named
    # as the backend and typed as its `settings` (hidden_states.vllm: eaglet.hidden_states.
    # backends.settings.VllmSettings). Built from the registry, so that adding a backend edits no
    # line here to run.
    HiddenStatesConfig = create_model(
        "HiddenStatesConfig",
        __base__=_HiddenStatesSettings,
        __doc__="The hidden_states stage's settings: layers, storage, the backend and its section.",
        __module__=__name__,
        **{name: _backend_section(name) for name in BACKENDS},
    )
