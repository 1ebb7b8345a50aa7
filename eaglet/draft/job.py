"""The training job: one typed record (`TrainJob`) of what a training run reads and where it
writes, built by the train stage (`pipeline_job`) or a caller (`train_job`), written by the
launcher as `<out_dir>/job.json` and read back by every torchrun process (`TrainJob.read`), on
this machine or another (train.nnodes). It replaced a dict dumped from the configs and
validated again field by field in each reader.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pydantic import Field, model_validator

from eaglet.config import HiddenStatesConfig, PipelineConfig, TargetConfig, TrainConfig
from eaglet.config_fields import Strict
from eaglet.hidden_states.feature_encoding import bytes_per_token
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION, layer_ids_of
from eaglet.hidden_states.shards import read_index
from eaglet.records.examples import Example
from eaglet.records.io import read_jsonl
from eaglet.split import heldout_ids
from eaglet.target import load_config

JOB_FILE = "job.json"


class TrainJob(Strict):
    """A training run: offline from `hidden_states_dir`, or online from `examples_path` with
    features from the backend `online_source` names."""

    out_dir: Path
    target: TargetConfig
    train: TrainConfig
    aux_layer_ids: list[int]
    aux_layer_convention: str
    exclude_sample_ids: list[str] = Field(default_factory=list)
    hidden_states_dir: Path | None = None
    examples_path: Path | None = None
    resume: bool = True
    # the hidden-state settings the online source computes the features with
    online_source: HiddenStatesConfig = Field(default_factory=HiddenStatesConfig)
    # the run's work dir: where the machines of train.nnodes > 1 meet (eaglet/draft/nodes.py)
    work_dir: Path | None = None

    @model_validator(mode="after")
    def _one_source(self) -> TrainJob:
        if (self.hidden_states_dir is None) == (self.examples_path is None):
            raise ValueError("a training job reads a hidden-states folder or an examples file")
        return self

    @property
    def online(self) -> bool:
        return self.examples_path is not None

    @property
    def path(self) -> Path:
        return self.out_dir / JOB_FILE

    def write(self) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.model_dump_json(indent=2) + "\n")
        return self.path

    @classmethod
    def read(cls, path: Path) -> TrainJob:
        return cls.model_validate_json(Path(path).read_text())

    def rendezvous_id(self) -> str:
        """train.rdzv_id, or one every machine derives alike from the work dir's path."""
        if self.train.rdzv_id:
            return self.train.rdzv_id
        where = str((self.work_dir or self.out_dir).resolve())
        return "eaglet-" + hashlib.sha256(where.encode()).hexdigest()[:12]


def train_job(
    out_dir: Path,
    target: TargetConfig,
    train: TrainConfig,
    aux_layer_ids: list[int],
    aux_layer_convention: str,
    exclude_sample_ids: set[str] | frozenset[str] = frozenset(),
    hidden_states_dir: Path | None = None,
    examples_path: Path | None = None,
    resume: bool = True,
    hidden_states: HiddenStatesConfig | None = None,
    work_dir: Path | None = None,
) -> TrainJob:
    """The job: offline with `hidden_states_dir`, online with `examples_path`."""
    return TrainJob(
        out_dir=Path(out_dir),
        target=target,
        train=train,
        aux_layer_ids=list(aux_layer_ids),
        aux_layer_convention=aux_layer_convention,
        exclude_sample_ids=sorted(exclude_sample_ids),
        hidden_states_dir=hidden_states_dir,
        examples_path=examples_path,
        resume=resume,
        online_source=hidden_states or HiddenStatesConfig(),
        work_dir=work_dir,
    )


def pipeline_job(
    config: PipelineConfig,
    out_dir: Path,
    features_dir: Path | None = None,
    features_info: dict | None = None,
    examples_path: Path | None = None,
) -> TrainJob:
    """The train stage's job: offline from the hidden_states stage's folder and manifest info,
    online from the extract stage's examples file (aux layer ids resolved as the hidden_states
    stage would). Held-out samples (train.holdout_fraction) are left out either way."""
    fraction = config.train.holdout_fraction
    if features_dir is not None:
        assert features_info is not None
        ids = [row["sample_id"] for row in read_index(features_dir)]
        aux_ids = features_info["aux_layer_ids"]
        convention = features_info["aux_layer_convention"]
    else:
        assert examples_path is not None
        ids = [e.sample_id for e in read_jsonl(examples_path, Example)]
        num_layers = load_config(config.target).num_hidden_layers
        aux_ids = layer_ids_of(config, num_layers)
        convention = AUX_LAYER_CONVENTION
    return train_job(
        out_dir,
        config.target,
        config.train,
        aux_ids,
        convention,
        exclude_sample_ids=heldout_ids(ids, fraction),
        hidden_states_dir=features_dir,
        examples_path=examples_path,
        hidden_states=config.hidden_states,
        work_dir=Path(config.work_dir),
    )


def feature_disk(
    config: PipelineConfig, features_dir: Path | None = None, examples_path: Path | None = None
) -> dict:
    """For the manifest: which mode ran, the feature bytes it stored, and (online) the bytes
    the offline shards of the same examples (held-out ones included, as the hidden_states stage
    stores them) would have taken in hidden_states.storage."""
    if features_dir is not None:
        stored = sum(f.stat().st_size for f in Path(features_dir).glob("*.safetensors"))
        return {"hidden_states_mode": "offline", "feature_bytes_stored": stored}
    assert examples_path is not None
    tokens = sum(len(e.input_ids) for e in read_jsonl(examples_path, Example))
    hidden_size = load_config(config.target).hidden_size
    per_token = bytes_per_token(hidden_size, config.hidden_states.storage)
    return {
        "hidden_states_mode": "online",
        "feature_bytes_stored": 0,
        "feature_bytes_saved": tokens * per_token,
        "feature_bytes_saved_storage": config.hidden_states.storage,
    }
