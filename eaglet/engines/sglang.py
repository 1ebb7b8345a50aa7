"""The sglang engine: SGLang's native `POST /generate` with `input_ids`, `output_ids` back.

Request: `{"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature", "top_p",
"stop", "sampling_seed" (sampled runs only)}}`. Answer: `{"text", "output_ids", "meta_info":
{"finish_reason": {"type": "stop"|"length"|"abort", "matched": id-or-str, ...},
"prompt_tokens", "completion_tokens", ...}}`. The prompt goes as token ids, so the records
are token-exact. When the model stopped on a token (`matched` is an id) the output ends with
that token, as in the local engine's records, appended if the server left it out.

Tested against a stand-in that follows SGLang's documented schema (tests/fake_servers.py):
SGLang itself does not run on these CPU machines.

Construction: `SGLangEngine(config: PipelineConfig, tokenizer=None, *, end_ids=None,
http_library=None)`; see `eaglet.engines.http.HTTPEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from eaglet.engines.http import HTTPEngine, MalformedResponse, RetryableResponse, int_list
from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt


@dataclass
class SGLangEngine(HTTPEngine):
    name: ClassVar[str] = "sglang"
    health_path: ClassVar[str] = "/health"
    request_path: ClassVar[str] = "/generate"

    def request_for(self, prompt: Prompt) -> tuple[str, dict[str, Any]]:
        sampling = self.params.for_prompt(prompt)
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
        }
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.temperature > 0:
            # Older SGLang versions reject unknown sampling params; greedy needs no seed.
            params["sampling_seed"] = sampling.seed
        return self.request_path, {"input_ids": prompt.prompt_ids, "sampling_params": params}

    def parse(self, prompt: Prompt, body: dict[str, Any]) -> Generation:
        if "output_ids" not in body:
            raise MalformedResponse(
                "output_ids is missing: is this SGLang's native /generate (a recent version)?"
            )
        output_ids = int_list(body["output_ids"], "output_ids")
        meta = body.get("meta_info")
        if not isinstance(meta, dict):
            raise MalformedResponse("meta_info is missing")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind not in ("stop", "length"):
            detail = finish.get("message", "") if isinstance(finish, dict) else ""
            raise RetryableResponse(f"request did not finish (finish_reason={kind!r}) {detail}")
        matched = finish.get("matched") if isinstance(finish, dict) else None
        ids = self.with_end_token(list(output_ids), self.stop_token(kind, matched))
        raw: dict[str, Any] = {
            "text": body.get("text"),
            "finish_reason": finish,
            "prompt_tokens": meta.get("prompt_tokens"),
            "completion_tokens": meta.get("completion_tokens"),
        }
        prompt_tokens = meta.get("prompt_tokens")
        mismatch = isinstance(prompt_tokens, int) and prompt_tokens != len(prompt.prompt_ids)
        if mismatch:
            raw["prompt_ids_mismatch"] = True
        if ids != output_ids:
            raw["end_token_appended"] = True
        return Generation.answering(prompt, ids, kind, self.name, token_exact=not mismatch, raw=raw)
