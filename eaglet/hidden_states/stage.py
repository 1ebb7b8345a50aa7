"""The hidden_states stage, shard by shard: plan, build each shard (resumable, verifiable),
then write the index.

- Plan: one streaming pass over `examples.jsonl` cuts it into shards of about
  `shard_tokens` tokens, in file order; each shard is a byte range of that file. The plan
  depends only on the file and `shard_tokens`, never on where an earlier run stopped.
- Shard: its examples are read from their byte range, run through the backend
  (`hidden_states.backend`, from the registry `eaglet.hidden_states.backends`; the hf backend
  in length buckets), bounded by the shard (nothing holds the whole dataset), stored in file
  order, and written with their sha256 computed as the bytes go out. A record
  `progress/<shard>.json` (bytes, sha256, index rows) is then written atomically: a shard
  without one is not finished. On resume a finished shard is verified (size + sha256) and
  skipped; a corrupt or truncated one is rebuilt.
- Finish: `index.jsonl` from the records, in shard order.

Shard tasks only exchange `ShardSpec`s and small records, so many workers can build shards
of one partial folder at once (each writes only its own files).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eaglet.config import PipelineConfig
from eaglet.cpu_threads import apply_threads
from eaglet.errors import NonFiniteError
from eaglet.hidden_states.backends import hidden_states_backend
from eaglet.hidden_states.backends.base import FeatureSource
from eaglet.hidden_states.budget import check_disk_budget
from eaglet.hidden_states.feature_encoding import bytes_per_token, check_storage, encode
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION, layer_ids_of
from eaglet.hidden_states.reuse import FeatureReuse
from eaglet.hidden_states.shards import INDEX, join_samples, write_safetensors_hashed
from eaglet.progress import Throttle
from eaglet.records.examples import Example
from eaglet.reuse import earlier_runs_alike
from eaglet.storage import StageOutput, sha256_file, write_json_atomic
from eaglet.target import load_config

PLAN = "plan.json"
PROGRESS = "progress"


@dataclass(frozen=True)
class ShardSpec:
    """One shard's share of the examples file: bytes [start, end), its samples and tokens."""

    name: str
    start: int
    end: int
    samples: int
    tokens: int


def plan_shards(examples_path: Path, shard_tokens: int) -> list[ShardSpec]:
    """Cut the examples file into shards of at least `shard_tokens` tokens (the last one may
    be smaller), streaming it once."""
    specs: list[ShardSpec] = []
    start = offset = samples = tokens = 0

    def close() -> None:
        name = f"shard-{len(specs):05d}.safetensors"
        specs.append(ShardSpec(name, start, offset, samples, tokens))

    with open(examples_path, "rb") as handle:
        for line_number, line in enumerate(handle, 1):
            offset += len(line)
            if not line.strip():
                continue
            try:
                n = len(json.loads(line)["input_ids"])
            except (ValueError, KeyError) as exc:
                raise ValueError(
                    f"{examples_path}:{line_number}: not an example record ({exc}); rerun the "
                    "extract stage (eaglet run --refresh-from extract)"
                ) from None
            samples += 1
            tokens += n
            if tokens >= shard_tokens:
                close()
                start, samples, tokens = offset, 0, 0
    if samples:
        close()
    return specs


def load_or_write_plan(folder: Path, examples_path: Path, shard_tokens: int) -> list[ShardSpec]:
    """The partial folder's plan; written on the first run, reused by every resume."""
    path = folder / PLAN
    if path.is_file():
        return [ShardSpec(**row) for row in json.loads(path.read_text())["shards"]]
    specs = plan_shards(examples_path, shard_tokens)
    write_json_atomic(path, {"shard_tokens": shard_tokens, "shards": [asdict(s) for s in specs]})
    return specs


def read_examples(examples_path: Path, spec: ShardSpec) -> list[Example]:
    with open(examples_path, "rb") as handle:
        handle.seek(spec.start)
        data = handle.read(spec.end - spec.start)
    return [Example.model_validate_json(line) for line in data.splitlines() if line.strip()]


def record_path(folder: Path, name: str) -> Path:
    return folder / PROGRESS / f"{name}.json"


def read_record(folder: Path, name: str) -> dict | None:
    path = record_path(folder, name)
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def shard_finished(folder: Path, name: str, verify_hash: bool) -> dict | None:
    """The shard's record when the shard is there with the recorded size (and sha256 when
    `verify_hash`), else None (the shard must be built again)."""
    record = read_record(folder, name)
    shard = folder / name
    if record is None or not shard.is_file() or shard.stat().st_size != record["bytes"]:
        return None
    if verify_hash and sha256_file(shard) != record["sha256"]:
        return None
    return record


def encode_sample(
    example: Example, features: dict[str, torch.Tensor], storage: str
) -> dict[str, torch.Tensor]:
    n = len(example.input_ids)
    aux, final = features["aux_hidden_states"], features["final_hidden_states"]
    if aux.shape[0] != n or final.shape[0] != n:
        raise RuntimeError(
            f"sample {example.sample_id}: backend returned states for "
            f"{aux.shape[0]} tokens, expected {n}"
        )
    for name, states in (("aux_hidden_states", aux), ("final_hidden_states", final)):
        finite = torch.isfinite(states).all(dim=-1)  # [n]
        if not bool(finite.all()):
            position = int((~finite).nonzero()[0, 0])
            raise NonFiniteError(
                f"sample {example.sample_id}: the target's {name} are not finite (NaN or inf) "
                f"from token {position} of {n}: the target's weights or dtype are broken "
                "(check target.model's safetensors and target.dtype); nothing of it was stored"
            )
    return {
        "input_ids": torch.tensor(example.input_ids, dtype=torch.int64),  # [n]
        "loss_mask": torch.tensor(example.loss_mask, dtype=torch.uint8),  # [n]
        # [n, kH] (+ scales [n, k]): k target layers, each with its own scale
        **encode("aux_hidden_states", aux, storage, groups=aux.shape[-1] // final.shape[-1]),
        **encode("final_hidden_states", final, storage, groups=1),  # [n, H] (+ scales [n, 1])
    }


def build_shard(
    folder: Path,
    examples_path: Path,
    spec: ShardSpec,
    backend_factory: Callable[[], FeatureSource],
    storage: str,
    verify_hash: bool = True,
    on_tokens: Callable[[int], None] | None = None,
    reuse: FeatureReuse | None = None,
) -> dict:
    """Build one shard unless it is already finished (and verified); returns its record.
    `on_tokens(n)` as the backend finishes each batch of n tokens. `reuse`: samples whose
    token ids an earlier folder alike holds are copied from it, never computed again."""
    done = shard_finished(folder, spec.name, verify_hash)
    if done is not None:
        return {**done, "skipped": True}
    examples = read_examples(examples_path, spec)
    stored: dict[str, dict[str, torch.Tensor]] = {}
    for example in examples if reuse is not None else ():
        taken = reuse.take(example.sample_id, example.input_ids, example.loss_mask)
        if taken is not None:
            stored[example.sample_id] = taken
    todo = [e for e in examples if e.sample_id not in stored]
    if todo:  # no backend (no model load, no server) for a shard wholly reused
        features = backend_factory().features(todo, on_tokens=on_tokens)
        for example, computed in zip(todo, features, strict=True):
            stored[example.sample_id] = encode_sample(example, computed, storage)
        del features
    encoded = [stored.pop(e.sample_id) for e in examples]
    rows, offset = [], 0
    for example in examples:
        rows.append([example.sample_id, offset, len(example.input_ids)])
        offset += len(example.input_ids)
    written = write_safetensors_hashed(join_samples(encoded), folder / spec.name)
    record = {
        "shard": spec.name,
        "bytes": written.bytes,
        "sha256": written.sha256,
        "tokens": offset,
        "samples": rows,
    }
    (folder / PROGRESS).mkdir(exist_ok=True)
    write_json_atomic(record_path(folder, spec.name), record)
    return {**record, "skipped": False, "reused": len(examples) - len(todo)}


def write_index(folder: Path, specs: list[ShardSpec]) -> dict[str, dict[str, Any]]:
    """`index.jsonl` from the shard records; returns the shards' recorded hashes (for the
    manifest, so it need not read them again)."""
    files: dict[str, dict[str, Any]] = {}
    tmp = folder / (INDEX + ".tmp")
    with open(tmp, "w", encoding="utf-8") as index:  # streamed: one shard's rows at a time
        for spec in specs:
            record = read_record(folder, spec.name)
            if record is None:
                raise RuntimeError(f"{folder / spec.name}: shard not finished; rerun the stage")
            files[spec.name] = {"sha256": record["sha256"], "bytes": record["bytes"]}
            for sample_id, offset, length in record["samples"]:
                row = {"sample_id": sample_id, "shard": spec.name, "offset": offset}
                index.write(json.dumps({**row, "length": length}) + "\n")
    tmp.replace(folder / INDEX)
    for stray in folder.glob("*.tmp"):
        stray.unlink()
    return files


class Progress:
    """Tokens done against the plan, with rate and ETA, reported at most every `every_s`."""

    def __init__(self, total_tokens: int, report: Callable[[str], None], every_s: float = 5.0):
        self.total, self.report, self.every_s = total_tokens, report, every_s
        self.done = 0
        self.started = time.time()
        self.throttle = Throttle(every_s)

    def add(self, tokens: int, force: bool = False) -> None:
        self.done += tokens
        if not self.throttle.ready(force or self.done >= self.total):
            return
        now = time.time()
        rate = self.done / max(now - self.started, 1e-9)
        eta = (self.total - self.done) / max(rate, 1e-9)
        self.report(
            f"hidden states {self.done}/{self.total} tokens "
            f"({100.0 * self.done / max(self.total, 1):.1f}%), {rate:.0f} tokens/s, ETA {eta:.0f} s"
        )

    @property
    def fraction(self) -> float:
        return self.done / max(self.total, 1)


def backend_factory(
    config: PipelineConfig,
    stack: ExitStack | None = None,
    folder: Path | None = None,
    report: Callable[[str], None] = print,
) -> Callable[[], FeatureSource]:
    """A factory that opens the backend's source on first use: skipped shards never load a
    model. With a `stack`, the servers the backend starts for a stage (the vllm backend's
    `hidden_states.vllm.vllm_python`) start in `folder` on first use too, and they stop and
    the source closes when the stack closes."""
    made: list[FeatureSource] = []

    def get() -> FeatureSource:
        if not made:
            apply_threads("hidden_states", report=report)  # in the thread that computes
            backend = hidden_states_backend(config.hidden_states.backend)
            run = config
            if stack is not None:
                run = stack.enter_context(backend.serving(config, folder, report))
            # at the layers the run's draft method reads (hf: the target loaded in this
            # process; vllm: a client of its servers)
            made.append(backend.open(run.target, run.hidden_states, target_shape(run)[2]))
            if stack is not None:
                stack.callback(made[0].close)
        return made[0]

    return get


def target_shape(config: PipelineConfig) -> tuple[int, int, list[int]]:
    """(num_layers, hidden_size, aux_layer_ids) from the target's config alone."""
    cfg = load_config(config.target)
    return cfg.num_hidden_layers, cfg.hidden_size, layer_ids_of(config, cfg.num_hidden_layers)


def prepare_stage(config: PipelineConfig, folder: Path, examples_path: Path) -> list[ShardSpec]:
    """Plan the shards (or reload the plan) and check the disk budget (before any work)."""
    _, hidden_size, _ = target_shape(config)
    storage = config.hidden_states.storage
    check_storage(storage)
    specs = load_or_write_plan(folder, examples_path, config.hidden_states.shard_tokens)
    check_disk_budget(
        Path(config.work_dir),
        sum(s.tokens for s in specs),
        hidden_size,
        storage,
        already_written=sum(
            record["bytes"]
            for spec in specs
            if (record := read_record(folder, spec.name)) is not None
        ),
    )
    return specs


def stage_body(
    config: PipelineConfig,
    examples_path: Path,
    report: Callable[[str], None] = print,
    on_progress: Callable[[float], None] | None = None,
    verify_hash: bool = True,
) -> Callable[[Path], StageOutput]:
    """The stage as a `run_stage` body: plan, budget, every shard not yet finished (built
    here, one after another, or already built by mapped shard tasks), index. `verify_hash`
    False checks finished shards by size only (mapped shard tasks have just verified or
    built each one: reading them all again would double the stage's reads)."""

    def body(folder: Path) -> StageOutput:
        settings = config.hidden_states
        num_layers, hidden_size, ids = target_shape(config)
        specs = prepare_stage(config, folder, examples_path)
        progress = Progress(sum(s.tokens for s in specs), report)
        earlier = earlier_runs_alike("hidden_states", config, folder)
        reuse = FeatureReuse(earlier) if earlier else None
        reused = computed = 0
        with ExitStack() as stack:  # servers the backend started stop when the loop ends
            get_backend = backend_factory(config, stack, folder, report)
            for spec in specs:
                within = [0]  # tokens of this shard reported so far

                def on_tokens(tokens: int, within: list[int] = within) -> None:
                    within[0] += tokens
                    progress.add(tokens)  # a line inside a long shard too
                    if on_progress is not None:
                        on_progress(progress.fraction)

                record = build_shard(
                    folder, examples_path, spec, get_backend, settings.storage, verify_hash,
                    on_tokens, reuse,
                )  # fmt: skip
                if not record["skipped"]:
                    reused += record["reused"]
                    computed += len(record["samples"]) - record["reused"]
                progress.add(spec.tokens - within[0], force=not record["skipped"])
                if on_progress is not None:
                    on_progress(progress.fraction)
        if reuse is not None:
            reuse.close()
            report(
                f"hidden states: {reused} samples' features reused from {', '.join(reuse.sources)} "
                f"(same token ids, target, layers, storage and code), {computed} computed"
            )
        files = write_index(folder, specs)
        info = {
            "aux_layer_ids": ids,
            "aux_layer_convention": AUX_LAYER_CONVENTION,
            "num_hidden_layers": num_layers,
            "hidden_size": hidden_size,
            "storage": settings.storage,
            "backend": settings.backend,
            "bytes_per_token": bytes_per_token(hidden_size, settings.storage, len(ids)),
            "shards": [s.name for s in specs],
            "tokens": sum(s.tokens for s in specs),
            "samples": sum(s.samples for s in specs),
            "reused_samples": reused,
            "computed_samples": computed,
        }
        counts = {"records": info["samples"], "tokens": info["tokens"]}
        return StageOutput(counts=counts, info=info, files=files)

    return body
