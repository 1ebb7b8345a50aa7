"""Per-sample reuse across keys: a stage that must run again only because what it reads changed
takes every sample whose input is unchanged from an earlier complete folder of the same stage
that ran the same code with the same settings, and computes only the rest.

A folder qualifies when its manifest's keyed config equals this run's and its code hash too:
then the only difference is upstream output, and a sample whose own input is equal (its prompt
ids and sampling for `generate`, its token ids for `hidden_states`) gets the same output. A
setting that changes every sample (another target, other layers, another storage form) changes
the keyed config, and nothing is reused. The folders are read, never changed. This module
reuses records; `eaglet.hidden_states.reuse` features.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eaglet.cache import code_hash, stage_config
from eaglet.config import PipelineConfig
from eaglet.records.prompts import Prompt
from eaglet.stages import GENERATIONS_FILE, writer_of
from eaglet.storage import PARTIAL_SUFFIX, Manifest, ManifestError, read_manifest


def earlier_runs_alike(stage: str, config: PipelineConfig, folder: Path) -> list[Path]:
    """Complete folders of `stage` in the work dir, newest first, that ran this stage's code
    with this run's keyed config (`folder`, the one being written, left out)."""
    own_key = folder.name.removesuffix(PARTIAL_SUFFIX)
    wanted_config, wanted_code = stage_config(stage, config), code_hash(stage, config)
    found: list[Manifest] = []
    root = Path(config.work_dir).resolve() / stage
    for entry in root.iterdir() if root.is_dir() else ():
        if not entry.is_dir() or entry.name == own_key or "." in entry.name:
            continue
        try:
            manifest = read_manifest(entry)
        except ManifestError:
            continue
        if (
            manifest is not None
            and manifest.code_hash == wanted_code
            and json.dumps(manifest.config, sort_keys=True, default=str)
            == json.dumps(wanted_config, sort_keys=True, default=str)
        ):
            found.append(manifest)
    found.sort(key=lambda m: m.finished, reverse=True)
    return [root / m.key for m in found]


def _prompt_key(source: str, prompt_ids: list[int], sampling: dict | None) -> str:
    return json.dumps([source, prompt_ids, sampling], sort_keys=True)


def reusable_generations(
    config: PipelineConfig, prompts: list[Prompt], folder: Path
) -> tuple[dict[str, bytes], list[str]]:
    """The earlier record lines (sample id -> line) of the prompts that did not change (same
    source, prompt ids and sampling) in folders alike, and the folders they come from."""
    wanted = {p.sample_id: _prompt_key(p.source, p.prompt_ids, p.sampling) for p in prompts}
    taken: dict[str, bytes] = {}
    sources = []
    for earlier in earlier_runs_alike(writer_of(GENERATIONS_FILE), config, folder):
        before = len(taken)
        with open(earlier / GENERATIONS_FILE, "rb") as handle:
            for line in handle:
                record = json.loads(line)
                sample_id = record["sample_id"]
                if sample_id in taken or sample_id not in wanted:
                    continue
                key = _prompt_key(record["source"], record["prompt_ids"], record.get("sampling"))
                if key == wanted[sample_id]:
                    taken[sample_id] = line
        if len(taken) > before:
            sources.append(earlier.name)
    return taken, sources


def seed_generations(
    config: PipelineConfig, prompts: list[Prompt], out_path: Path
) -> tuple[int, list[str]]:
    """Write into the new `out_path` the earlier records of the prompts that did not change,
    their lines copied byte for byte; returns how many and the folders they came from. Does
    nothing when `out_path` exists (a resumed run)."""
    if out_path.exists():
        return 0, []
    taken, sources = reusable_generations(config, prompts, out_path.parent)
    written = 0
    if taken:
        with open(out_path, "wb") as out:
            for prompt in prompts:  # in the prompts' order
                line = taken.pop(prompt.sample_id, None)
                if line is not None:
                    out.write(line if line.endswith(b"\n") else line + b"\n")
                    written += 1
            out.flush()
            os.fsync(out.fileno())
    return written, sources
