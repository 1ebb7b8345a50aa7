"""Why a stage runs, and what a run will do before it starts (`eaglet run --plan`).

A stage runs when no complete folder holds its key (`eaglet.cache`). Its reasons are read
against the stage's previous complete folder in the work dir (the newest other one): the
config values of its key that differ (dotted paths, old and new value), the modules of its code
whose source differs (each manifest records its modules' hashes), and the upstream stages whose
output (their files' content) differs from what the previous folder read. A reason is recorded
in the manifest (`why`), logged when the stage starts, and shown by the run report.

The plan walks the stages as the flow would, computing each key from what the stages before it
wrote. A stage that will run has no output yet: the plan assumes it writes what it wrote before
(its previous folder), so a later stage whose folder exists under that assumption is "Cached if
<stage> writes the same files" (early cutoff), and runs otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eaglet.cache import PLUG_IN_MODULE, code_hash, code_modules, stage_config, stage_key
from eaglet.config import PipelineConfig
from eaglet.records.examples import Example
from eaglet.records.io import read_jsonl
from eaglet.records.prompts import Prompt
from eaglet.reuse import earlier_runs_alike, reusable_generations
from eaglet.stages import EXAMPLES_FILE, PRODUCER, PROMPTS_FILE, STAGE, STAGE_LIST, STAGES
from eaglet.storage import (
    PARTIAL_SUFFIX,
    Manifest,
    ManifestError,
    StageCorruptError,
    check_stage_folder,
    read_manifest,
    stage_dir,
    stage_folder,
)

MAX_SHOWN = 6  # config paths or modules named in one reason
# The setting that chooses each registry's entry a stage plugs in (`Stage.plug_ins`).
PLUG_IN_SETTING = {
    "engine": "generation.engine",
    "backend": "hidden_states.backend",
    "method": "train.method",
}


def previous_folder(work_dir: Path, stage: str, key: str) -> Manifest | None:
    """The newest complete folder of `stage` in `work_dir` other than `key`'s (None if none)."""
    folder = Path(work_dir) / stage
    if not folder.is_dir():
        return None
    found: list[Manifest] = []
    for entry in folder.iterdir():
        if entry.name == key or not entry.is_dir() or "." in entry.name:  # .partial, .replaced-
            continue
        try:
            manifest = read_manifest(entry)
        except ManifestError:
            continue
        if manifest is not None:
            found.append(manifest)
    return max(found, key=lambda m: m.finished, default=None)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for name, inner in value.items():
            out.update(_flat(inner, f"{prefix}.{name}" if prefix else str(name)))
        return out
    return {prefix: value}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _named(items: list[str]) -> str:
    more = f" and {len(items) - MAX_SHOWN} more" if len(items) > MAX_SHOWN else ""
    return ", ".join(items[:MAX_SHOWN]) + more


def config_reason(current: dict[str, Any], previous: dict[str, Any]) -> str | None:
    """'config: generation.max_tokens 256 -> 512, ...' for the keyed values that differ."""
    now, before = _flat(current), _flat(previous)
    changed = sorted(k for k in now.keys() | before.keys() if now.get(k) != before.get(k))
    if not changed:
        return None
    shown = [f"{k} {_short(before.get(k))} -> {_short(now.get(k))}" for k in changed]
    return f"config changed: {_named(shown)}"


def code_reason(
    current: dict[str, str], previous: Manifest, current_hash: str, config_changed: bool = False
) -> str | None:
    """'code changed: eaglet.extract, ...' naming the modules whose source differs. With
    `config_changed`, modules that only joined or left the stage's code are the config's
    doing (another `train.method`, engine or backend brings its own module), not a code change."""
    if previous.code_hash == current_hash:
        return None
    if not previous.code_modules:
        return "code changed (the earlier folder did not record its modules)"
    before = previous.code_modules
    edited = [m for m in current.keys() & before.keys() if current[m] != before[m]]
    moved = [] if config_changed else list(current.keys() ^ before.keys())
    changed = sorted(edited + moved)
    return f"code changed: {_named(changed)}" if changed else None


def plug_in_reason(
    stage: str, config: PipelineConfig, keyed: dict[str, Any], previous: Manifest
) -> str | None:
    """'config changed: train.method, now 'dflash'' when the entry a stage plugs in (its
    draft method, engine, backend) is another than the previous folder's code held, and the
    stage's keyed config does not already say so (evaluate is keyed by the draft it reads,
    not by train.method)."""
    if not previous.code_modules:
        return None
    changed = []
    for kind in STAGE[stage].code_plug_ins(config):
        setting, module = PLUG_IN_SETTING[kind], PLUG_IN_MODULE[kind](config)
        if module is None or module in previous.code_modules or setting in keyed:
            continue
        section, name = setting.split(".")
        changed.append(f"{setting}, now {getattr(getattr(config, section), name)!r}")
    return f"config changed: {_named(changed)}" if changed else None


def upstream_reason(upstream: list[Manifest], previous: Manifest) -> str | None:
    """'upstream output changed: extract' for the stages read whose files differ."""
    changed = []
    for manifest in upstream:
        before = previous.upstream_outputs.get(manifest.stage)
        if before is None:  # an earlier manifest: its upstream's key is all it recorded
            if previous.upstream.get(manifest.stage) != manifest.key:
                changed.append(manifest.stage)
        elif before != manifest.output_hash():
            changed.append(manifest.stage)
    return f"upstream output changed: {', '.join(changed)}" if changed else None


def why_it_runs(
    stage: str,
    config: PipelineConfig,
    upstream: list[Manifest],
    refresh: bool = False,
    modules: dict[str, str] | None = None,
) -> list[str]:
    """Why `stage` cannot reuse a folder (empty when its folder is complete and no refresh)."""
    work_dir = Path(config.work_dir)
    key = stage_key(stage, config, upstream)
    if refresh:
        return ["refresh asked for (refresh_from)"]
    try:
        if check_stage_folder(stage_folder(work_dir, stage, key)) is not None:
            return []
    except (ManifestError, StageCorruptError) as exc:
        return [f"its folder cannot be trusted: {str(exc).splitlines()[0]}"]
    reasons = []
    partial = stage_folder(work_dir, stage, key).with_name(key + PARTIAL_SUFFIX)
    if partial.is_dir() and STAGE[stage].resumes:
        reasons.append(f"resumes its unfinished folder {partial.name}")
    previous = previous_folder(work_dir, stage, key)
    if previous is None:
        return reasons or ["first run of this stage in this work dir"]
    modules = code_modules(stage, config) if modules is None else modules
    keyed = stage_config(stage, config)
    by_config = [
        config_reason(keyed, previous.config),
        plug_in_reason(stage, config, keyed, previous),
    ]
    found = [
        *by_config,
        code_reason(modules, previous, code_hash(stage, config), any(by_config)),
        upstream_reason(upstream, previous),
    ]
    reasons += [r for r in found if r]
    return reasons or [f"no complete folder for its key (the last one is {previous.key})"]


@dataclass
class StagePlan:
    stage: str
    state: str  # "Cached", "runs", "skipped" (online), or "Cached if ..." (early cutoff)
    key: str = ""
    reasons: list[str] = field(default_factory=list)

    def line(self) -> str:
        why = f": {'; '.join(self.reasons)}" if self.reasons else ""
        return f"  {self.stage:<14} {self.state}{why}"


def plan_run(
    config: PipelineConfig, until: str = STAGES[-1], refresh_from: str | None = None
) -> list[StagePlan]:
    """What `eaglet run` would do, stage by stage, without running anything."""
    work_dir = Path(config.work_dir)
    outputs: dict[str, Manifest] = {}  # what each stage wrote, or (if it runs) wrote last time
    running: dict[str, list[str]] = {}  # stage -> the stages that run whose output it waits on
    plans = []
    refresh_index = STAGES.index(refresh_from) if refresh_from else len(STAGES)
    for spec in STAGE_LIST[: STAGES.index(until) + 1]:
        if not spec.runs(config):
            plans.append(StagePlan(spec.name, "skipped (train.hidden_states: online)"))
            continue
        missing = [name for name in spec.inputs(config) if name not in outputs]
        if missing:
            plans.append(StagePlan(spec.name, "runs", reasons=[
                f"reads {', '.join(missing)}, which no earlier run wrote"
            ]))  # fmt: skip
            continue
        upstream = [outputs[name] for name in spec.inputs(config)]
        key = stage_key(spec.name, config, upstream)
        refresh = STAGES.index(spec.name) >= refresh_index
        reasons = why_it_runs(spec.name, config, upstream, refresh)
        waits = sorted({s for m in upstream for s in running.get(m.stage, [])}, key=STAGES.index)
        if not reasons:
            folder = stage_folder(work_dir, spec.name, key)
            outputs[spec.output] = read_manifest(folder)  # type: ignore[assignment]
            state = "Cached"
            if waits:
                verb = "writes" if len(waits) == 1 else "write"
                state = f"Cached if {' and '.join(waits)} {verb} the same files as before"
                running[spec.name] = waits
            plans.append(StagePlan(spec.name, state, key))
            continue
        if not waits and len(upstream) >= 1:  # its input is known: count what it would reuse
            reused = REUSE_ESTIMATES.get(spec.name)
            estimate = reused and reused(
                config, stage_dir(work_dir, upstream[0]), stage_folder(work_dir, spec.name, key)
            )
            if estimate:
                reasons.append(f"{estimate[0]} samples reused, {estimate[1]} computed")
        plans.append(StagePlan(spec.name, "runs", key, reasons))
        running[spec.name] = [spec.name]
        previous = _own_folder(work_dir, spec.name, key) if refresh else None
        previous = previous or previous_folder(work_dir, spec.name, key)
        if previous is not None:  # assume it writes what it wrote before (early cutoff)
            outputs[spec.output] = previous
    return plans


def _own_folder(work_dir: Path, stage: str, key: str) -> Manifest | None:
    """The complete folder of `key` itself (a refresh sets it aside and writes it again)."""
    try:
        return check_stage_folder(stage_folder(work_dir, stage, key))
    except (ManifestError, StageCorruptError):
        return None


def generations_reused(
    config: PipelineConfig, prompts_folder: Path, folder: Path
) -> tuple[int, int] | None:
    """generate's reuse estimate: (records reused, prompts sent) if it ran now into
    `folder` from the prompts in `prompts_folder`; None with turn-by-turn regeneration."""
    if config.tokenize.regenerate == "all":
        return None
    prompts = list(read_jsonl(prompts_folder / PROMPTS_FILE, Prompt))
    taken, _ = reusable_generations(config, prompts, folder)
    return len(taken), len(prompts) - len(taken)


def features_reused(
    config: PipelineConfig, examples_folder: Path, folder: Path
) -> tuple[int, int] | None:
    """hidden_states' reuse estimate: (samples whose features are reused, samples
    computed) if it ran now into `folder` from the examples in `examples_folder`."""
    from eaglet.hidden_states.reuse import FeatureReuse

    rows = list(read_jsonl(examples_folder / EXAMPLES_FILE, Example))
    earlier = earlier_runs_alike(PRODUCER["features"], config, folder)
    if not earlier:
        return 0, len(rows)
    reuse = FeatureReuse(earlier)
    found = sum(reuse.has(e.sample_id, e.input_ids) for e in rows)
    reuse.close()
    return found, len(rows) - found


# A stage -> how many samples `eaglet run --plan` expects a rerun of it to reuse and compute
# (a stage with none reuses nothing).
REUSE_ESTIMATES: dict[str, Callable[[PipelineConfig, Path, Path], tuple[int, int] | None]] = {
    PRODUCER["generations"]: generations_reused,
    PRODUCER["features"]: features_reused,
}
