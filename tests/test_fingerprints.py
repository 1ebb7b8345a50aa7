"""What a run reads from outside its work dir is fingerprinted by every byte
(`eaglet.fingerprints`): a row edited in the middle of a large dataset file re-runs download
even with its size and mtime kept; a large file's hash is recorded and reused until the file
changes; the target's folder is keyed by the parts each stage reads, so a README keys nothing
and a template edit leaves generate's settings as they were."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from eaglet import fingerprints
from eaglet.cache import stage_config, stage_key
from eaglet.config import load_config
from eaglet.fingerprints import file_sha256, target_parts
from eaglet.records.io import read_jsonl
from eaglet.records.samples import Sample
from eaglet.stage_bodies.every_stage import run_stage_without_prefect
from eaglet.stage_context import PlainContext
from eaglet.stages import SAMPLES_FILE, STAGES
from eaglet.storage import sha256_file


@pytest.fixture(autouse=True)
def own_hash_records(tmp_path, monkeypatch):
    monkeypatch.setenv(fingerprints.HASH_CACHE_ENV, str(tmp_path / "hash-records"))


def large_dataset(path: Path, rows: int = 2400) -> Path:
    """A JSONL dataset over `RECORDED_BYTES` (about 9 MiB): rows of one long user turn."""
    with open(path, "w") as out:
        for i in range(rows):
            text = f"row {i}: how long is {240 + i % 7} hours? " + "x" * 3800
            out.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")
    assert path.stat().st_size > fingerprints.RECORDED_BYTES
    return path


def edit_in_place_keeping_size_and_mtime(path: Path, old: bytes, new: bytes) -> None:
    """Replace the first `old` after the file's middle by `new` (same length), then set the
    mtime back, as a careless copy or `touch -r` would."""
    assert len(old) == len(new)
    before = path.stat()
    data = path.read_bytes()
    at = data.index(old, len(data) // 2)
    with open(path, "r+b") as handle:
        handle.seek(at)
        handle.write(new)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_a_row_edited_in_the_middle_of_a_large_file_re_runs_download(tmp_path):
    data = large_dataset(tmp_path / "big.jsonl")
    config = load_config(
        None, [f"work_dir={tmp_path / 'work'}", f"datasets=[{{source: big, path: {data}}}]"]
    )
    first = run_stage_without_prefect("download", config, {}, PlainContext())
    assert stage_key("download", config, []) == first.key  # the hash was recorded: same key

    edit_in_place_keeping_size_and_mtime(data, b"240 hours", b"241 hours")
    assert file_sha256(data) == sha256_file(data)  # every byte, not the recorded hash
    second = run_stage_without_prefect("download", config, {}, PlainContext())
    assert second.key != first.key

    def texts(manifest) -> list[str]:
        path = tmp_path / "work" / manifest.path / SAMPLES_FILE
        return [s.messages[0]["content"] for s in read_jsonl(path, Sample)]

    differ = [(a, b) for a, b in zip(texts(first), texts(second), strict=True) if a != b]
    assert len(differ) == 1 and differ[0][1] == differ[0][0].replace("240 hours", "241 hours")


def test_a_large_files_hash_is_recorded_and_taken_until_the_file_changes(tmp_path, monkeypatch):
    data = large_dataset(tmp_path / "big.jsonl")
    hashed: list[Path] = []
    original = fingerprints._hash_stream

    def counting(path: Path, size: int) -> str:
        hashed.append(path)
        return original(path, size)

    monkeypatch.setattr(fingerprints, "_hash_stream", counting)
    first = file_sha256(data)
    assert file_sha256(data) == first and len(hashed) == 1  # the second from its record
    assert first == sha256_file(data)

    edit_in_place_keeping_size_and_mtime(data, b"x" * 9, b"y" * 9)  # ctime moves
    assert file_sha256(data) != first and len(hashed) == 2

    copy = tmp_path / "copy.jsonl"
    shutil.copy2(data, copy)  # another path: hashed, never taken from another file's record
    assert file_sha256(copy) == file_sha256(data) and len(hashed) == 3


@pytest.fixture
def target(tmp_path, fixture_model_dir) -> Path:
    folder = tmp_path / "target"
    shutil.copytree(fixture_model_dir, folder)
    return folder


def keyed(target: Path, work: Path) -> dict[str, dict]:
    config = load_config(None, [f"target.model={target}", f"work_dir={work}"])
    return {stage: stage_config(stage, config) for stage in STAGES}


def changed_stages(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    return [stage for stage in STAGES if before[stage] != after[stage]]


def test_a_file_no_stage_reads_keys_nothing(target, tmp_path):
    before = keyed(target, tmp_path / "work")
    (target / "README.md").write_text("# a model card\n")
    (target / "LICENSE").write_text("MIT\n")
    (target / "figure.png").write_bytes(b"\x89PNG")
    assert changed_stages(before, keyed(target, tmp_path / "work")) == []


def test_each_part_of_the_target_keys_the_stages_that_read_it(target, tmp_path):
    work = tmp_path / "work"
    parts = target_parts(str(target))
    before = keyed(target, work)

    config_json = json.loads((target / "tokenizer_config.json").read_text())
    template_file = target / "chat_template.jinja"
    if template_file.is_file():  # the template lives in its own file
        template_file.write_text(template_file.read_text() + "{# edited #}")
    else:
        config_json["chat_template"] += "{# edited #}"
        (target / "tokenizer_config.json").write_text(json.dumps(config_json))
    after = target_parts(str(target))
    assert [p for p in parts if parts[p] != after[p]] == ["chat_template"]
    # generate's settings stay: its per-sample reuse takes every prompt the edit left alone
    assert changed_stages(before, keyed(target, work)) == ["tokenize", "extract", "evaluate"]

    before = keyed(target, work)
    generation = json.loads((target / "generation_config.json").read_text())
    generation["eos_token_id"] = [1, 2]
    (target / "generation_config.json").write_text(json.dumps(generation))
    assert changed_stages(before, keyed(target, work)) == [
        "generate", "extract", "train", "evaluate",
    ]  # fmt: skip

    before = keyed(target, work)
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    assert changed_stages(before, keyed(target, work)) == [
        "tokenize", "generate", "hidden_states", "train", "evaluate",
    ]  # fmt: skip


def test_a_hub_id_is_keyed_by_its_id_and_revision():
    assert set(target_parts("org/model", "abc").values()) == {"hub:org/model@abc"}
