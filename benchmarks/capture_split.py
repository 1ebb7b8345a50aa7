"""The split for the demo's target: two capture servers (vLLM CPU, the command
`capture_server_command` builds) and one training rank, measured by `eaglet doctor`'s own
calibration (`eaglet.draft.split_plan`), with the load average beside each figure.

    .venv/bin/python benchmarks/capture_split.py [--model runs/demo/models/fixture] [--ranks 2]

CPU figures, on a shared machine: the servers and the rank are measured one at a time (on one
machine the two sides share the cores during a run). Needs the vLLM venv (make vllm-venv).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eaglet.config import PipelineConfig  # noqa: E402
from eaglet.draft.split_plan import SplitPlan, calibrate  # noqa: E402
from eaglet.hidden_states.backends.vllm import capture_server_command  # noqa: E402
from eaglet.vllm_process import free_port, vllm_server  # noqa: E402


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(ROOT / "runs/demo/models/fixture"))
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--vllm-python", default=str(ROOT / ".vllm-venv/bin/python"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        connector = Path(scratch) / "hs"
        connector.mkdir()
        config = PipelineConfig.model_validate({
            "work_dir": scratch, "target": {"model": args.model, "device": "cpu"},
            "hidden_states": {"backend": "vllm", "vllm": {
                "vllm_python": args.vllm_python, "connector_path": str(connector),
                "vllm_args": ["--enforce-eager", "--max-model-len", "1024"]}},
            "train": {"hidden_states": "online", "nproc_per_node": args.ranks},
        })  # fmt: skip
        urls = []
        for i in range(args.servers):
            command, env = capture_server_command(config, free_port(), str(connector))
            urls.append(stack.enter_context(vllm_server(command, Path(scratch) / f"{i}.log",
                                                        300, env=env)))  # fmt: skip
        vllm = config.hidden_states.vllm.model_copy(update={"endpoints": urls})
        config = config.model_copy(update={"hidden_states": config.hidden_states.model_copy(
            update={"vllm": vllm})})  # fmt: skip
        print(f"load before: {load()}")
        calibration = calibrate(config)
        print(f"load after:  {load()}")
        for line in SplitPlan(calibration, args.servers, args.ranks).lines():
            print(line)


if __name__ == "__main__":
    main()
