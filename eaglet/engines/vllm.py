"""The vllm engine: `POST /v1/completions` with our prompt token ids, token ids back.

The prompt goes as token ids, so the server never re-renders the chat template, and
`"return_token_ids": true` brings back the exact output ids: records are token-exact. vLLM
keeps the end token in `token_ids` when it stops on it (checked against a real server in
tests/test_engines_vllm.py); should a server leave it out, it is appended so the records equal
the local engine's. Everything else the server said (text, finish and stop reason, usage) is
kept in `raw` for audit; a server that reports other prompt ids than ours is flagged there.

Construction: `VLLMEngine(config: PipelineConfig, tokenizer=None, *, end_ids=None,
http_library=None)`; see `eaglet.engines.http.HTTPEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from eaglet.engines.http import (
    HTTPEngine,
    MalformedResponse,
    RetryableResponse,
    int_list,
    prompt_ids_check,
)
from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt


def check_finish_reason(value: Any) -> str:
    """'stop' or 'length'; an aborted or unknown finish is retried."""
    if value in ("stop", "length"):
        return value
    raise RetryableResponse(f"request did not finish (finish_reason={value!r})")


@dataclass
class VLLMEngine(HTTPEngine):
    name: ClassVar[str] = "vllm"
    request_path: ClassVar[str] = "/v1/completions"

    def request_for(self, prompt: Prompt) -> tuple[str, dict[str, Any]]:
        params = self.params
        payload: dict[str, Any] = {
            "model": self.config.generation.served_model,
            "prompt": prompt.prompt_ids,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "return_token_ids": True,
        }
        if params.stop:
            payload["stop"] = list(params.stop)
        return self.request_path, payload

    def parse(self, prompt: Prompt, body: dict[str, Any]) -> Generation:
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices:
            raise MalformedResponse("no choices in the answer")
        choice = choices[0]
        if "token_ids" not in choice:
            raise MalformedResponse(
                "choices[0].token_ids is missing: the server ignored return_token_ids "
                "(vLLM >= 0.10.2 supports it; use the openai engine for other servers)"
            )
        token_ids = int_list(choice["token_ids"], "choices[0].token_ids")
        finish_reason = check_finish_reason(choice.get("finish_reason"))
        stop_reason = choice.get("stop_reason")
        stopped_on = self.stop_token(finish_reason, stop_reason)
        output_ids = self.with_end_token(list(token_ids), stopped_on)
        server_prompt = choice.get("prompt_token_ids", body.get("prompt_token_ids"))
        mismatch = prompt_ids_check(prompt.prompt_ids, server_prompt)
        raw: dict[str, Any] = {
            "text": choice.get("text"),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "usage": body.get("usage"),
            **mismatch,
        }
        if output_ids != token_ids:
            raw["end_token_appended"] = True
        return Generation.answering(
            prompt, output_ids, finish_reason, self.name, token_exact=not mismatch, raw=raw
        )
