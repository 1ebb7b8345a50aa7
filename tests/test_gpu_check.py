"""benchmarks/gpu_check.py, the script kept for the day a GPU is lent, runs here at its CPU
size, so it cannot rot: a real-shape target (Qwen3-0.6B's width and vocabulary, 4 layers),
every stage through eaglet.stage_runner, its checks passed and its table written."""

import json
import subprocess
import sys

import pytest

from eaglet.stages import STAGES
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # about 1.5 min on two cores


def test_the_gpu_check_passes_at_its_cpu_size(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path),
         "--device", "cpu", "--size", "cpu"],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    stages = [row["stage"] for row in summary["stages"]]
    assert stages[: len(STAGES)] == list(STAGES) and "train (peagle)" in stages  # each method
    assert (tmp_path / "gpu_check.md").read_text().count("| train") == 2
    assert all(summary["checks"].values()), summary["checks"]
    assert "checks: all passed" in out.stdout
    rows = {row["stage"]: row for row in summary["stages"]}
    assert rows["train"]["tokens_per_s"] > 0 and rows["hidden_states"]["tokens_per_s"] > 0
    assert 0 < rows["train"]["fraction_of_peak"] < 1  # a share of the measured peak
