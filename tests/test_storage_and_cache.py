"""Stage folders are atomic and cache keys move exactly when config, upstream or code move."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eaglet import cache
from eaglet.config import load_config
from eaglet.fingerprints import TARGET_PARTS
from eaglet.progress import Throttle
from eaglet.records.io import repair_and_read_ids
from eaglet.stages import STAGES
from eaglet.storage import (
    StageOutput,
    atomic_folder,
    read_manifest,
    replace_folder,
    run_stage,
    sha256_file,
)


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


@pytest.mark.parametrize("tasks_folder", ["tasks", "eaglet_prefect/tasks"])  # clone, wheel
def test_closure_follows_local_relative_and_package_imports_but_not_site_packages(
    tmp_path, tasks_folder
):
    files = {
        "eaglet/__init__.py": "",
        # not followed: config is keyed by its subset (a NOT_OUTPUT package and its modules)
        "eaglet/config/__init__.py": "import eaglet.never\n",
        "eaglet/config/train.py": "import eaglet.never_either\n",
        "eaglet/never.py": "",
        "eaglet/never_either.py": "",
        "eaglet/sub/__init__.py": "",
        "eaglet/sub/helper.py": "from .leaf import VALUE\n",
        "eaglet/sub/leaf.py": "VALUE = 1\n",
        "eaglet/lazy.py": "def run():\n    from eaglet.sub import helper\n    return helper\n",
        "eaglet/unused.py": "",
        f"{tasks_folder}/__init__.py": "",
        f"{tasks_folder}/probe.py": "import torch\nfrom eaglet import lazy\n"
        "from eaglet.config import X\nfrom eaglet.config.train import Y\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    if tasks_folder == "tasks":  # a clone: eaglet_prefect/tasks is a link to the folder
        (tmp_path / "eaglet_prefect").mkdir()
        (tmp_path / "eaglet_prefect" / "tasks").symlink_to("../tasks")
    closure = cache.import_closure(("eaglet_prefect.tasks.probe",), root=tmp_path)
    assert closure == (
        "eaglet",
        "eaglet.lazy",
        "eaglet.sub",
        "eaglet.sub.helper",
        "eaglet.sub.leaf",
        "eaglet_prefect.tasks",
        "eaglet_prefect.tasks.probe",
    )


def test_a_task_module_reached_through_the_link_or_as_a_folder_keys_the_same(tmp_path):
    """A clone reaches eaglet_prefect/tasks/train.py through a link, the wheel as a file: the
    module's file is named resolved (the one a reader edits), and each stage's closure and
    its modules' hashes are the same either way (keyed by module name and content)."""
    assert cache.module_file("eaglet_prefect.tasks.train") == cache.ROOT / "tasks" / "train.py"
    assert cache.module_file("tasks.train") is None  # only the installed name is the project's
    wheel = tmp_path / "wheel"  # the wheel's layout: real folders under eaglet_prefect/
    shutil.copytree(cache.ROOT / "eaglet", wheel / "eaglet", ignore=shutil.ignore_patterns("*.pyc"))
    shutil.copytree(cache.ROOT / "tasks", wheel / "eaglet_prefect" / "tasks")
    for stage in STAGES:
        roots = (cache.task_module(stage),)
        hashes = {
            root: {m: cache.module_source_hash(m, root) for m in cache.import_closure(roots, root)}
            for root in (cache.ROOT, wheel)
        }
        assert hashes[cache.ROOT] == hashes[wheel], stage
        assert f"eaglet_prefect.tasks.{stage}" in hashes[wheel], stage


def test_stage_closures_hold_the_modules_a_hand_kept_list_missed():
    config = load_config(None, [])
    generate = cache.stage_modules("generate", config)
    assert {"eaglet.engines", "eaglet.engines.local", "eaglet.target"} <= set(generate)
    assert "eaglet.engines.http" not in generate  # only the configured engine counts
    for stage in ("tokenize", "extract", "evaluate"):  # each loads the target's tokenizer
        assert "eaglet.target" in cache.stage_modules(stage, config), stage
    assert "eaglet.draft.checkpoint" in cache.stage_modules("evaluate", config)
    assert "eaglet.records.examples" not in generate  # extract's record type
    for stage in STAGES:
        closure = cache.stage_modules(stage, config)
        assert not set(closure) & cache.NOT_OUTPUT
        assert not [m for m in closure if cache.is_not_output(m)], stage  # nor their modules
    vllm = load_config(None, ["generation.engine=vllm", "generation.endpoints=[http://x]"])
    assert "eaglet.engines.http" in cache.stage_modules("generate", vllm)


def test_a_settings_module_keys_no_stage_by_its_code_the_module_it_configures_does():
    """A backend's or a block drafter's settings are config sections, keyed by value
    (`stage_config`): a new description or bound in them re-runs nothing; the backend's and
    the method's own code keys the stages that run it."""
    settings = {"eaglet.hidden_states.backends.settings", "eaglet.draft.methods.settings"}
    chosen = load_config(
        None,
        ["hidden_states.backend=vllm", "hidden_states.vllm.vllm_python=/py", "train.method=dflash"],
    )
    for config in (load_config(None, []), chosen):
        for stage in STAGES:
            assert settings.isdisjoint(cache.stage_modules(stage, config)), stage
    assert "eaglet.hidden_states.backends.vllm" in cache.stage_modules("hidden_states", chosen)
    assert "eaglet.draft.methods.dflash" in cache.stage_modules("train", chosen)


def test_a_source_keyed_as_an_earlier_one_keeps_every_key_that_one_made(monkeypatch):
    """A refactor's new source, declared keyed as the old (`KEYED_AS`), hashes as the old: the
    stages whose code holds it keep their keys; without the entry they move."""
    config = load_config(None, [])
    module = "eaglet.stage_bodies.generate"
    now = sha256_file(cache.module_file(module))  # its source's own
    monkeypatch.setattr(cache, "KEYED_AS", {now: "the old source's sha256"})
    assert cache.code_modules("generate", config)[module] == "the old source's sha256"
    declared = cache.code_hash("generate", config)
    monkeypatch.setattr(cache, "KEYED_AS", {})
    assert cache.code_modules("generate", config)[module] == now
    assert cache.code_hash("generate", config) != declared


def test_every_source_keyed_as_an_earlier_one_is_the_source_its_module_has():
    """An entry of `KEYED_AS` holds for one exact source: once its module is edited again it
    keys nothing and only misleads a reader, so it goes (the edit re-keys, as any edit)."""
    sources = {
        sha256_file(path)
        for package in cache.PROJECT_PACKAGES
        for path in cache.ROOT.joinpath(*package.split(".")).resolve().rglob("*.py")
    }
    for source in cache.KEYED_AS:
        assert source in sources, f"no module has the source {source} any more: remove its entry"


# Which stages' manifests each stage reads (eaglet.stages: `reads`, by stage name).
UPSTREAM_STAGES = {
    "download": [],
    "tokenize": ["download"],
    "generate": ["tokenize"],
    "extract": ["generate", "tokenize"],
    "hidden_states": ["extract"],
    "train": ["hidden_states"],
    "evaluate": ["train", "tokenize"],
}

KEYS_SCRIPT = """
import json, sys
from pathlib import Path
from eaglet import cache
from eaglet.config import load_config
from eaglet.stages import STAGES
from eaglet.storage import Manifest
assert cache.ROOT == Path.cwd().resolve(), (cache.ROOT, Path.cwd())
upstream_of = json.loads(sys.argv[1])
keys = {}
for engine in ("local", "vllm"):
    config = load_config(None, [f"generation.engine={engine}", "generation.endpoints=[http://x]"])
    for stage in STAGES:
        upstream = [
            Manifest(stage=u, key=keys[engine, u], path="", code_hash="", config={}, started=0,
                     finished=0)
            for u in upstream_of[stage]
        ]
        keys[engine, stage] = cache.stage_key(stage, config, upstream)
closures = {s: cache.stage_modules(s, load_config(None, [])) for s in STAGES}
print(json.dumps({"keys": {f"{e}:{s}": k for (e, s), k in keys.items()}, "closures": closures}))
"""


def _keys_of(tree) -> dict:
    """Every stage's key (local and vllm engines) and closure, computed by a fresh Python in
    the copied tree, with each stage's upstream manifest named by the upstream stage's key."""
    result = subprocess.run(
        [sys.executable, "-c", KEYS_SCRIPT, json.dumps(UPSTREAM_STAGES)],
        cwd=tree,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow  # seconds of subprocess or timeouts: outside the fast suite
def test_editing_a_module_rekeys_exactly_the_stages_whose_code_holds_it(tmp_path):
    """Later stages are keyed by what their upstream wrote (early cutoff), not by its key: an
    edit re-keys the stages whose code holds the module and no other (the upstream manifests
    here stand for unchanged output)."""
    root = Path(cache.ROOT)
    tree = tmp_path / "tree"
    for package in ("eaglet", "eaglet_prefect", "tasks"):  # eaglet_prefect/tasks: a link
        shutil.copytree(
            root / package,
            tree / package,
            symlinks=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    before = _keys_of(tree)
    closures = before["closures"]

    def edit_and_diff(*modules: str) -> set[str]:
        paths = [cache.module_file(module, tree) for module in modules]
        originals = {path: path.read_text() for path in paths}
        for path, original in originals.items():
            path.write_text(original + "\n# edited by the test\n")
        try:
            after = _keys_of(tree)["keys"]
        finally:
            for path, original in originals.items():
                path.write_text(original)
        return {name for name, key in after.items() if before["keys"][name] != key}

    for index, stage in enumerate(STAGES):
        earlier = set().union(*(closures[s] for s in STAGES[:index]))
        own = sorted(m for m in closures[stage] if m not in earlier)
        module = next((m for m in own if m.startswith("eaglet.")), f"eaglet_prefect.tasks.{stage}")
        changed = edit_and_diff(module)
        expected = {f"{e}:{s}" for e in ("local", "vllm") for s in STAGES if module in closures[s]}
        assert stage in {name.split(":")[1] for name in expected}, (stage, module)
        assert changed == expected, (stage, module)

    # A record type re-keys the stages that write or read it, never generate.
    changed = edit_and_diff("eaglet.records.examples")
    assert {name.split(":")[1] for name in changed} == {
        s for s in STAGES if "eaglet.records.examples" in closures[s]
    } and "local:generate" not in changed
    # A fix to the HTTP client re-keys what the vllm engine generated, not the local engine's.
    assert edit_and_diff("eaglet.engines.http") == {"vllm:generate"}
    # The config is keyed by each stage's subset of it, not by its source: no module of it (one
    # per section) re-keys a stage, nor does a module of the preflight (they never write).
    packages = [tree / "eaglet" / "config", tree / "eaglet" / "preflight"]
    modules = [
        ".".join(path.relative_to(tree).with_suffix("").parts).removesuffix(".__init__")
        for package in packages
        for path in sorted(package.glob("*.py"))
    ]
    assert {"eaglet.config", "eaglet.config.train", "eaglet.preflight.target"} <= set(modules)
    assert edit_and_diff(*modules) == set()


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


def test_replace_folder_swaps_a_whole_folder_and_leaves_nothing_behind(tmp_path):
    final, new = tmp_path / "draft", tmp_path / "draft.tmp"
    final.mkdir()
    (final / "old.bin").write_text("old")
    new.mkdir()
    (new / "new.bin").write_text("new")
    replace_folder(new, final)
    assert sorted(p.name for p in final.iterdir()) == ["new.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]


def test_atomic_folder_keeps_the_old_folder_when_writing_fails(tmp_path):
    final = tmp_path / "state"
    with atomic_folder(final) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_folder(final) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("crash mid-write")
    assert (final / "a").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_throttle_reports_at_most_every_interval_and_always_when_forced():
    now = [0.0]
    throttle = Throttle(every_s=5.0, clock=lambda: now[0])
    ticks = []
    for t in (0.0, 1.0, 4.9, 5.0, 6.0, 10.5, 11.0):
        now[0] = t
        ticks.append(throttle.ready(force=t == 11.0))
    assert ticks == [True, False, False, True, False, True, True]


def test_a_folder_without_its_manifest_is_never_rebuilt_silently(tmp_path):
    """A resumable stage carries on from the files of a folder whose manifest was deleted; a
    stage that cannot resume runs again; both say why."""
    seen: list[list[str]] = []

    def body(folder):
        seen.append(sorted(p.name for p in folder.iterdir()))
        (folder / "out.txt").write_text("hello")
        return StageOutput(counts={}, info={})

    for resumable, expected_files, said in ((True, ["out.txt"], "carrying on"),
                                            (False, [], "runs again")):  # fmt: skip
        work = tmp_path / str(resumable)
        run_simple(work, body, resume_partial=resumable)
        (work / "demo" / "k1" / "manifest.json").unlink()
        warnings: list[str] = []
        run_simple(work, body, resume_partial=resumable, warn=warnings.append)
        assert seen[-1] == expected_files
        assert len(warnings) == 1 and said in warnings[0] and "manifest.json" in warnings[0]
        assert read_manifest(work / "demo" / "k1") is not None


# These values pin key stability across the restructuring of issue 35 (each hidden-state
# backend's settings moved into a section of its own, hidden_states.hf and hidden_states.vllm):
# they are the keys the code before it computed for these configs, written in the older flat
# spelling, with the code hash, the target's fingerprint and what dtype `auto` picks held
# fixed, so they depend on the configuration alone. A code change re-keys its stages by
# design (`code_hash`); where a setting is declared must not. Re-pinned once for issue 46: the
# target's fingerprint was split into the parts each stage reads (`target.weights`, ...).
KEY_CONFIGS = {
    "demo": [],
    "hf_device_map": ["hidden_states.device_map=auto"],
    "vllm_external": [
        "hidden_states.backend=vllm", "hidden_states.endpoints=[http://10.0.0.1:8000]",
        "hidden_states.connector_path=/shared/connector", "hidden_states.served_model=big",
        "hidden_states.concurrency=32", "hidden_states.request_timeout_s=30",
        "hidden_states.vllm_args=[--max-model-len, '4096']",
    ],
    "vllm_started": [
        "hidden_states.backend=vllm", "hidden_states.vllm_python=/opt/vllm/bin/python",
        "hidden_states.vllm_args=[--enforce-eager]", "hidden_states.startup_timeout_s=60",
    ],
    "vllm_online": [
        "hidden_states.backend=vllm", "hidden_states.vllm_python=/opt/vllm/bin/python",
        "train.hidden_states=online",
    ],
}  # fmt: skip
PINNED_KEYS = {
    "demo:hidden_states": "80be6df5ce3707266288",
    "demo:train": "bbbaebd96443c5abd55f",
    "hf_device_map:hidden_states": "80be6df5ce3707266288",
    "hf_device_map:train": "bbbaebd96443c5abd55f",
    "vllm_external:hidden_states": "4a807c48a4b20e5f53d9",
    "vllm_external:train": "bbbaebd96443c5abd55f",
    "vllm_started:hidden_states": "7231d838d8f22ce81a10",
    "vllm_started:train": "bbbaebd96443c5abd55f",
    "vllm_online:hidden_states": "e3df0f1af29b8801608e",
    "vllm_online:train": "8efab248a13d9d54ef08",
}


def test_stage_keys_stay_what_they_were_before_the_backend_sections(monkeypatch, fixture_model_dir):
    """The demo's config and the vllm backend's (written the old flat way, and the new way)
    key hidden_states and train as they did before the settings moved into sections."""
    monkeypatch.setattr(cache, "code_hash", lambda stage, config=None: "code")
    monkeypatch.setattr(
        cache, "target_parts", lambda *args, **kwargs: dict.fromkeys(TARGET_PARTS, "model")
    )
    monkeypatch.setattr("eaglet.target.target_dtype", lambda target: "float32")
    base = [f"target.model={fixture_model_dir}", "work_dir=/tmp/w"]

    def keys(overrides: list[str]) -> dict[str, str]:
        config = load_config(None, base + overrides)
        return {stage: cache.stage_key(stage, config, []) for stage in ("hidden_states", "train")}

    for name, overrides in KEY_CONFIGS.items():
        for stage, key in keys(overrides).items():
            assert key == PINNED_KEYS[f"{name}:{stage}"], (name, stage)
    sections = [  # vllm_started in the sections' spelling
        "hidden_states.backend=vllm", "hidden_states.vllm.vllm_python=/opt/vllm/bin/python",
        "hidden_states.vllm.vllm_args=[--enforce-eager]",
        "hidden_states.vllm.startup_timeout_s=60",
    ]  # fmt: skip
    assert keys(sections) == {
        s: PINNED_KEYS[f"vllm_started:{s}"] for s in ("hidden_states", "train")
    }


def test_saved_tensors_get_the_mode_of_any_new_file_not_safetensors_0600(tmp_path):
    """safetensors writes 0600: a draft in a shared work dir was unreadable to the owner's
    team. Saved through `save_tensors`, a file gets what the umask gives any new file."""
    import stat

    import torch

    from eaglet.draft.checkpoint import save_tensors

    before = os.umask(0o002)
    try:
        save_tensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_text("{}")
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"model.safetensors": 0o664, "config.json": 0o664}
