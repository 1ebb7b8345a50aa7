"""Stage folders are atomic and cache keys move exactly when config, upstream or code move."""

import json
import sys
import textwrap

import pytest

from eaglet import cache
from eaglet.config import load_config
from eaglet.records.io import repair_and_read_ids
from eaglet.storage import StageOutput, read_manifest, run_stage


def run_simple(tmp_path, body, key="k1", **kwargs):
    return run_stage(
        work_dir=tmp_path,
        stage="demo",
        key=key,
        code_hash="c",
        config={},
        upstream=[],
        body=body,
        **kwargs,
    )


def test_completed_stage_folder_has_manifest_with_file_hashes(tmp_path):
    def body(folder):
        (folder / "out.txt").write_text("hello")
        return StageOutput(counts={"records": 1}, info={})

    manifest = run_simple(tmp_path, body)
    folder = tmp_path / "demo" / "k1"
    assert read_manifest(folder) == manifest
    assert manifest.files["out.txt"]["bytes"] == 5
    assert not (tmp_path / "demo" / "k1.partial").exists()


def test_failing_body_leaves_no_complete_folder_and_rerun_starts_clean(tmp_path):
    def broken(folder):
        (folder / "half.txt").write_text("x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        run_simple(tmp_path, broken)
    assert not (tmp_path / "demo" / "k1").exists()

    def good(folder):
        assert not (folder / "half.txt").exists()
        return StageOutput(counts={}, info={})

    run_simple(tmp_path, good)
    assert read_manifest(tmp_path / "demo" / "k1") is not None


def test_complete_folder_is_reused_without_running_the_body(tmp_path):
    calls = []

    def body(folder):
        calls.append(1)
        return StageOutput(counts={}, info={})

    run_simple(tmp_path, body)
    run_simple(tmp_path, body)
    assert len(calls) == 1
    run_simple(tmp_path, body, refresh=True)
    assert len(calls) == 2
    assert any(p.name.startswith("k1.replaced-") for p in (tmp_path / "demo").iterdir())


def test_torn_last_line_is_cut_and_its_id_not_counted(tmp_path):
    path = tmp_path / "gen.jsonl"
    path.write_text(json.dumps({"sample_id": "a"}) + "\n" + '{"sample_id": "b", "out')
    assert repair_and_read_ids(path) == {"a"}
    assert path.read_text() == json.dumps({"sample_id": "a"}) + "\n"


def test_stage_key_changes_with_config_of_the_stage_only(tmp_path):
    base = load_config(None, [f"work_dir={tmp_path}"])
    key = cache.stage_key("extract", base, [])
    assert cache.stage_key("extract", base, []) == key
    changed = load_config(None, [f"work_dir={tmp_path}", "reasoning.min_capture_rate=0.5"])
    assert cache.stage_key("extract", changed, []) != key
    unrelated = load_config(None, [f"work_dir={tmp_path}", "train.lr=0.5"])
    assert cache.stage_key("extract", unrelated, []) == key
    faster = load_config(None, [f"work_dir={tmp_path}", "generation.concurrency=7"])
    assert cache.stage_key("generate", faster, []) == cache.stage_key("generate", base, [])


def test_code_hash_covers_helpers_in_the_whole_module(tmp_path, monkeypatch):
    module = tmp_path / "eaglet_probe_module.py"
    module.write_text(
        textwrap.dedent("""
        def helper():
            return 1
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cache.STAGE_MODULES, "probe", ("eaglet_probe_module",))
    before = cache.code_hash("probe")
    module.write_text(module.read_text().replace("return 1", "return 2"))
    sys.modules.pop("eaglet_probe_module", None)
    assert cache.code_hash("probe") != before


def test_dataset_key_follows_file_content_not_path(tmp_path):
    data = tmp_path / "a.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    config = load_config(None, [f"datasets=[{{source: a, path: {data}}}]"])
    key = cache.stage_key("download", config, [])
    moved = tmp_path / "b.jsonl"
    moved.write_text(data.read_text())
    config_moved = load_config(None, [f"datasets=[{{source: a, path: {moved}}}]"])
    assert cache.stage_key("download", config_moved, []) == key
    moved.write_text('{"messages": [{"role": "user", "content": "bye"}]}\n')
    assert cache.stage_key("download", config_moved, []) != key
