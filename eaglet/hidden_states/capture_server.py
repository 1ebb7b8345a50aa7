"""A capture server for a config's target, started by hand or by a cluster's job script:

    python -m eaglet.hidden_states.capture_server CONFIG.yaml --port 8000 --host 0.0.0.0 \
        --connector /shared/hs [--vllm-python P] [--set a.b=value ...] [--print]

runs (replaces this process with) the vLLM server `capture_server_command` builds: the run's
layers, the hidden-states connector writing into `--connector` (the folder the trainers read
as `hidden_states.vllm.connector_path`, on a shared file system). `--print` prints the command
instead. eaglet's `started_server` runs the same command for a stage.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from eaglet.config import load_config
from eaglet.hidden_states.backends.vllm import capture_server_command


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m eaglet.hidden_states.capture_server")
    parser.add_argument("config")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--connector", required=True, help="the connector's folder")
    parser.add_argument(
        "--vllm-python", help="vLLM's python (default: hidden_states.vllm.vllm_python, else python)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="a.b=value")
    parser.add_argument("--print", action="store_true", help="print the command, run nothing")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.set)
    if args.vllm_python:
        vllm = config.hidden_states.vllm.model_copy(update={"vllm_python": args.vllm_python})
        config = config.model_copy(
            update={"hidden_states": config.hidden_states.model_copy(update={"vllm": vllm})}
        )
    command, env = capture_server_command(config, args.port, args.connector, args.host)
    if args.print:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(command))
        return 0
    os.makedirs(args.connector, exist_ok=True)
    os.execvpe(command[0], command, {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, **env})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
