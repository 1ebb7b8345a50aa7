"""The sglang engine: SGLang's native `POST /generate` with `input_ids`, `output_ids` back.

Request: `{"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature", "top_p",
"stop", "sampling_seed" (sampled runs only)}}`. Answer: `{"text", "output_ids", "meta_info":
{"finish_reason": {"type": "stop"|"length"|"abort", "matched": id-or-str, ...},
"prompt_tokens", "completion_tokens", ...}}`. The prompt goes as token ids, so the records
are token-exact. When the model stopped on a token (`matched` is an id) the output ends with
that token, as in the local engine's records, appended if the server left it out.

With `generation.loop_guard` (the default) the answer streams (`"stream": true`: server-sent
events, each with every output id so far, or only the new ones when the server runs with
`--incremental-streaming-output`; `meta_info.completion_tokens` says which), so the loop guard
can end a repeating answer: finish_reason "loop", the ids up to there.

Tested against a stand-in that follows SGLang's documented schema (tests/fake_servers.py):
SGLang itself does not run on these CPU machines.

Construction: `SGLangEngine(config: PipelineConfig, tokenizer=None, *, end_ids=None,
http_library=None)`; see `eaglet.engines.http.HTTPEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from eaglet.engines.http import HTTPEngine, MalformedResponse, RetryableResponse, int_list
from eaglet.loop_guard import LoopDetector
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
        body = {"input_ids": prompt.prompt_ids, "sampling_params": params}
        if self.streams():
            body["stream"] = True
        return self.request_path, body

    def read_stream_chunk(self, chunk: dict[str, Any], state: dict[str, Any]) -> list[int]:
        ids, meta = output_ids_of(chunk), meta_info_of(chunk)
        known: list[int] = state.setdefault("output_ids", [])
        # SGLang streams every id so far (its default) or only the new ones (with
        # --incremental-streaming-output); meta_info.completion_tokens, the count so far,
        # tells which
        done = meta.get("completion_tokens")
        if not isinstance(done, int):
            raise MalformedResponse(
                "a streamed event without meta_info.completion_tokens: cannot tell new ids from "
                "repeated ones (set generation.loop_guard: false to not stream)"
            )
        whole = done == len(ids) and ids[: len(known)] == known
        new = ids[len(known) :] if whole else ids
        known.extend(new)
        if chunk.get("text") is not None:  # the text so far, or its new piece
            pieces = state.setdefault("text_pieces", [])
            if whole:
                pieces.clear()
            pieces.append(chunk["text"])
        state["meta_info"] = meta
        return new

    def finish_stream(self, prompt: Prompt, state: dict[str, Any]) -> Generation:
        if not state.get("meta_info", {}).get("finish_reason"):
            raise MalformedResponse("the stream ended before its finish_reason")
        text = "".join(state.get("text_pieces", []))
        return self._record(prompt, state["output_ids"], state["meta_info"], text, streamed=True)

    def looped(self, prompt: Prompt, state: dict[str, Any], detector: LoopDetector) -> Generation:
        raw = {
            "text": "".join(state.get("text_pieces", [])), "finish_reason": "loop",
            "streamed": True, "loop": detector.evidence(),
        }  # fmt: skip
        return Generation.answering(
            prompt, list(state.get("output_ids", [])), "loop", self.name, raw=raw
        )

    def parse(self, prompt: Prompt, body: dict[str, Any]) -> Generation:
        return self._record(prompt, output_ids_of(body), meta_info_of(body), body.get("text"))

    def _record(
        self, prompt: Prompt, output_ids: list[int], meta: dict[str, Any], text: Any,
        streamed: bool = False,
    ) -> Generation:  # fmt: skip
        """The record of a finished answer, streamed or not."""
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else finish
        if kind not in ("stop", "length"):
            detail = finish.get("message", "") if isinstance(finish, dict) else ""
            raise RetryableResponse(f"request did not finish (finish_reason={kind!r}) {detail}")
        matched = finish.get("matched") if isinstance(finish, dict) else None
        ids = self.with_end_token(list(output_ids), self.stop_token(kind, matched))
        raw: dict[str, Any] = {
            "text": text,
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
        if streamed:
            raw["streamed"] = True
        return Generation.answering(prompt, ids, kind, self.name, token_exact=not mismatch, raw=raw)


def output_ids_of(body: dict[str, Any]) -> list[int]:
    if "output_ids" not in body:
        raise MalformedResponse(
            "output_ids is missing: is this SGLang's native /generate (a recent version)?"
        )
    return int_list(body["output_ids"], "output_ids")


def meta_info_of(body: dict[str, Any]) -> dict[str, Any]:
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise MalformedResponse("meta_info is missing")
    return meta
