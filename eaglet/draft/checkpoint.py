"""The trainer's resumable state (`save_training_state` / `load_training_state`): the draft's and
the optimizer's tensors and the RNG state as safetensors, step/epoch/param groups as JSON, and
the draft vocab as JSON; no pickle. The folder is written next to its final place and renamed
in (`atomic_folder`), so a crash never leaves a half-written state where a resume would look.
Each method writes its own exportable draft (`DraftMethod.save`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eaglet.draft.vocab import DraftVocab
from eaglet.storage import atomic_folder


def _umask() -> int:
    """This process's umask: read from /proc (setting it to read it back races threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_tensors(
    tensors: dict[str, Any], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """`safetensors.torch.save_file`, then the mode any file this process creates gets: it
    writes 0600, so a draft in a shared work dir was unreadable to the team beside its owner."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every state_dict entry as its own tensor (a module shared by several layers, DFlash's
    k_norm, is written once per name: safetensors refuses tensors that share memory)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in module.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        shared = tensor.data_ptr() in seen
        seen.add(tensor.data_ptr())
        out[name] = tensor.clone() if shared else tensor
    return out


def save_training_state(
    state_dir: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    vocab: DraftVocab,
    meta: dict,
) -> None:
    """model.safetensors, optimizer.safetensors (+ groups in meta), rng.safetensors, vocab.json,
    state.json (`meta` plus optimizer param groups)."""
    with atomic_folder(Path(state_dir)) as tmp:
        save_tensors(module_tensors(model), tmp / "model.safetensors")

        opt = optimizer.state_dict()
        opt_tensors, opt_scalars = {}, {}
        for idx, per_param in opt["state"].items():
            for key, value in per_param.items():
                if torch.is_tensor(value):
                    opt_tensors[f"{idx}.{key}"] = value.detach().cpu().contiguous()
                else:
                    opt_scalars[f"{idx}.{key}"] = value
        save_tensors(opt_tensors, tmp / "optimizer.safetensors")

        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_tensors(rng, tmp / "rng.safetensors")

        vocab.save(tmp / "vocab.json")
        groups = opt["param_groups"]
        state = dict(meta, optimizer_param_groups=groups, optimizer_scalars=opt_scalars)
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")


def load_training_state(
    state_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict, DraftVocab]:
    """Restore model, optimizer and RNG in place; return (meta, vocab)."""
    state_dir = Path(state_dir)
    state = json.loads((state_dir / "state.json").read_text())
    model.load_state_dict(load_file(str(state_dir / "model.safetensors")), strict=True)

    per_param: dict[int, dict] = {}
    tensors = load_file(str(state_dir / "optimizer.safetensors"))  # moved to the params on load
    for name, value in {**tensors, **state.pop("optimizer_scalars")}.items():
        idx, key = name.split(".", 1)
        per_param.setdefault(int(idx), {})[key] = value
    groups = state.pop("optimizer_param_groups")
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})

    rng = load_file(str(state_dir / "rng.safetensors"))
    torch.set_rng_state(rng["cpu"])
    cuda_keys = sorted((k for k in rng if k.startswith("cuda.")), key=lambda k: int(k[5:]))
    cuda_states = [rng[k] for k in cuda_keys]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    return state, DraftVocab.load(state_dir / "vocab.json")
