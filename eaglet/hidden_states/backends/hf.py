"""The `hf` backend: the target run in-process with transformers, one sample per forward.

A sample's states are a function of its tokens alone, bit for bit: in a batch they would
differ in the last bits with the batch's other samples and padding (the matrix products'
blocking follows the batch's shape), and stored as int8 such a difference flips stored values,
so features reused from an earlier run would not be what a fresh run computes (issue 46).
One sample per forward costs nothing measurable on the CPU (the fixture: 23.0k tokens/s alone
against 22.7k in batches of 8) and little on a GPU for reasoning answers of thousands of
tokens, each a large matrix product of its own.
`hidden_states.hf.device_map: auto` spreads a model larger than one GPU over every visible GPU.
Online training runs it in the training process, frozen (`eaglet.draft.online`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from eaglet.hidden_states.backends.base import Sample
from eaglet.hidden_states.backends.settings import HFSettings
from eaglet.hidden_states.layers import resolve_aux_layer_ids

if TYPE_CHECKING:
    import torch

    from eaglet.config.hidden_states import HiddenStatesConfig
    from eaglet.config.target import TargetConfig


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


class HFBackend:
    """Target features of examples, computed with transformers."""

    def __init__(
        self,
        target: TargetConfig,
        aux_layer_ids: list[int] | None,
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

    def forward(self, ids: list[int]) -> dict[str, torch.Tensor]:
        """One sample's forward: aux [n, 3H] and final [n, H] states, float32 on the CPU."""
        import torch

        with torch.inference_mode():
            outputs = self.model.model(
                input_ids=torch.tensor([ids], device=self.model.device),  # [1, n]
                output_hidden_states=True,
                use_cache=False,
            )
            aux = torch.cat([outputs.hidden_states[i] for i in self.aux_layer_ids], dim=-1)
            final = outputs.last_hidden_state  # [1, n, H], after the final norm
            return {
                "aux_hidden_states": aux[0].float().cpu(),  # [n, 3H]
                "final_hidden_states": final[0].float().cpu(),  # [n, H]
            }

    def features(
        self, examples: Sequence[Sample], on_tokens: Callable[[int], None] | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """Features of every example, in the order given, one forward each; `on_tokens(n)`
        after each sample of n tokens (progress inside a shard)."""
        out = []
        for example in examples:
            out.append(self.forward(example.input_ids))
            if on_tokens is not None:
                on_tokens(len(example.input_ids))
        return out

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
        return HFBackend(target, aux_layer_ids, device_map=settings.hf.device_map)

    def serving(self, config: Any, folder: Any, report: Any) -> nullcontext:
        return nullcontext(config)  # no server: the target runs in the stage's process

    def preflight(self, config: Any, report: Any) -> None:
        pass  # nothing to reach: loading the target is the preflight's own check


BACKEND = InProcessBackend()
