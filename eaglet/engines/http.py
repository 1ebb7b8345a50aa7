"""What every HTTP engine shares: clients, bounded concurrency, balancing, retries.

An `HTTPEngine` turns prompts into `Generation` records (or `Failure`s) by POSTing one JSON
request per prompt. This module owns everything that is not the wire format of one server:

- async clients per endpoint, opened for one `generate_async` call and closed after it
  (clients belong to the event loop they were opened in);
- at most `generation.concurrency` requests in flight over all endpoints, and prompts read
  lazily, so 88k prompts never become 88k pending tasks;
- least-outstanding-requests balancing over the endpoints; an endpoint that refused a
  connection is avoided for a few seconds so a dead server does not attract traffic;
- retries with exponential backoff and full jitter after connection errors, timeouts, 408,
  429 (a `Retry-After` header wins) and 5xx; another 4xx is the server saying no, so it is not
  retried and becomes a `Failure` with the server's own message; a response that is not the
  JSON the engine expects is retried a couple of times, then fails;
- the API key, read from the environment variable the config names, sent as
  `Authorization: Bearer` and scrubbed from every message eaglet writes.

A subclass says only what to send (`request_for`) and how to read the answer (`parse`); one
that streams (`streams()`: every HTTP engine under the loop guard) also folds each server-sent
event into its state (`read_stream_chunk`) and builds the record at the end (`finish_stream`)
or when the loop guard stops the answer (`looped`); the same retries apply to a stream.
The HTTP library is httpx2 (httpx's API): on one client core it sustains ~1.4x the requests/s
of httpx 0.28.1 at ~0.7x the CPU per request (benchmarks/generation.py). Each endpoint gets
several small clients rather than one big one: a client's pool scans all its connections on
every request, which at concurrency 256 costs 3.5x the CPU per request.
"""

from __future__ import annotations

import asyncio
import email.utils
import importlib
import json
import logging
import math
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from eaglet.config import PipelineConfig
from eaglet.engines.base import SamplingParams
from eaglet.errors import is_transient_status
from eaglet.generation import Failure
from eaglet.loop_guard import LoopDetector
from eaglet.records.generations import Generation
from eaglet.records.prompts import Prompt

logger = logging.getLogger("eaglet.engines.http")

BACKOFF_CAP_S = 60.0  # longest wait between two tries, whatever the attempt number
RETRY_AFTER_CAP_S = 600.0  # a server's Retry-After is honoured up to this
MALFORMED_RETRIES = 2  # a well-behaved server does not send bad JSON twice in a row
CONNECT_TIMEOUT_CAP_S = 30.0
CONNECTIONS_PER_CLIENT = 8
DOWN_AFTER_CONNECT_ERROR_S = 5.0  # an endpoint that refused a connection is skipped this long
MESSAGE_CHARS = 500  # server messages kept in a Failure

T = TypeVar("T")
R = TypeVar("R")


class MalformedResponse(ValueError):
    """A 200 answer that is not what the engine expects; retried a few times, then a Failure."""


class RetryableResponse(RuntimeError):
    """A 200 answer that says the request did not finish (e.g. aborted); retried like a 5xx."""


def read_api_key(env_name: str | None) -> str | None:
    """The key held by the environment variable `env_name`; an error says which is unset."""
    if env_name is None:
        return None
    key = os.environ.get(env_name, "").strip()
    if not key:
        raise ValueError(
            f"generation.api_key_env={env_name!r}, but the environment variable {env_name} is "
            f"not set: export {env_name}=<key> in the shell (or the worker's environment) "
            "that runs eaglet, or unset generation.api_key_env for a server without a key"
        )
    return key


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds a `Retry-After` header asks for: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def server_message(body: bytes) -> str:
    """The error text a server put in its answer (OpenAI, vLLM, SGLang, FastAPI shapes)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:MESSAGE_CHARS] or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:MESSAGE_CHARS]
        for key in ("message", "detail", "error"):
            if data.get(key):
                value = data[key]
                return (value if isinstance(value, str) else json.dumps(value))[:MESSAGE_CHARS]
    return text[:MESSAGE_CHARS]


def streamed_choice(chunk: dict[str, Any], state: dict[str, Any]) -> dict[str, Any] | None:
    """The first choice of an OpenAI-style streamed event (None for the usage event, whose
    usage goes into `state`); an event without a choices list is malformed."""
    if chunk.get("usage"):
        state["usage"] = chunk["usage"]
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        raise MalformedResponse("a streamed event without choices")
    return choices[0] if choices else None


def int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) for i in value):
        raise MalformedResponse(f"{what} is not a list of token ids")
    return value


def prompt_ids_check(ours: list[int], theirs: Any) -> dict[str, Any]:
    """Raw fields that flag a server whose prompt ids differ from ours (none if they agree
    or the server did not say)."""
    if not isinstance(theirs, list) or theirs == ours:
        return {}
    return {"prompt_ids_mismatch": True, "server_prompt_token_ids": theirs}


@dataclass
class Endpoint:
    """One server, reached through a few clients (`CONNECTIONS_PER_CLIENT` connections each:
    a client's pool scans all its connections on every request, so one big pool costs more
    CPU per request than several small ones)."""

    url: str
    clients: list[Any]
    outstanding: int = 0
    down_until: float = 0.0
    loads: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.loads = [0] * len(self.clients)

    @property
    def client(self) -> Any:
        return self.clients[0]


@dataclass
class EndpointPool:
    """The endpoints of one run, each with its own client; `pick` balances by load."""

    endpoints: list[Endpoint]
    _turn: int = 0

    def pick(self) -> Endpoint:
        """The endpoint with the fewest requests in flight, preferring ones not marked down;
        ties go round-robin so equal servers get equal shares."""
        now = time.monotonic()
        up = [e for e in self.endpoints if e.down_until <= now] or self.endpoints
        least = min(e.outstanding for e in up)
        candidates = [e for e in up if e.outstanding == least]
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    async def aclose(self) -> None:
        clients = [c for e in self.endpoints for c in e.clients]
        await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)


@dataclass
class RetryPolicy:
    max_retries: int
    backoff_s: float
    malformed_retries: int = MALFORMED_RETRIES

    def backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2^attempt)] (attempt counts from 0)."""
        return random.uniform(0.0, min(BACKOFF_CAP_S, self.backoff_s * 2**attempt))


@dataclass
class _Outcome:
    """What one try produced: a record, or why it failed and whether to try again."""

    generation: Generation | None = None
    status: int | None = None
    message: str = ""
    retry: bool = False
    wait_s: float | None = None  # None: use the backoff
    malformed: bool = False


@dataclass
class HTTPEngine:
    """Base of the vllm, sglang and openai engines.

    Construction (all engines): `Engine(config: PipelineConfig, tokenizer=None, *,
    end_ids=None, http_library=None, api_key=None)`, or `Engine.from_config(...)` with the same
    arguments (how `eaglet.engines.registry.make_engine` builds every engine). `tokenizer` is
    the target's tokenizer (needed by the openai engine to re-tokenize text; the others use it
    only to find the end token ids); `end_ids` overrides the end token ids read from the
    target's generation config.
    """

    config: PipelineConfig
    tokenizer: Any = field(default=None, repr=False)
    end_ids: list[int] | None = field(default=None, kw_only=True)
    http_library: str | None = field(default=None, kw_only=True)
    # The key itself, when the caller read it from a secret store (a Prefect Secret block);
    # None: read the environment variable `generation.api_key_env` names.
    api_key: str | None = field(default=None, kw_only=True, repr=False)
    sample_response: dict[str, Any] | None = field(default=None, init=False, repr=False)
    name: ClassVar[str] = "http"
    # A GET that answers 200 when the server is up (the canary's first check); the OpenAI
    # model list also names the models served.
    health_path: ClassVar[str] = "/v1/models"
    # The path every generation request goes to (the canary names it when a server lacks it).
    request_path: ClassVar[str] = ""

    def __post_init__(self) -> None:
        gen = self.config.generation
        if not gen.endpoints:
            raise ValueError("generation.endpoints is empty: list at least one server URL")
        self._api_key = self.api_key or read_api_key(gen.api_key_env)
        self.http = importlib.import_module(self.http_library or "httpx2")  # httpx's API
        self.retry = RetryPolicy(gen.max_retries, gen.retry_backoff_s)
        self.params = SamplingParams.from_generation(gen)
        if self.end_ids is None:
            self.end_ids = self._target_end_ids()

    @classmethod
    def from_config(cls, config: PipelineConfig, tokenizer: Any = None, **kwargs: Any):
        return cls(config, tokenizer, **kwargs)

    def _target_end_ids(self) -> list[int]:
        if self.tokenizer is None:
            return []
        from eaglet.target import end_token_ids

        return end_token_ids(self.config.target, self.tokenizer)

    # --- what a subclass provides ---------------------------------------------------

    def request_for(self, prompt: Prompt) -> tuple[str, dict[str, Any]]:
        """The path (e.g. '/v1/completions') and JSON body of the request for one prompt."""
        raise NotImplementedError

    def parse(self, prompt: Prompt, body: dict[str, Any]) -> Generation:
        """The record for a 200 answer; MalformedResponse / RetryableResponse otherwise."""
        raise NotImplementedError

    def streams(self) -> bool:
        """Whether requests stream their answer: with `generation.loop_guard`, so the guard
        reads the ids as they come."""
        return self.config.generation.loop_guard

    def read_stream_chunk(self, chunk: dict[str, Any], state: dict[str, Any]) -> list[int]:
        """Fold one streamed JSON event into `state`; return the output ids it adds."""
        raise NotImplementedError

    def finish_stream(self, prompt: Prompt, state: dict[str, Any]) -> Generation:
        """The record of a stream that ended (MalformedResponse if it ended unfinished)."""
        raise NotImplementedError

    def looped(self, prompt: Prompt, state: dict[str, Any], detector: LoopDetector) -> Generation:
        """The record of an answer the loop guard stopped: its ids so far, finish 'loop'."""
        raise NotImplementedError

    def on_client_error(self, status: int, message: str) -> bool:
        """Called on a non-retried 4xx; return True after changing what `request_for` sends
        to try once more (e.g. drop a field the server does not know)."""
        return False

    # --- the run ----------------------------------------------------------------------

    async def generate_async(
        self, prompts: Iterable[Prompt]
    ) -> AsyncIterator[Generation | Failure]:
        """One `Generation` or `Failure` per prompt, in completion order, with at most
        `generation.concurrency` requests in flight."""
        async with self.open_pool() as pool:
            work = bounded_map(
                lambda prompt: self.generate_one(pool, prompt),
                prompts,
                self.config.generation.concurrency,
            )
            try:
                async for item in work:
                    yield item
            finally:
                await work.aclose()

    @asynccontextmanager
    async def open_pool(self) -> AsyncIterator[EndpointPool]:
        gen = self.config.generation
        http = self.http
        timeout = http.Timeout(
            gen.request_timeout_s, connect=min(CONNECT_TIMEOUT_CAP_S, gen.request_timeout_s)
        )
        shards = max(1, math.ceil(gen.concurrency / CONNECTIONS_PER_CLIENT))
        per_client = math.ceil(gen.concurrency / shards)
        limits = http.Limits(max_connections=per_client, max_keepalive_connections=per_client)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

        urls = [url.rstrip("/") for url in gen.endpoints]
        # One TLS context for all clients (making one costs ~25 ms); none for plain http.
        tls = http.create_ssl_context() if any(u.startswith("https:") for u in urls) else False

        def client(url: str) -> Any:
            return http.AsyncClient(
                base_url=url,
                timeout=timeout,
                limits=limits,
                headers=headers,
                verify=tls,
                trust_env=False,  # no proxy from the environment for inference servers
            )

        pool = EndpointPool([Endpoint(url, [client(url) for _ in range(shards)]) for url in urls])
        try:
            yield pool
        finally:
            await pool.aclose()

    async def generate_one(self, pool: EndpointPool, prompt: Prompt) -> Generation | Failure:
        """Send one prompt until it succeeds, fails for good, or retries run out."""
        attempts = retries = malformed = 0
        changed_request = False
        while True:
            endpoint = pool.pick()
            outcome = await self._try_once(endpoint, prompt)
            attempts += 1
            if outcome.generation is not None:
                return outcome.generation
            if (
                not outcome.retry
                and outcome.status is not None
                and not changed_request
                and self.on_client_error(outcome.status, outcome.message)
            ):
                changed_request = True
                continue
            malformed += outcome.malformed
            out_of_tries = retries >= self.retry.max_retries or (
                outcome.malformed and malformed > self.retry.malformed_retries
            )
            if not outcome.retry or out_of_tries:
                suffix = f" (after {attempts} attempts)" if attempts > 1 else ""
                return Failure(
                    sample_id=prompt.sample_id,
                    source=prompt.source,
                    status=outcome.status,
                    message=self.scrub(outcome.message + suffix),
                    attempts=attempts,
                    engine=self.name,
                )
            wait = outcome.wait_s if outcome.wait_s is not None else self.retry.backoff(retries)
            retries += 1
            logger.warning(
                "sample %s: %s; retry %d/%d in %.1f s",
                prompt.sample_id,
                self.scrub(outcome.message),
                retries,
                self.retry.max_retries,
                wait,
            )
            await asyncio.sleep(wait)

    async def _try_once(self, endpoint: Endpoint, prompt: Prompt) -> _Outcome:
        path, payload = self.request_for(prompt)
        where = f"{endpoint.url}{path}"
        timeout_s = self.config.generation.request_timeout_s
        shard = endpoint.loads.index(min(endpoint.loads))  # the least busy client
        endpoint.outstanding += 1
        endpoint.loads[shard] += 1
        try:
            async with asyncio.timeout(timeout_s):
                client = endpoint.clients[shard]
                if self.streams():
                    return await self._stream_once(client, path, payload, prompt, where)
                response = await client.post(path, json=payload)
        except TimeoutError:
            return _Outcome(message=f"no answer from {where} within {timeout_s:g} s", retry=True)
        except self.http.TimeoutException as exc:
            return _Outcome(message=f"timed out talking to {where}: {_describe(exc)}", retry=True)
        except self.http.TransportError as exc:
            if isinstance(exc, self.http.ConnectError):
                endpoint.down_until = time.monotonic() + DOWN_AFTER_CONNECT_ERROR_S
            return _Outcome(message=f"connection to {where} failed: {_describe(exc)}", retry=True)
        finally:
            endpoint.outstanding -= 1
            endpoint.loads[shard] -= 1
        if response.status_code == 200:
            return self._read_success(prompt, response.content, where)
        return self._refused(response, where)

    def _refused(self, response: Any, where: str) -> _Outcome:
        """The outcome of a non-200 answer (its body read)."""
        status = response.status_code
        message = f"HTTP {status} from {where}: {server_message(response.content)}"
        if status == 429:
            wait = retry_after_seconds(response.headers.get("retry-after"))
            wait = None if wait is None else min(wait, RETRY_AFTER_CAP_S)
            return _Outcome(status=status, message=message, retry=True, wait_s=wait)
        return _Outcome(status=status, message=message, retry=is_transient_status(status))

    async def _stream_once(
        self, client: Any, path: str, payload: dict[str, Any], prompt: Prompt, where: str
    ) -> _Outcome:
        """One streamed request: server-sent events read as they come, the loop guard fed
        each one's ids; a looping answer ends the request (leaving the stream closes the
        connection, and the server aborts the request)."""
        gen = self.config.generation
        detector = LoopDetector(gen.loop_ngram, gen.loop_repeats)
        state: dict[str, Any] = {}
        start = ""  # the stream's first characters, for a malformed one's message
        first: dict[str, Any] | None = None  # the first event with an answer, for the canary
        async with client.stream("POST", path, json=payload) as response:
            if response.status_code != 200:
                await response.aread()
                return self._refused(response, where)
            try:
                async for line in response.aiter_lines():
                    if len(start) < 200:
                        start += line[: 200 - len(start)]
                    data = line[len("data:") :].strip() if line.startswith("data:") else None
                    if not data:
                        continue  # blank lines between events, comments
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        raise MalformedResponse(f"expected a JSON object, got {chunk!r:.80}")
                    # the first event with an answer in it (vLLM's first is not always one)
                    first = first or (
                        chunk if chunk.get("choices") or "output_ids" in chunk else None
                    )
                    if detector.feed(self.read_stream_chunk(chunk, state)):
                        generation = self.looped(prompt, state, detector)
                        return self._success(generation, first or state)
                generation = self.finish_stream(prompt, state)
            except RetryableResponse as exc:
                return _Outcome(status=200, message=f"{where}: {exc}", retry=True)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                return _Outcome(
                    status=200,
                    message=f"malformed answer from {where}: {_describe(exc)}; "
                    f"stream starts {start!r}",
                    retry=True,
                    malformed=True,
                )
        return self._success(generation, first or state)

    def _success(self, generation: Generation, body: dict[str, Any]) -> _Outcome:
        if self.sample_response is None:
            self.sample_response = body
        return _Outcome(generation=generation)

    def _read_success(self, prompt: Prompt, content: bytes, where: str) -> _Outcome:
        try:
            body = json.loads(content)
            if not isinstance(body, dict):
                raise MalformedResponse(f"expected a JSON object, got {type(body).__name__}")
            generation = self.parse(prompt, body)
        except RetryableResponse as exc:
            return _Outcome(status=200, message=f"{where}: {exc}", retry=True)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            snippet = content[:200].decode("utf-8", "replace")
            return _Outcome(
                status=200,
                message=f"malformed answer from {where}: {_describe(exc)}; body starts {snippet!r}",
                retry=True,
                malformed=True,
            )
        return self._success(generation, body)

    def scrub(self, text: str) -> str:
        """`text` with the API key replaced, for anything eaglet writes or logs."""
        return text.replace(self._api_key, "***") if self._api_key else text

    # --- shared by the token-id engines -----------------------------------------------

    def with_end_token(self, output_ids: list[int], stop_token: int | None) -> list[int]:
        """Output ids ending in the token the model stopped on (None: it did not stop on a
        token), like the local engine's records; a server that leaves it out gets it
        appended."""
        if stop_token is None:
            return output_ids
        if output_ids and (output_ids[-1] == stop_token or output_ids[-1] in self.end_ids):
            return output_ids
        return [*output_ids, stop_token]

    def stop_token(self, finish_reason: str, matched: Any) -> int | None:
        """The token the model stopped on, from what the server says it matched (vLLM's
        `stop_reason`, SGLang's `finish_reason.matched`): None means the end token (the first
        of the target's end ids), an int is that token (another end token from the model's
        generation config), a str is a stop string (no token). None when it did not stop."""
        if finish_reason != "stop":
            return None
        if matched is None:
            return self.end_ids[0] if self.end_ids else None
        return matched if isinstance(matched, int) else None


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Done:
    def __init__(self, count: int) -> None:
        self.count = count


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def bounded_map(
    fn: Callable[[T], Awaitable[R]], items: Iterable[T], limit: int
) -> AsyncIterator[R]:
    """`fn` over `items` with at most `limit` calls started and not yet consumed, results in
    completion order. Items are read lazily; closing the iterator cancels the calls in flight;
    an exception in `fn` or in reading `items` is raised to the consumer."""
    results: asyncio.Queue = asyncio.Queue()
    slots = asyncio.Semaphore(limit)
    running: set[asyncio.Task] = set()

    async def call(item: T) -> None:
        try:
            result: Any = await fn(item)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            result = _Raised(exc)
        results.put_nowait(result)

    async def feed() -> None:
        count = 0
        try:
            for item in items:
                await slots.acquire()
                task = asyncio.create_task(call(item))
                running.add(task)
                task.add_done_callback(running.discard)
                count += 1
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            results.put_nowait(_Raised(exc))
        results.put_nowait(_Done(count))

    feeder = asyncio.create_task(feed())
    received, total = 0, None
    try:
        while total is None or received < total:
            item = await results.get()
            if isinstance(item, _Done):
                total = item.count
                continue
            if isinstance(item, _Raised):
                raise item.exc
            received += 1
            slots.release()
            yield item
    finally:
        feeder.cancel()
        for task in list(running):
            task.cancel()
        await asyncio.gather(feeder, *running, return_exceptions=True)
