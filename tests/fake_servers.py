"""Small inference servers for tests: faults on demand, a request log, three protocols.

`FakeServer` is an ASGI app that answers like
- vLLM's `POST /v1/completions` with token-id prompts and `return_token_ids`,
- an OpenAI-compatible `POST /v1/chat/completions` (vLLM-style, with or without a reasoning
  parser, with or without `token_ids`),
- SGLang's native `POST /generate` (`input_ids` in; `text`, `output_ids`, `meta_info` out).

The SGLang protocol here is a stand-in that follows SGLang's documented schema (SGLang cannot
run on these CPU machines); it is not SGLang. The "model" is deterministic: the answer to a
prompt is a function of its token ids, written in the fixture's thinking format
(`{reasoning}\\n</think>\\n\\n{answer}<|im_end|>` after a prompt that ends with `<think>\\n`), and
tokenized with `ToyTokenizer`, a character-level tokenizer with the same special tokens.

`CaptureServer` answers as vLLM with the hidden-states connector does (a file per request).

Faults are queued with `server.faults.append(...)`, one per generation request in arrival
order: "500", "503", "429:<seconds>" (with Retry-After), "hang", "drop" (the connection closes
mid-answer), "malformed" (200 with a body that is not JSON), "truncated" (200, a JSON body cut
in the middle, with a Content-Length that matches it), "400" (with a message), "abort", and "ok"
(no fault: a placeholder to let earlier requests through). `server.storm(seconds, status)`
answers every generation request with that status for a while (a 5xx storm), and
`completion_token_ids=False` makes `/v1/completions` answer text without `token_ids` (a server
that ignores `return_token_ids`).
`/v1/completions` with `"stream": true` answers as vLLM streams: server-sent events of a few
`token_ids` each, `finish_reason` in the last one, then a usage event and `[DONE]`; it stops
generating when the client disconnects. `loop_share` makes that share of prompts (chosen by
their ids) loop: after the reasoning, one sentence again and again to `max_tokens`.
`generated_tokens` counts the output tokens the server produced (its cost), `token_delay_s`
is the time it takes per token.
`serve(app)` runs any ASGI app with uvicorn in a thread on a free loopback port.
`silent_server()` is a socket that accepts connections, reads, and never writes a byte (a
hung server).
`ResetProxy` is a TCP proxy in front of any server that resets connections (RST) on demand:
faults of the network, not of the server, so it may sit in front of a real vLLM too.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
EOS_ID = 2


class ToyTokenizer:
    """A character-level tokenizer with ChatML special tokens and single-id think tags."""

    def __init__(self) -> None:
        self.vocab = SPECIAL + TAGS + CHARS
        self.ids = {token: i for i, token in enumerate(self.vocab)}
        self.eos_token_id = EOS_ID
        self.pad_token_id = 0
        self.eos_token = SPECIAL[EOS_ID]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        multi = sorted(SPECIAL + TAGS, key=len, reverse=True)
        while i < len(text):
            for token in multi:
                if text.startswith(token, i):
                    ids.append(self.ids[token])
                    i += len(token)
                    break
            else:
                ids.append(self.ids.get(text[i], self.ids["?"]))
                i += 1
        return ids

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.vocab[i] for i in ids if not (skip_special_tokens and i < len(SPECIAL)))

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.ids[token]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        text = ""
        if tools:
            text += "<|im_start|>system\n# Tools\n" + json.dumps(tools) + "<|im_end|>\n"
        for message in messages:
            text += f"<|im_start|>{message['role']}\n{message.get('content') or ''}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n<think>\n"
        return self.encode(text) if tokenize else text


def toy_answer(prompt_ids: list[int]) -> tuple[str, str]:
    """The toy model's (reasoning, answer) for a prompt: a function of its ids."""
    n = sum(prompt_ids) % 997
    return f"Add up the ids: {n}. Check: {n}.", f"The answer is {n}."


class FakeServer:
    """ASGI app; see the module docstring. `log` holds one entry per generation request."""

    def __init__(
        self,
        tokenizer: ToyTokenizer | None = None,
        *,
        served_model: str = "tiny",
        delay_s: float = 0.0,
        reasoning_field: str | None = "reasoning",
        chat_token_ids: bool = True,
        include_eos: bool = True,
        api_key: str | None = None,
        hang_s: float = 5.0,
        completion_token_ids: bool = True,
        loop_share: float = 0.0,
        token_delay_s: float = 0.0,
        sglang_incremental: bool = False,
    ) -> None:
        self.tokenizer = tokenizer or ToyTokenizer()
        self.served_model = served_model
        self.delay_s = delay_s
        self.reasoning_field = reasoning_field  # None: no reasoning parser, thinking inline
        self.chat_token_ids = chat_token_ids
        self.include_eos = include_eos
        self.api_key = api_key
        self.hang_s = hang_s
        self.completion_token_ids = completion_token_ids
        self.loop_share = loop_share
        self.token_delay_s = token_delay_s
        self.sglang_incremental = sglang_incremental
        self.generated_tokens = 0
        self.storm_until = 0.0
        self.storm_status = "503"
        self.faults: deque[str] = deque()
        self.log: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    # --- the toy model ----------------------------------------------------------------

    def loops(self, prompt_ids: list[int]) -> bool:
        """Whether the toy model loops on this prompt (`loop_share` of prompts, by their ids)."""
        return (sum(prompt_ids) * 7919) % 1000 < self.loop_share * 1000

    def complete(self, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        """Output ids (ending in <|im_end|> when finished) and finish reason."""
        reasoning, answer = toy_answer(prompt_ids)
        if self.loops(prompt_ids):
            again = self.tokenizer.encode(" Wait, let me add the ids again.")
            ids = self.tokenizer.encode(reasoning)
            while len(ids) < max_tokens:
                ids += again
            return ids[:max_tokens], "length"
        ids = self.tokenizer.encode(f"{reasoning}\n</think>\n\n{answer}") + [EOS_ID]
        if len(ids) > max_tokens:
            return ids[:max_tokens], "length"
        return ids, "stop"

    # --- ASGI -------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            await _send_json(send, 401, {"error": {"message": "invalid API key"}})
            return
        if method == "GET" and path in ("/health", "/health_generate"):
            await _send_json(send, 200, {})
            return
        if method == "GET" and path == "/v1/models":
            await _send_json(send, 200, {"object": "list", "data": [{"id": self.served_model}]})
            return
        handlers = {
            "/v1/completions": self._completions,
            "/v1/chat/completions": self._chat,
            "/generate": self._generate,
        }
        if method != "POST" or path not in handlers:
            await _send_json(send, 404, {"detail": "Not Found"})
            return
        request = json.loads(body)
        fault = self.faults.popleft() if self.faults else None
        fault = None if fault == "ok" else fault
        if time.monotonic() < self.storm_until:
            fault = self.storm_status
        with self._lock:
            self.log.append(
                {
                    "path": path,
                    "body": request,
                    "authorization": headers.get("authorization"),
                    "fault": fault,
                    "time": time.monotonic(),
                }
            )
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if fault is not None and await self._fault(fault, send, path):
                return
            answer = handlers[path](request, abort=fault == "abort")
            if path == "/v1/completions" and request.get("stream"):
                await self._stream_completion(answer, send, receive)
                return
            if path == "/v1/chat/completions" and request.get("stream"):
                await self._stream_chat(answer, send, receive)
                return
            if path == "/generate" and request.get("stream"):
                await self._stream_generate(answer, send, receive)
                return
            await asyncio.sleep(self.token_delay_s * self._output_tokens(answer))
            await _send_json(send, 200, answer)
        finally:
            with self._lock:
                self.in_flight -= 1

    async def _fault(self, fault: str, send, path: str) -> bool:
        """Answer with the fault; False for faults that live inside a 200 body (abort)."""
        if fault in ("500", "503"):
            await _send_json(send, int(fault), {"error": {"message": "engine overloaded"}})
        elif fault.startswith("429"):
            wait = fault.partition(":")[2] or "1"
            await _send_json(
                send, 429, {"error": {"message": "rate limited"}}, [(b"retry-after", wait.encode())]
            )
        elif fault == "hang":
            await asyncio.sleep(self.hang_s)
            await _send_json(send, 503, {"error": {"message": "too late"}})
        elif fault == "drop":
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", b"999"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b'{"choi', "more_body": True})
            raise ConnectionAbortedError("fake server drops the connection")
        elif fault == "malformed":
            await _send_raw(send, 200, b"<html>502 Bad Gateway</html>")
        elif fault == "truncated":
            await _send_raw(send, 200, b'{"id": "cmpl-fake", "choices": [{"index": 0, "tok')
        elif fault == "400":
            message = f"This model's maximum context length is 1024 tokens ({path})"
            await _send_json(send, 400, {"error": {"message": message, "code": 400}})
        elif fault == "echo-key-400":
            message = f"bad request from {self.api_key}"  # a careless server echoing the key
            await _send_json(send, 400, {"error": {"message": message}})
        else:
            return False
        return True

    def _output_tokens(self, answer: dict[str, Any]) -> int:
        usage = answer.get("usage") or answer.get("meta_info", {})
        count = int(usage.get("completion_tokens", 0))
        with self._lock:
            self.generated_tokens += count
        return count

    async def _stream(self, send, receive, pieces: list[list[int]], event_for) -> None:
        """Server-sent events, one per piece of output ids (`event_for(number, piece)` makes
        each), then `[DONE]`; stops generating at a client disconnect."""
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            for number, piece in enumerate(pieces):
                await asyncio.sleep(self.token_delay_s * len(piece))
                if gone.is_set():
                    return  # the client left: generate no more
                with self._lock:
                    self.generated_tokens += len(piece)
                await _send_event(send, event_for(number, piece))
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            watcher.cancel()

    async def _stream_completion(self, answer: dict[str, Any], send, receive) -> None:
        """`answer` (what `_completions` says) as vLLM streams it: a few ids per event, the
        prompt ids in the first, the finish reason in the last, the usage after them."""
        (whole,) = answer["choices"]
        ids = whole.get("token_ids")
        chars = self.tokenizer.encode(whole["text"]) if ids is None else ids
        pieces = [chars[i : i + 4] for i in range(0, len(chars), 4)] or [[]]
        choices = len(pieces)

        def event_for(number: int, piece: list[int]) -> dict[str, Any]:
            if number == choices:  # the usage event, after the last choice
                return {"id": answer["id"], "choices": [], "usage": answer["usage"]}
            last = number == choices - 1
            choice: dict[str, Any] = {
                "index": 0,
                "text": self.tokenizer.decode(piece, skip_special_tokens=True),
                "finish_reason": whole["finish_reason"] if last else None,
                "stop_reason": whole["stop_reason"] if last else None,
            }
            if ids is not None:
                choice["token_ids"] = piece
                if number == 0:
                    choice["prompt_token_ids"] = whole["prompt_token_ids"]
            return {"id": answer["id"], "object": "text_completion", "choices": [choice]}

        await self._stream(send, receive, [*pieces, []], event_for)

    async def _stream_chat(self, answer: dict[str, Any], send, receive) -> None:
        """`answer` (what `_chat` says) as vLLM streams a chat completion: a few output ids per
        event (`token_ids` when they were asked for), the text they decode to as `delta`
        pieces of the message's fields (the thinking before `</think>` in the reasoning field,
        the tag itself in neither, as the reasoning parser splits it), the finish reason in
        the last event, the usage after them."""
        (whole,) = answer["choices"]
        message, ids = whole["message"], whole.get("token_ids")
        text = "".join(message.get(f) or "" for f in ("reasoning", "reasoning_content", "content"))
        field = next((f for f in ("reasoning", "reasoning_content") if message.get(f)), None)
        chars = self.tokenizer.encode(text) if ids is None else ids
        pieces = [chars[i : i + 4] for i in range(0, len(chars), 4)] or [[]]
        choices, at = len(pieces), [0]
        split = len(message[field]) if field else 0  # where the reasoning field ends

        def event_for(number: int, piece: list[int]) -> dict[str, Any]:
            if number == choices:
                return {"id": answer["id"], "choices": [], "usage": answer["usage"]}
            piece_text = self.tokenizer.decode(piece, skip_special_tokens=True)
            if ids is not None and field:  # the tag's id decodes to the tag: in neither field
                piece_text = piece_text.replace("</think>", "")
            start, at[0] = at[0], at[0] + len(piece_text)
            delta: dict[str, Any] = {"role": "assistant"} if number == 0 else {}
            if field and start < split:
                delta[field] = text[start : min(at[0], split)]
            if at[0] > split or not field:
                delta["content"] = text[max(start, split) : at[0]]
            last = number == choices - 1
            choice: dict[str, Any] = {
                "index": 0, "delta": delta,
                "finish_reason": whole["finish_reason"] if last else None,
                "stop_reason": whole["stop_reason"] if last else None,
            }  # fmt: skip
            if ids is not None:
                choice["token_ids"] = piece
            event = {"id": answer["id"], "object": "chat.completion.chunk", "choices": [choice]}
            if number == 0 and "prompt_token_ids" in answer:
                event["prompt_token_ids"] = answer["prompt_token_ids"]
            return event

        await self._stream(send, receive, [*pieces, []], event_for)

    async def _stream_generate(self, answer: dict[str, Any], send, receive) -> None:
        """`answer` (what `_generate` says) as SGLang's `/generate` streams it: by default each
        event holds every output id and the text so far (`sglang_incremental`: only the new
        ones, as with `--incremental-streaming-output`), its meta_info the count so far and,
        in the last, the finish reason."""
        ids = answer["output_ids"]
        pieces = [ids[i : i + 4] for i in range(0, len(ids), 4)] or [[]]
        sent: list[int] = []

        def event_for(number: int, piece: list[int]) -> dict[str, Any]:
            sent.extend(piece)
            last = number == len(pieces) - 1
            meta = dict(answer["meta_info"], completion_tokens=len(sent))
            if not last:
                meta["finish_reason"] = None
            shown = piece if self.sglang_incremental else list(sent)
            text = self.tokenizer.decode(shown, skip_special_tokens=True)
            return {"text": text, "output_ids": shown, "meta_info": meta}

        await self._stream(send, receive, pieces, event_for)

    def storm(self, seconds: float, status: str = "503") -> None:
        """Answer every generation request with `status` for the next `seconds`."""
        self.storm_status = status
        self.storm_until = time.monotonic() + seconds

    def _completions(self, request: dict[str, Any], abort: bool) -> dict[str, Any]:
        prompt_ids = request["prompt"]
        ids, finish = self.complete(prompt_ids, request.get("max_tokens", 16))
        returned = ids if self.include_eos or finish != "stop" else ids[:-1]
        choice = {
            "index": 0,
            "text": self.tokenizer.decode(ids, skip_special_tokens=True),
            "token_ids": returned,
            "prompt_token_ids": prompt_ids,
            "finish_reason": "abort" if abort else finish,
            "stop_reason": None,
        }
        if not self.completion_token_ids:
            del choice["token_ids"], choice["prompt_token_ids"]
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "model": request["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids)},
        }

    def _chat(self, request: dict[str, Any], abort: bool) -> dict[str, Any]:
        prompt_ids = self.tokenizer.apply_chat_template(
            request["messages"], tools=request.get("tools"), add_generation_prompt=True,
            tokenize=True,
        )  # fmt: skip
        ids, finish = self.complete(prompt_ids, request.get("max_tokens", 16))
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "tool_calls": []}
        if self.reasoning_field is None or "</think>" not in text:
            message["content"] = text
            message["reasoning"] = None
        else:
            # As vLLM's qwen3 parser: the text on either side of the first </think>, unstripped.
            reasoning, _, content = text.partition("</think>")
            message[self.reasoning_field] = reasoning
            message["content"] = content
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "abort" if abort else finish,
            "stop_reason": None,
        }
        answer: dict[str, Any] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": request["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids)},
        }
        if self.chat_token_ids and request.get("return_token_ids"):
            choice["token_ids"] = ids
            answer["prompt_token_ids"] = prompt_ids
        return answer

    def _generate(self, request: dict[str, Any], abort: bool) -> dict[str, Any]:
        prompt_ids = request["input_ids"]
        params = request.get("sampling_params", {})
        ids, finish = self.complete(prompt_ids, params.get("max_new_tokens", 128))
        returned = ids if self.include_eos or finish != "stop" else ids[:-1]
        if abort:
            reason = {"type": "abort", "message": "aborted by the scheduler"}
        elif finish == "stop":
            reason = {"type": "stop", "matched": EOS_ID}
        else:
            reason = {"type": "length", "length": len(ids)}
        return {
            "text": self.tokenizer.decode(ids, skip_special_tokens=True),
            "output_ids": returned,
            "meta_info": {
                "id": "fake",
                "finish_reason": reason,
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(ids),
                "cached_tokens": 0,
                "e2e_latency": self.delay_s,
            },
        }

    def prompts_sent(self) -> list[tuple[int, ...]]:
        """The prompt token ids of every generation request, in arrival order."""
        with self._lock:
            entries = list(self.log)
        return [
            tuple(entry["body"].get("prompt") or entry["body"].get("input_ids") or [])
            for entry in entries
        ]


async def _send_event(send, data: Any) -> None:
    body = f"data: {json.dumps(data)}\n\n".encode()
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def _send_json(send, status: int, data: Any, extra_headers: list | None = None) -> None:
    await _send_raw(send, status, json.dumps(data).encode(), extra_headers)


async def _send_raw(send, status: int, body: bytes, extra_headers: list | None = None) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(extra_headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve(app, port: int | None = None, **uvicorn_options: Any) -> Iterator[str]:
    """Run an ASGI app with uvicorn in a daemon thread; yields its base URL (https when
    `ssl_certfile` and `ssl_keyfile` are given)."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port or free_port(),
        log_level="critical",
        lifespan="off",
        access_log=False,
        timeout_graceful_shutdown=1,
        **uvicorn_options,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="fake-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the fake server did not start")
        time.sleep(0.01)
    try:
        scheme = "https" if uvicorn_options.get("ssl_certfile") else "http"
        yield f"{scheme}://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def silent_server() -> Iterator[str]:
    """A server that accepts every connection, reads, and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in accepted:
            conn.close()
        listener.close()


class ResetProxy:
    """A TCP proxy to `upstream` (host, port) that resets connections on demand.

    `reset_all()` resets every open connection at once (a load balancer or network blip,
    requests in flight included); `reset_next(n)` resets the next `n` new connections as soon
    as their request arrives. A reset is a close with SO_LINGER 0: the client sees a TCP RST,
    not an HTTP answer. `resets` counts the connections reset so far.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.resets = 0
        self._reset_next = 0
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        threading.Thread(target=self._accept, name="reset-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset_next(self, n: int) -> None:
        with self._lock:
            self._reset_next += n

    def reset_all(self) -> int:
        """Reset every open client connection; how many were reset."""
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            self._reset(sock)
        return len(sockets)

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        self.reset_all()

    def _reset(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        except OSError:
            return
        with self._lock:
            self.resets += 1

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            doomed = self._reset_next > 0
            self._reset_next -= doomed
            if not doomed:
                self._open.add(client)
        if doomed:
            try:
                client.recv(65536)  # the request arrives, then the connection is reset
            except OSError:
                pass
            self._reset(client)
            return
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            self._reset(client)
            return
        pump = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        pump.start()
        _pump(client, upstream)
        pump.join(timeout=5)
        with self._lock:
            self._open.discard(client)
        for sock in (client, upstream):
            try:
                sock.close()
            except OSError:
                pass


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy bytes until either side closes; then half-close the sink."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    try:
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass


CAPTURE_LAYERS, CAPTURE_HIDDEN = 4, 128  # the fixture target's 3 aux layers + the last; H


def capture_states(ids: list[int]):
    """What `CaptureServer` extracts for `ids`: [T, L, H], a function of the ids."""
    import torch

    t = torch.tensor(ids, dtype=torch.float32)[:, None, None]  # [T, 1, 1]
    return (
        t
        + torch.arange(CAPTURE_LAYERS * CAPTURE_HIDDEN, dtype=torch.float32).view(
            1, CAPTURE_LAYERS, CAPTURE_HIDDEN
        )
        / 1e3
    )


class CaptureServer:
    """A stand-in for a vLLM server with the hidden-states connector (an ASGI app for
    `serve`): answers each completion by writing the connector file; `failures` answers that many
    requests with `status` first; `delay_s` per request; `truncated`: every answer is a 200
    whose file stops halfway, and `/health` fails (a server killed while writing it)."""

    def __init__(self, connector, failures=0, status=503, delay_s=0.0, truncated=False):
        self.connector, self.failures, self.status, self.delay_s = (
            connector,
            failures,
            status,
            delay_s,
        )
        self.truncated = truncated
        self.served: list[str] = []
        self.lock = threading.Lock()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await _send_json(send, 503 if self.truncated else 200, {})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        with self.lock:
            if self.failures > 0:
                self.failures -= 1
                await _send_json(send, self.status, {"error": "busy"})
                return
        await asyncio.sleep(self.delay_s)
        ids = request["prompt"]
        name = f"{len(self.served)}-{id(self)}-{ids[0]}-{len(ids)}.safetensors"
        with self.lock:
            self.served.append(name)
        import torch
        from safetensors.torch import save_file

        path = self.connector / name
        save_file({"hidden_states": capture_states(ids), "token_ids": torch.tensor(ids)}, str(path))
        if self.truncated:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        await _send_json(send, 200, {"kv_transfer_params": {"hidden_states_path": name}})
