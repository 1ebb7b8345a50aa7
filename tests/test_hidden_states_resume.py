"""Resume per shard: kill -9 the stage at random points, rerun, get the bytes of an
uninterrupted run; corrupt or truncated shards are rebuilt; the disk budget refuses on a real
small filesystem."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglet.hidden_states.budget import DiskBudgetError
from eaglet.hidden_states.stage import read_record, stage_body
from eaglet.storage import run_stage
from tests.conftest import small_tmpfs
from tests.hidden_states_helpers import config_for, tiny_target, write_examples

ROOT = Path(__file__).resolve().parents[1]

RUNNER = """
import sys
from pathlib import Path
from eaglet.hidden_states.stage import stage_body
from eaglet.storage import run_stage
from tests.hidden_states_helpers import config_for

work, model, examples = (Path(a) for a in sys.argv[1:4])
config = config_for(work, model, storage="int8", shard_tokens=256)
body = stage_body(config, examples, report=lambda line: print(line, flush=True))
run_stage(work_dir=work, stage="hidden_states", key="k", code_hash="c", config={},
          upstream=[], body=body, resume_partial=True)
print("DONE", flush=True)
"""


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return tiny_target(tmp_path_factory.mktemp("target") / "model")


def start(work: Path, model: Path, examples: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(work), str(model), str(examples)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def folder_bytes(folder: Path) -> dict[str, bytes]:
    names = ["index.jsonl", *sorted(p.name for p in folder.glob("shard-*.safetensors"))]
    return {name: (folder / name).read_bytes() for name in names}


@pytest.mark.slow  # real processes end to end
def test_kill_9_at_random_points_then_rerun_gives_the_uninterrupted_bytes(target_dir, tmp_path):
    examples = tmp_path / "examples.jsonl"
    write_examples(examples, 60, seed=1)
    reference = config_for(tmp_path / "reference", target_dir, storage="int8", shard_tokens=256)
    run_stage(
        work_dir=tmp_path / "reference",
        stage="hidden_states",
        key="k",
        code_hash="c",
        config={},
        upstream=[],
        body=stage_body(reference, examples, report=lambda _: None),
    )  # the same call as the subprocess, uninterrupted
    expected = folder_bytes(tmp_path / "reference" / "hidden_states" / "k")
    assert len(expected) > 6  # several shards to be killed between

    work = tmp_path / "killed"
    rng = random.Random(0)
    kills = 0
    for _ in range(3):
        process = start(work, target_dir, examples)
        after = rng.randint(1, 4)  # shard progress lines to wait for, then a random delay
        seen = 0
        for line in process.stdout:
            seen += line.startswith("hidden states")
            if seen >= after or line.startswith("DONE"):
                break
        time.sleep(rng.uniform(0.0, 0.3))
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            kills += 1
        process.wait()
        partial = work / "hidden_states" / "k.partial"
        assert (partial / "plan.json").exists() or (work / "hidden_states" / "k").exists()
    assert kills >= 2
    final = start(work, target_dir, examples)
    out, _ = final.communicate(timeout=600)
    assert final.returncode == 0 and "DONE" in out
    assert folder_bytes(work / "hidden_states" / "k") == expected


def test_corrupt_and_truncated_shards_are_rebuilt_and_good_ones_kept(target_dir, tmp_path):
    examples = tmp_path / "examples.jsonl"
    write_examples(examples, 40, seed=2)
    config = config_for(tmp_path, target_dir, storage="int8", shard_tokens=256)
    folder = tmp_path / "partial"
    folder.mkdir()
    body = stage_body(config, examples, report=lambda _: None)
    body(folder)
    expected = folder_bytes(folder)
    shards = sorted(folder.glob("shard-*.safetensors"))
    with open(shards[0], "r+b") as handle:  # flip one byte in the data
        handle.seek(-10, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-10, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with open(shards[1], "r+b") as handle:  # truncate
        handle.truncate(shards[1].stat().st_size // 2)
    kept = shards[2].stat().st_mtime_ns
    (folder / "index.jsonl").unlink()
    body(folder)
    assert folder_bytes(folder) == expected
    assert shards[2].stat().st_mtime_ns == kept  # a verified shard is not rewritten
    assert read_record(folder, shards[0].name)["sha256"]


def test_disk_budget_refuses_on_a_small_filesystem_before_any_work(target_dir, tmp_path):
    with small_tmpfs(tmp_path / "small", "8m") as mount:
        examples = tmp_path / "examples.jsonl"
        write_examples(examples, 400, seed=3, min_len=200, max_len=400)  # ~120k tokens
        config = config_for(mount / "work", target_dir, storage="float32")
        folder = mount / "work" / "partial"
        folder.mkdir(parents=True)
        with pytest.raises(DiskBudgetError) as error:
            stage_body(config, examples, report=lambda _: None)(folder)
        message = str(error.value)
        assert "bytes per token" in message and "free" in message
        assert "int8" in message and "online" in message
        assert not list(folder.glob("shard-*"))  # refused before any shard was written
        print(message)


def test_a_deleted_manifest_resumes_from_the_shards_and_says_so(target_dir, tmp_path):
    """Issue 40: a finished hidden_states folder whose manifest.json was deleted was rebuilt
    without a word (and train and evaluate ran again). Now its shards are kept, none is
    rewritten, the stage says why, and the sealed output is the same (so the stages after it
    stay Cached)."""
    examples = tmp_path / "examples.jsonl"
    write_examples(examples, 24, seed=3)
    config = config_for(tmp_path, target_dir, storage="int8", shard_tokens=256)
    lines: list[str] = []

    def run_once():
        body = stage_body(config, examples, report=lines.append)
        return run_stage(work_dir=tmp_path, stage="hidden_states", key="k", code_hash="c",
                         config={}, upstream=[], body=body, resume_partial=True,
                         warn=lines.append)  # fmt: skip

    first = run_once()
    folder = tmp_path / "hidden_states" / "k"
    written = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.safetensors")}
    (folder / "manifest.json").unlink()
    lines.clear()
    second = run_once()
    assert second.output_hash() == first.output_hash()
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.safetensors")} == written
    said = [line for line in lines if "manifest.json" in line]
    assert said and "carrying on from its files" in said[0] and str(folder) in said[0]
