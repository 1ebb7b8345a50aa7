"""Write a training set in the on-disk layout speculators 0.9.0's EAGLE-3 trainer reads.

Owns only the layout (no speculators / hs_connectors import, so it runs in eaglet's venv):

    out_dir/
      state.json, dataset_info.json, data-*.arrow   one `datasets.Dataset.save_to_disk`
        (read back with `load_from_disk`), format torch, columns
          input_ids  list<int64>  [T]
          loss_mask  list<int64>  [T]   1 = supervised (speculators' prepare_data writes int64)
          seq_len    int64              T (the multipack sampler packs by it)
      hidden_states/hs_{i}.safetensors  one per row i (hs_connectors FileTransfer.get_cached):
          token_ids      int64 [T]       must equal row i's input_ids, else the row is skipped
          hidden_states  [T, 4, H]       3 aux layers, then the verifier's last hidden state
                                         BEFORE its final norm (speculators applies the norm)
      d2t-{Vd}.npy  int64 [Vd]  d2t[i] = target_id_i - i
      t2d-{Vd}.npy  bool  [V]   t2d[v] = v is in the draft vocab

Row i pairs with file hs_{i}; speculators' train/val split is by row order (first
train_data_ratio of the rows train, the rest validation). With `--data-path out_dir
--draft-vocab-size Vd` speculators finds the two .npy files itself (or pass them with
--d2t-path / --t2d-path).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset, Features, Sequence, Value
from safetensors.torch import save_file

NUM_HS_LAYERS = 4  # 3 aux layers + the verifier's pre-norm last hidden state


def write_speculators_dataset(
    out_dir: Path,
    samples: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    hidden_states_dtype: torch.dtype | None = None,
) -> dict:
    """Write `samples` ((input_ids [T] long, loss_mask [T] bool, hidden_states [T, 4, H]))
    and the draft vocab under `out_dir` (created; must not hold a dataset already).

    hidden_states_dtype: dtype of the stored states (None keeps each sample's dtype;
    speculators casts to its --hidden-states-dtype, bfloat16 by default, when it batches).
    Returns {samples, tokens, loss_tokens, hidden_size, draft_vocab_size, data_path,
    d2t_path, t2d_path}.
    """
    out_dir = Path(out_dir)
    hs_dir = out_dir / "hidden_states"
    if (out_dir / "state.json").exists():
        raise FileExistsError(f"{out_dir} already holds a dataset")
    hs_dir.mkdir(parents=True, exist_ok=True)

    input_ids_col: list[list[int]] = []
    loss_mask_col: list[list[int]] = []
    seq_len_col: list[int] = []
    hidden_size: int | None = None
    loss_tokens = 0
    for i, (input_ids, loss_mask, hidden_states) in enumerate(samples):
        seq_len = int(input_ids.shape[0])
        if input_ids.dim() != 1 or loss_mask.shape != input_ids.shape:
            raise ValueError(
                f"sample {i}: input_ids {tuple(input_ids.shape)} and "
                f"loss_mask {tuple(loss_mask.shape)} must both be [T]"
            )
        if hidden_states.dim() != 3 or hidden_states.shape[:2] != (seq_len, NUM_HS_LAYERS):
            raise ValueError(
                f"sample {i}: hidden_states {tuple(hidden_states.shape)} "
                f"must be [T={seq_len}, {NUM_HS_LAYERS}, H]"
            )
        if hidden_size is None:
            hidden_size = int(hidden_states.shape[2])
        elif hidden_states.shape[2] != hidden_size:
            raise ValueError(f"sample {i}: hidden size {hidden_states.shape[2]} != {hidden_size}")
        ids = input_ids.detach().to("cpu", torch.int64).contiguous()  # [T]
        hs = hidden_states.detach().to("cpu")  # [T, 4, H]
        if hidden_states_dtype is not None:
            hs = hs.to(hidden_states_dtype)
        save_file(
            {"token_ids": ids, "hidden_states": hs.contiguous()},
            str(hs_dir / f"hs_{i}.safetensors"),
        )
        mask = loss_mask.detach().to("cpu", torch.int64)  # [T], 0/1
        input_ids_col.append(ids.tolist())
        loss_mask_col.append(mask.tolist())
        seq_len_col.append(seq_len)
        loss_tokens += int(mask.sum())

    if not seq_len_col:
        raise ValueError("no samples")
    features = Features(
        {
            "input_ids": Sequence(Value("int64")),
            "loss_mask": Sequence(Value("int64")),
            "seq_len": Value("int64"),
        }
    )
    dataset = Dataset.from_dict(
        {"input_ids": input_ids_col, "loss_mask": loss_mask_col, "seq_len": seq_len_col},
        features=features,
    )
    dataset.set_format(type="torch")  # persisted in state.json; ArrowDataset compares tensors
    dataset.save_to_disk(str(out_dir))

    d2t_np = d2t.detach().to("cpu", torch.int64).numpy()  # [Vd]
    t2d_np = t2d.detach().to("cpu", torch.bool).numpy()  # [V]
    if int(t2d_np.sum()) != d2t_np.shape[0]:
        raise ValueError(f"t2d marks {int(t2d_np.sum())} ids, d2t has {d2t_np.shape[0]}")
    draft_vocab_size = int(d2t_np.shape[0])
    d2t_path = out_dir / f"d2t-{draft_vocab_size}.npy"
    t2d_path = out_dir / f"t2d-{draft_vocab_size}.npy"
    np.save(d2t_path, d2t_np)
    np.save(t2d_path, t2d_np)

    return {
        "samples": len(seq_len_col),
        "tokens": sum(seq_len_col),
        "loss_tokens": loss_tokens,
        "hidden_size": hidden_size,
        "draft_vocab_size": draft_vocab_size,
        "data_path": str(out_dir),
        "d2t_path": str(d2t_path),
        "t2d_path": str(t2d_path),
    }
