"""The vllm engine: `POST /v1/completions` with our prompt token ids, token ids back.

The prompt goes as token ids, so the server never re-renders the chat template, and
`"return_token_ids": true` brings back the exact output ids: records are token-exact. vLLM
keeps the end token in `token_ids` when it stops on it (checked against a real server in
tests/test_engines_vllm.py); should a server leave it out, it is appended so the records equal
the local engine's. Everything else the server said (text, finish and stop reason, usage) is
kept in `raw` for audit; a server that reports other prompt ids than ours is flagged there.

With `generation.loop_guard` (the default) the answer streams (`"stream": true`: each event
carries its new `token_ids`), so the loop guard can end a request whose answer repeats itself;
the record then has finish_reason "loop" and the ids up to there. The streamed record of an
answer that did not loop equals the unstreamed one (tests/test_engines_vllm.py).

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
    streamed_choice,
)
from eaglet.loop_guard import LoopDetector
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
        params = self.params.for_prompt(prompt)
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
        if self.streams():
            payload |= {"stream": True, "stream_options": {"include_usage": True}}
        return self.request_path, payload

    def parse(self, prompt: Prompt, body: dict[str, Any]) -> Generation:
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices:
            raise MalformedResponse("no choices in the answer")
        choice = choices[0]
        return self._record(
            prompt,
            token_ids(choice),
            check_finish_reason(choice.get("finish_reason")),
            choice.get("stop_reason"),
            choice.get("prompt_token_ids", body.get("prompt_token_ids")),
            {"text": choice.get("text"), "usage": body.get("usage")},
        )

    def read_stream_chunk(self, chunk: dict[str, Any], state: dict[str, Any]) -> list[int]:
        choice = streamed_choice(chunk, state)
        if choice is None:
            return []  # the usage event
        new_ids = token_ids(choice)
        state.setdefault("token_ids", []).extend(new_ids)
        state.setdefault("text_pieces", []).append(choice.get("text") or "")  # joined once
        if choice.get("prompt_token_ids") is not None:
            state["prompt_token_ids"] = choice["prompt_token_ids"]
        if choice.get("finish_reason") is not None:
            state["finish_reason"] = choice["finish_reason"]
            state["stop_reason"] = choice.get("stop_reason")
        return new_ids

    def finish_stream(self, prompt: Prompt, state: dict[str, Any]) -> Generation:
        if "finish_reason" not in state:
            raise MalformedResponse("the stream ended before its finish_reason")
        return self._record(
            prompt,
            list(state.get("token_ids", [])),
            check_finish_reason(state["finish_reason"]),
            state.get("stop_reason"),
            state.get("prompt_token_ids"),
            {"text": streamed_text(state), "usage": state.get("usage"), "streamed": True},
        )

    def looped(self, prompt: Prompt, state: dict[str, Any], detector: LoopDetector) -> Generation:
        ids = list(state.get("token_ids", []))
        mismatch = prompt_ids_check(prompt.prompt_ids, state.get("prompt_token_ids"))
        raw = {"text": streamed_text(state), "finish_reason": "loop", "streamed": True}
        raw |= mismatch
        raw["loop"] = detector.evidence()
        return Generation.answering(
            prompt, ids, "loop", self.name, token_exact=not mismatch, raw=raw
        )

    def _record(
        self,
        prompt: Prompt,
        ids: list[int],
        finish_reason: str,
        stop_reason: Any,
        server_prompt: Any,
        extra: dict[str, Any],
    ) -> Generation:
        """The record of a finished answer, streamed or not."""
        stopped_on = self.stop_token(finish_reason, stop_reason)
        output_ids = self.with_end_token(ids, stopped_on)
        mismatch = prompt_ids_check(prompt.prompt_ids, server_prompt)
        raw: dict[str, Any] = {
            "text": extra.pop("text"),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            **extra,
            **mismatch,
        }
        if output_ids != ids:
            raw["end_token_appended"] = True
        return Generation.answering(
            prompt, output_ids, finish_reason, self.name, token_exact=not mismatch, raw=raw
        )


def streamed_text(state: dict[str, Any]) -> str:
    """The text of a streamed answer (kept as pieces: one string grown per event would copy
    a long answer's text once per token)."""
    return "".join(state.get("text_pieces", []))


def token_ids(choice: dict[str, Any]) -> list[int]:
    """A choice's (or streamed event's) output ids; missing when return_token_ids was ignored."""
    if "token_ids" not in choice:
        raise MalformedResponse(
            "choices[0].token_ids is missing: the server ignored return_token_ids "
            "(vLLM >= 0.10.2 supports it; use the openai engine for other servers)"
        )
    return list(int_list(choice["token_ids"], "choices[0].token_ids"))
