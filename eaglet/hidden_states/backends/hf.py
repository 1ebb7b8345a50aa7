"""The `hf` backend: the target run in-process with transformers, in batches bucketed by
length, right-padded so that padding never reaches a stored state.

With causal attention a real token never attends to the pads after it, and the attention mask
keeps positions 0..n-1, so a sample's states are the same (within fp32 tolerance) whether it
shares a batch with longer samples or runs alone (tests/test_hidden_states.py checks it).
`hidden_states.hf.device_map: auto` spreads a model larger than one GPU over every visible GPU.
Online training runs it in the training process, frozen (`eaglet.draft.online`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field

from eaglet.config_fields import CACHE_NEUTRAL
from eaglet.hidden_states.backends.base import BackendSettings, Sample
from eaglet.hidden_states.layers import resolve_aux_layer_ids

if TYPE_CHECKING:
    import torch

    from eaglet.config.hidden_states import HiddenStatesConfig
    from eaglet.config.target import TargetConfig


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


_MODELS: dict[str, object] = {}  # one loaded target per process (shard tasks on one worker)


def _cached_model(target: TargetConfig, device_map: str | None):
    from eaglet.target import load_model

    key = target.model_dump_json() + f"|{device_map}"
    if key not in _MODELS:
        _MODELS.clear()
        kwargs = {"device_map": device_map} if device_map else {}
        _MODELS[key] = load_model(target, **kwargs)
        for p in _MODELS[key].parameters():  # frozen: online training runs it beside a draft
            p.requires_grad_(False)
    return _MODELS[key]


def length_batches(lengths: list[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of similar length: at most `batch_size` sequences and at
    most `batch_tokens` padded tokens (one sequence alone may exceed it)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[i]  # sorted: the newest is the longest
        if current and (len(current) >= batch_size or (len(current) + 1) * width > batch_tokens):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class HFBackend:
    """Target features of examples, computed with transformers."""

    def __init__(
        self,
        target: TargetConfig,
        aux_layer_ids: list[int] | None,
        batch_size: int = 8,
        batch_tokens: int = 16384,
        device_map: str | None = None,
    ):
        self.model = _cached_model(target, device_map)
        self.num_layers = self.model.config.get_text_config().num_hidden_layers
        self.hidden_size = self.model.config.get_text_config().hidden_size
        # given: resolved by the run's draft method (`layers.layer_ids_of`); None: EAGLE-3's
        self.aux_layer_ids = (
            resolve_aux_layer_ids(None, self.num_layers)
            if aux_layer_ids is None
            else list(aux_layer_ids)
        )
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens

    def forward(self, batch: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        """One right-padded forward of token id lists; per sample aux [n, 3H], final [n, H]."""
        import torch

        with torch.inference_mode():
            device = self.model.device
            width = max(len(ids) for ids in batch)
            input_ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
            for row, ids in enumerate(batch):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention_mask[row, : len(ids)] = 1
            outputs = self.model.model(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                output_hidden_states=True,
                use_cache=False,
            )
            aux = torch.cat([outputs.hidden_states[i] for i in self.aux_layer_ids], dim=-1)
            final = outputs.last_hidden_state  # [B, T, H], after the final norm
            return [
                {
                    "aux_hidden_states": aux[row, : len(ids)].float().cpu(),  # [n, 3H]
                    "final_hidden_states": final[row, : len(ids)].float().cpu(),  # [n, H]
                }
                for row, ids in enumerate(batch)
            ]

    def features(
        self, examples: Sequence[Sample], on_tokens: Callable[[int], None] | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """Features of every example, in the order given, computed in length buckets;
        `on_tokens(n)` after each batch of n tokens (progress inside a shard)."""
        lengths = [len(e.input_ids) for e in examples]
        out: list[dict[str, torch.Tensor] | None] = [None] * len(examples)
        for batch in length_batches(lengths, self.batch_size, self.batch_tokens):
            results = self.forward([examples[i].input_ids for i in batch])
            for i, result in zip(batch, results, strict=True):
                out[i] = result
            if on_tokens is not None:
                on_tokens(sum(lengths[i] for i in batch))
        return out  # type: ignore[return-value]

    def close(self) -> None:
        pass


class InProcessBackend:
    """`hidden_states.backend: hf`: the target loaded in this process when a source is opened
    (the stage and online training open it on first use: a stage whose shards are all
    finished, or a resumed training run that is done, loads nothing)."""

    name = "hf"
    settings = HFSettings
    served = False  # computed in the training process itself: nothing to fetch ahead

    def open(
        self, target: TargetConfig, settings: HiddenStatesConfig, aux_layer_ids: list[int]
    ) -> HFBackend:
        return HFBackend(
            target,
            aux_layer_ids,
            batch_size=settings.batch_size,
            batch_tokens=settings.batch_tokens,
            device_map=settings.hf.device_map,
        )

    def serving(self, config: Any, folder: Any, report: Any) -> nullcontext:
        return nullcontext(config)  # no server: the target runs in the stage's process

    def preflight(self, config: Any, report: Any) -> None:
        pass  # nothing to reach: loading the target is the preflight's own check


BACKEND = InProcessBackend()
