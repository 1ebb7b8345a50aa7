"""speculators' layout (speculators 0.9.0's model registry: `eagle3`, `dflash`, `dspark`), what
every method's speculators export shares: the `speculators_config` section (the algorithm, one
greedy proposal method with its k, the verifier) and the writing of a folder whose weights are
the vLLM export's under the same names; the verifier named without an absolute path.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from eaglet.config.target import TargetConfig
from eaglet.storage import atomic_folder


def speculators_section(
    algorithm: str, k: int, verifier: str, verifier_architectures: list[str]
) -> dict[str, object]:
    """`speculators_config`: what speculators and vLLM read to serve the draft at k."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": int(k),
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
    }


def verifier_name(target: TargetConfig, export_dir: Path) -> str:
    """What an export names as its target: a hub id as it is; a local folder by its path
    relative to the export folder, never an absolute one (a work dir moved or copied with its
    target, as the demo's is, still names it; an absolute path would name the old place).
    Serving such an export as the main model resolves that path from the export folder."""
    folder = Path(target.model)
    if not folder.is_dir():
        return target.model
    return os.path.relpath(folder.resolve(), Path(export_dir).resolve())


def write_same_weights(draft_dir: Path, out_dir: Path, config: dict[str, object]) -> Path:
    """`out_dir`: `config` as config.json beside the vLLM export's model.safetensors, whose
    tensor names the layout shares."""
    with atomic_folder(Path(out_dir)) as tmp:
        shutil.copyfile(Path(draft_dir) / "model.safetensors", tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(out_dir)
