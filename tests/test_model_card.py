"""The model card of each export (eaglet/draft/model_card.py), generated from the records: read
back, its τ, prompt hashes and k are report.json's, in a pipeline run through evaluate with two
named sets; a run without sets or a served check says so instead of leaving them out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglet.draft.model_card import CARD_FILE, EXPORTS_FOLDER
from tests.conftest import small_run_overrides

THROUGH_EVALUATE = r"""
import json, sys
from eaglet.config import load_config
from eaglet.stage_context import PlainContext
from eaglet.stage_bodies.every_stage import run_stage_without_prefect
from eaglet.stages import STAGE_LIST

config = load_config(None, json.loads(sys.argv[1]))
context, outputs = PlainContext(log=lambda line: None), {}
for spec in STAGE_LIST:
    if spec.runs(config):
        inputs = {name: outputs[name] for name in spec.inputs(config)}
        outputs[spec.output] = run_stage_without_prefect(spec.name, config, inputs, context)
print(json.dumps({"evaluate": outputs["report"].path, "files": sorted(outputs["report"].files)}))
"""


def parse_card(text: str) -> tuple[dict, dict[str, list[dict[str, str]]]]:
    """(front matter, section heading -> its table's rows as dicts): a card read back."""
    _, front, body = text.split("---\n", 2)
    tables: dict[str, list[dict[str, str]]] = {}
    heading = ""
    header: list[str] | None = None
    for line in body.splitlines():
        if line.startswith("## "):
            heading, header = line[3:].strip(), None
        elif line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if header is None:
                header = cells
                tables[heading] = []
            else:
                tables[heading].append(dict(zip(header, cells, strict=False)))
        elif not line.startswith("|---"):
            header = None if not line.startswith("|") else header
    return yaml.safe_load(front), tables


@pytest.mark.slow
def test_each_exports_card_holds_report_jsons_tau_hashes_and_k(
    tmp_path, fixture_model_dir, sample_data_dir
):
    work = tmp_path / "work"
    overrides = small_run_overrides(work, fixture_model_dir, sample_data_dir) + [
        f"evaluate.sets=[{{name: gsm8k, path: {sample_data_dir / 'gsm8k.jsonl'}, limit: 2}}, "
        f"{{name: mt-bench, path: {sample_data_dir / 'mt-bench.jsonl'}, limit: 2}}]",
        "evaluate.num_speculative_tokens=3",
    ]
    done = subprocess.run(
        [sys.executable, "-c", THROUGH_EVALUATE, json.dumps(overrides)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    folder = work / result["evaluate"]
    report = json.loads((folder / "report.json").read_text())
    assert set(report["cards"]) == {"vllm", "sglang", "speculators"}
    for export, where in report["cards"].items():
        card = (folder / where / CARD_FILE).read_text()
        assert f"{where}/{CARD_FILE}" in result["files"]  # hashed in evaluate's manifest
        assert (folder / where / "model.safetensors").is_file()  # the export beside its card
        front, tables = parse_card(card)
        assert front["library_name"] == {"sglang": "sglang"}.get(export, "vllm")
        assert "eagle3" in front["tags"] and "base_model" not in front  # a local target
        rows = {(r["set"], r["category"]): r for r in tables["Acceptance length"]}
        held = rows[("held-out", "(all)")]
        assert float(held["tau"]) == round(report["tau"], 3)
        assert held["prompts sha256"] == report["prompts_sha256"]
        assert int(held["k"]) == report["draft"]["num_speculative_tokens"] == 3
        assert int(held["prompts"]) == report["prompts"]
        assert set(report["sets"]) == {"gsm8k", "mt-bench"}
        for name, figures in report["sets"].items():
            row = rows[(name, "(all)")]
            assert float(row["tau"]) == round(figures["tau"], 3)
            assert row["prompts sha256"] == figures["prompts_sha256"]
            assert int(row["k"]) == figures["num_speculative_tokens"]
            assert int(row["rounds"]) == figures["rounds"]
            for category, f in (figures.get("categories") or {}).items():
                assert float(rows[(name, category)]["tau"]) == round(f["tau"], 3)
        checks = {r["export"]: r for r in tables["Engine check"]}
        assert checks[export]["conventions"] == "ok"
        assert "No served check was run" in card and "No serving schedule" in card
        assert {"arith", "tools"} <= {r["source"] for r in tables["Training data"]}


def test_a_card_without_sets_says_it_has_none():
    from eaglet.draft.model_card import model_card

    report = {
        "prompts": 2, "tau": 2.0, "untrained_tau": 1.0, "tau_by_k": {"1": 1.5},
        "draft": {"num_speculative_tokens": 1, "num_rounds": 4, "method": "eagle3"},
    }  # fmt: skip
    manifests = {"train": {"info": {}, "config": {}, "key": "k", "code_hash": "c"}}
    records = {
        "target": {"model": "Qwen/Qwen3-8B", "revision": "a" * 40, "fingerprint": "hub:x"},
        "manifests": manifests,
        "speculative_config": {"method": "eagle3", "model": "./draft"},
    }
    card = model_card("vllm", "draft", report, records)
    front, tables = parse_card(card)
    assert front["base_model"] == "Qwen/Qwen3-8B"
    assert "No named evaluation set was run" in card and "No served check was run" in card
    assert "No engine check was recorded" in card and "download stage's record" in card
    assert [r["set"] for r in tables["Acceptance length"]] == ["held-out"]
    assert Path(EXPORTS_FOLDER).name == "exports"


def test_a_second_write_of_the_card_folders_never_writes_into_the_train_folder(tmp_path):
    """A retry writes the evaluate folder's copies again over the links of the first try: the
    train folder's files (the same inodes) keep their bytes, and each copy is a link again."""
    from eaglet.draft.model_card import write_card_folders

    train, evaluate = tmp_path / "train", tmp_path / "evaluate"
    (train / "draft").mkdir(parents=True)
    weights = train / "draft" / "model.safetensors"
    weights.write_bytes(b"the trained weights")
    for card in ("first card", "second card"):
        written = write_card_folders(evaluate, train, {"vllm": "draft"}, {"vllm": card})
    copy = evaluate / written["vllm"]
    assert weights.read_bytes() == b"the trained weights"
    assert (copy / "model.safetensors").stat().st_ino == weights.stat().st_ino
    assert (copy / CARD_FILE).read_text() == "second card" and not (
        train / "draft" / CARD_FILE
    ).exists()
