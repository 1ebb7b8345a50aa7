"""A draft someone already trained, as where training starts (`train.init_from`).

Users fine-tune published drafts on their own data. This module reads such a draft in any of
the formats they come in, and says what in it does not fit the target and the run: the
preflight asks before the first stage runs (hours before training would find out), and the
train stage asks again when it starts from it.

The formats, how each is recognised, and what its layer ids mean:
- eaglet's exports (`draft/`, `draft-sglang/`, `draft-speculators-eagle3/`): the label
  `eaglet.aux_layer_convention` names the ids' convention;
- speculators (`speculators_model_type: eagle3`, weights `layers.0.*`): vLLM's convention;
- a vLLM / EAGLE-3 checkpoint or SpecForge's (`LlamaForCausalLMEagle3`, `midlayer.*`): ids it
  names are in `train.init_from_layer_convention` (vllm or sglang; the run is refused while it
  is auto, as the file does not say); none named: EAGLE-3's default (2, N//2, N-3), which
  vLLM and SGLang both capture then.

What is checked against the target and the run (each a problem that refuses the run):
- the draft reads the target's token embeddings and hidden states: its `hidden_size` and
  `target_hidden_size` must be the target's, its `vocab_size` the target's;
- its layer ids, in vLLM's convention, must be the ones this run extracts
  (`hidden_states.aux_layer_ids`): other layers' states would feed a draft trained on these;
- it must not have trained its own embeddings (`embed_requires_grad`), which eaglet's draft
  does not hold.
What it brings is kept: the shape, the architecture variants, the draft vocabulary (d2t/t2d)
and every weight; the train settings for those (`draft_vocab_size`, `intermediate_size`,
`norm_*`, `lm_head_init`) are not used, and the preflight says so where they differ.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eaglet.config.train import TrainConfig
from eaglet.draft.methods.eagle3_checkpoint import aux_layer_ids, config_from_json, load_draft
from eaglet.draft.methods.eagle3_model import ARCHITECTURE_VARIANTS, Eagle3Config, Eagle3Draft
from eaglet.draft.vocab import DraftVocab, vocab_over
from eaglet.hidden_states.layers import default_aux_layer_ids

SETTING = "train.init_from"
CONVENTION_SETTING = "train.init_from_layer_convention"


class StartingDraftError(ValueError):
    """`train.init_from` names a draft this run cannot start from; the message says why."""


@dataclass(frozen=True)
class StartingDraft:
    folder: Path
    format: str  # "eaglet", "speculators" or "vllm"
    config: Eagle3Config
    aux_layer_ids: list[int]  # in vLLM's convention (HF hidden_states[i])
    ids_said: str  # where the ids came from, for messages


def draft_format(raw: dict) -> str:
    if "aux_layer_convention" in raw.get("eaglet", {}):
        return "eaglet"
    if raw.get("speculators_model_type") == "eagle3":
        return "speculators"
    return "vllm"


def layer_ids(raw: dict, convention: str, num_layers: int) -> tuple[list[int], str]:
    """The draft's layer ids in vLLM's convention, and where they came from."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_config", {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    if not ids:
        return default_aux_layer_ids(num_layers), "EAGLE-3's default (it names none)"
    named, kind = [int(i) for i in ids], draft_format(raw)
    if kind != "vllm":  # eaglet's label, or speculators' (vLLM's) convention: as evaluation reads
        said = "eaglet's label" if kind == "eaglet" else "speculators' format: vLLM's convention"
        try:
            return aux_layer_ids(raw), said
        except ValueError as exc:
            raise StartingDraftError(str(exc)) from None
    if convention == "auto":
        raise StartingDraftError(
            f"its config names layer ids {named} without saying in which convention: set "
            f"{CONVENTION_SETTING} to vllm (a draft trained for vLLM, ids = HF hidden_states "
            "indices) or sglang (SpecForge/SGLang, ids = outputs of layer i, one less)"
        )
    shift = 1 if convention == "sglang" else 0
    return [i + shift for i in named], f"its config, {convention}'s convention"


def read_starting_draft(
    folder: str | Path, convention: str = "auto", num_layers: int | None = None
) -> StartingDraft:
    """What `folder` holds, without loading its weights. `num_layers`: the target's, for a
    draft that names no layer ids."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file() or not (folder / "model.safetensors").is_file():
        raise StartingDraftError(
            f"{SETTING} {folder}: a draft folder holds config.json and model.safetensors"
        )
    try:
        raw = json.loads(path.read_text())
        config = config_from_json(raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise StartingDraftError(f"{SETTING} {path}: not an EAGLE-3 draft's config: {exc}") from exc
    try:
        ids, said = layer_ids(raw, convention, num_layers or 0)
    except StartingDraftError as exc:
        raise StartingDraftError(f"{SETTING} {path}: {exc}") from None
    return StartingDraft(folder, draft_format(raw), config, ids, said)


def problems(start: StartingDraft, target: dict[str, Any], aux_layer_ids: list[int]) -> list[str]:
    """What refuses `start` for a target whose config is `target` and a run extracting
    `aux_layer_ids` (vLLM's convention); empty when it fits."""
    found, c = [], start.config
    where = f"{SETTING} {start.folder}"
    hidden, vocab = target.get("hidden_size"), target.get("vocab_size")
    if c.target_hidden_size != hidden or c.hidden_size != hidden:
        found.append(
            f"{where}: the draft reads hidden states {c.target_hidden_size} wide (its own width "
            f"{c.hidden_size}); the target's hidden_size is {hidden}: a draft of another model"
        )
    if c.vocab_size != vocab:
        found.append(
            f"{where}: the draft's vocab_size is {c.vocab_size}, the target's {vocab}: its d2t/t2d "
            "map another tokenizer's ids"
        )
    if list(start.aux_layer_ids) != list(aux_layer_ids):
        found.append(
            f"{where}: the draft was trained on target layers {start.aux_layer_ids} (vLLM's "
            f"convention, from {start.ids_said}); this run extracts {list(aux_layer_ids)}: set "
            f"hidden_states.aux_layer_ids: {start.aux_layer_ids}"
        )
    return found


def unused_settings(start: StartingDraft, train: TrainConfig) -> list[str]:
    """The train settings the starting draft overrides, where they differ from what it brings."""
    c, notes = start.config, []
    if train.draft_vocab_size != c.draft_vocab_size and train.init_from_vocab == "keep":
        notes.append(f"draft_vocab_size {train.draft_vocab_size} (it has {c.draft_vocab_size})")
    if train.intermediate_size not in (None, c.intermediate_size):
        notes.append(f"intermediate_size {train.intermediate_size} (it has {c.intermediate_size})")
    for key in ARCHITECTURE_VARIANTS:
        if getattr(train, key) != getattr(c, key):
            notes.append(f"{key} {getattr(train, key)} (it has {getattr(c, key)})")
    if train.lm_head_init != "random":
        notes.append(f"lm_head_init {train.lm_head_init} (its lm_head is trained)")
    return notes


def load_starting_draft(
    start: StartingDraft, target: dict[str, Any], aux_layer_ids: list[int]
) -> tuple[Eagle3Draft, DraftVocab]:
    """The draft with its weights, and its vocabulary; `StartingDraftError` when it does not fit
    (see `problems`)."""
    found = problems(start, target, aux_layer_ids)
    if found:
        raise StartingDraftError("; ".join(found))
    draft, _ = load_draft(start.folder)
    vocab = DraftVocab.from_d2t(draft.d2t.clone(), int(target["vocab_size"]))
    if not bool(draft.t2d[vocab.ids].all()) or int(draft.t2d.sum()) != vocab.size:
        raise StartingDraftError(
            f"{SETTING} {start.folder}: its d2t and t2d name different draft vocabularies"
        )
    return draft, vocab


def grown_vocab(brought: DraftVocab, counts: torch.Tensor, size: int) -> DraftVocab:
    """`train.init_from_vocab: grow`: the starting draft's vocabulary and the most frequent
    ids of `counts` ([V], this run's data) it lacks, up to `size` ids in all (never fewer
    than it brought); ties to the lower id."""
    have = torch.zeros(len(counts), dtype=torch.bool)  # [V]
    have[brought.ids] = True
    missing = counts.masked_fill(have, 0)  # [V]
    room = max(0, min(size - brought.size, int((missing > 0).sum())))
    order = torch.sort(-missing, stable=True).indices[:room]
    return vocab_over(torch.sort(torch.cat([brought.ids, order])).values, counts)


def with_vocab(draft: Eagle3Draft, vocab: DraftVocab, target_lm_head: torch.Tensor) -> Eagle3Draft:
    """`draft` over the larger `vocab` (its own a subset): the lm_head rows of the ids it had
    kept, those of the new ids the target's (`target_lm_head` [V, H]), its d2t/t2d and
    `draft_vocab_size` those of `vocab`."""
    old = DraftVocab.from_d2t(draft.d2t.clone(), vocab.target_vocab_size)
    if old.token_ids == vocab.token_ids:
        return draft
    grown = copy.deepcopy(draft)
    weight = target_lm_head[vocab.ids].to(draft.lm_head.weight)  # [Vd', H]
    row_of = {token: row for row, token in enumerate(old.token_ids)}
    kept = [row_of[t] for t in vocab.token_ids if t in row_of]
    at = [i for i, t in enumerate(vocab.token_ids) if t in row_of]
    grown.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        weight[at] = draft.lm_head.weight[kept]
        grown.lm_head.weight.copy_(weight)
    grown.register_buffer("d2t", vocab.d2t.to(draft.d2t.device))
    grown.register_buffer("t2d", vocab.t2d.to(draft.t2d.device))
    grown.config.draft_vocab_size = vocab.size
    return grown
