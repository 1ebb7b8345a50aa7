"""The `vllm` backend: vLLM servers compute the target's states; eaglet writes the shards, or
trains on them as they come (online training).

The server runs with the `extract_hidden_states` speculative method and a hidden-states KV
connector (`server_args` builds both flags): for every request it writes one safetensors file
with `hidden_states` [T, L, H] (the aux layers, then the last layer) and `token_ids` [T], and
names it in the response's `kv_transfer_params.hidden_states_path`. eaglet sends each
example's token ids (`POST /v1/completions`, `max_tokens: 1`), reads the file once the
connector's lock is released, and deletes it. vLLM's last-layer state is before the final
norm; eaglet applies the target's norm (only its weight is read from the safetensors, never
the whole model) to get the post-norm state the shards hold.

`VllmBackend.features` streams its requests (at most `2 * concurrency` samples in flight or
waiting), for the stage's shards and online training alike.

`started_server` starts that server on this machine for a stage when
`hidden_states.vllm.vllm_python` is set, and stops it when the stage is done; otherwise
`hidden_states.vllm.endpoints` name servers someone else runs (a serving fleet, another node).
The preflight checks those servers (`VllmServerBackend.preflight`).

Its settings are the section `hidden_states.vllm` (`VllmSettings`); older configs wrote them in
`hidden_states` itself, and `eaglet.config` still reads them there.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import eaglet
from eaglet.errors import is_transient_status
from eaglet.hidden_states.backends.base import Sample
from eaglet.hidden_states.backends.settings import VllmSettings
from eaglet.hidden_states.capture_pool import CapturePool
from eaglet.hidden_states.layers import layer_ids_of, resolve_aux_layer_ids

if TYPE_CHECKING:  # imported where used: a config loads this module (eaglet.config)
    import torch

    from eaglet.config import HiddenStatesConfig, PipelineConfig, TargetConfig


CPU_CONNECTOR = ("CpuHiddenStatesConnector", "eaglet.hidden_states.vllm_cpu_connector")
STOCK_CONNECTOR = (
    "ExampleHiddenStatesConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
)


def server_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids the server extracts: the aux ids, then the last layer's output."""
    return [*aux_layer_ids, num_layers]


def server_args(
    aux_layer_ids: list[int], num_layers: int, storage_path: str, cpu: bool = False
) -> list[str]:
    """The vLLM server flags for hidden-state extraction (CPU: eaglet's CPU-safe connector,
    which must be importable by the server; GPU: vLLM's stock connector)."""
    name, module = CPU_CONNECTOR if cpu else STOCK_CONNECTOR
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {
                "eagle_aux_hidden_state_layer_ids": server_layer_ids(aux_layer_ids, num_layers)
            }
        },
    }
    transfer = {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": storage_path},
    }
    return [
        "--speculative-config",
        json.dumps(speculative),
        "--kv-transfer-config",
        json.dumps(transfer),
    ]


def capture_server_command(
    config: PipelineConfig, port: int, connector: str, host: str = "127.0.0.1"
) -> tuple[list[str], dict[str, str]]:
    """The command and added environment of a capture server for `config`'s target: vLLM
    (`hidden_states.vllm.vllm_python`, or `python` on the PATH) with extract_hidden_states at
    the run's layers and the connector writing into `connector` (CPU: eaglet's connector,
    importable through PYTHONPATH; GPU: vLLM's stock one), plus `hidden_states.vllm.vllm_args`.
    What `started_server` runs, and what a cluster starts on each capture node
    (`python -m eaglet.hidden_states.capture_server`)."""
    from eaglet.target import load_config, resolve_device, target_dtype

    settings, target = config.hidden_states.vllm, config.target
    num_layers = load_config(target).num_hidden_layers
    aux_layer_ids = layer_ids_of(config, num_layers)  # the layers the stage asks for
    cpu = resolve_device(target.device) == "cpu"
    command = [
        settings.vllm_python or "python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", target.model, "--served-model-name", settings.served_model,
        "--host", host, "--port", str(port), "--dtype", target_dtype(target),
    ]  # fmt: skip
    if target.revision:
        command += ["--revision", target.revision]
    if target.trust_remote_code:
        command += ["--trust-remote-code"]
    command += server_args(aux_layer_ids, num_layers, connector, cpu=cpu)
    command += settings.vllm_args
    env = {}
    if cpu:  # the server imports eaglet's CPU-safe connector from this installation
        package_root = str(Path(eaglet.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, os.getenv("PYTHONPATH")]))
    return command, env


@contextmanager
def started_server(
    config: PipelineConfig, folder: Path, report: Callable[[str], None] = print
) -> Iterator[PipelineConfig]:
    """`config` unchanged, unless it has `hidden_states.vllm.vllm_python`: then a server for
    the target started here (log `folder/vllm_server.log`, connector files in
    `folder/connector`, removed afterwards), and `config` with `endpoints` naming it."""
    from eaglet.vllm_process import free_port, vllm_server

    settings, target = config.hidden_states.vllm, config.target
    if not settings.vllm_python:
        yield config
        return
    connector = Path(folder) / "connector"
    connector.mkdir(parents=True, exist_ok=True)
    command, env = capture_server_command(config, free_port(), str(connector))
    log_path = Path(folder) / "vllm_server.log"
    report(f"hidden states: starting a vLLM server for {target.model} (log {log_path})")
    try:
        with vllm_server(
            command, log_path, settings.startup_timeout_s, env=env,
            timeout_setting="hidden_states.vllm.startup_timeout_s",
        ) as url:  # fmt: skip
            report(f"hidden states: vLLM server up at {url}")
            served = settings.model_copy(
                update={"endpoints": [url], "connector_path": str(connector)}
            )
            hidden_states = config.hidden_states.model_copy(update={"vllm": served})
            yield config.model_copy(update={"hidden_states": hidden_states})
    finally:
        shutil.rmtree(connector, ignore_errors=True)


def _weight_file(model_dir: Path, name: str) -> Path:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return model_dir / json.loads(index.read_text())["weight_map"][name]
    return model_dir / "model.safetensors"


def _model_folder(target: TargetConfig) -> Path:
    folder = Path(target.model)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            target.model, revision=target.revision, allow_patterns=["*.json", "*.safetensors"]
        )
    )


class FinalNorm:
    """The target's final RMSNorm, from its weight alone (read out of the safetensors)."""

    def __init__(self, target: TargetConfig, weight_name: str = "model.norm.weight"):
        from safetensors import safe_open

        from eaglet.target import load_config

        cfg = load_config(target)
        folder = _model_folder(target)
        with safe_open(str(_weight_file(folder, weight_name)), framework="pt") as f:
            self.weight = f.get_tensor(weight_name).float()  # [H]
        self.eps = float(getattr(cfg, "rms_norm_eps", 1e-6))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x


def read_connector_file(path: str) -> dict[str, torch.Tensor]:
    """The connector's file, once its writer released the lock. Nothing is removed here:
    `remove_connector_file` does that once the content is proven to be this request's."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)  # sleeps until the writer is done
            return load_file(path)
    return load_file(path)


CONNECTOR_TENSORS = frozenset({"hidden_states", "token_ids"})


def connector_file_problem(data: dict[str, torch.Tensor], input_ids: list[int]) -> str | None:
    """Why `data` is not the connector's file for a request of `input_ids` (None when it is):
    exactly the tensors hidden_states [T, L, H] and token_ids [T], the ids those sent."""
    if set(data) != CONNECTOR_TENSORS:
        return f"holds {sorted(data)[:5]}, not exactly hidden_states and token_ids"
    states, ids = data["hidden_states"], data["token_ids"]
    if states.dim() != 3 or ids.dim() != 1 or states.shape[0] != ids.shape[0]:
        return f"holds hidden_states {list(states.shape)} and token_ids {list(ids.shape)}"
    if ids.tolist() != list(input_ids):
        return f"holds the states of other token ids ({len(ids)} tokens, not this sample's)"
    return None


def remove_connector_file(path: str) -> None:
    """Remove a connector file (and its lock) proven to be the answer to eaglet's request."""
    for leftover in (path, path + ".lock"):
        try:
            os.remove(leftover)
        except FileNotFoundError:
            pass


def connector_folder_problem(folder: str) -> str | None:
    """Why `folder` is not a connector folder eaglet may read and delete files in (None when it
    is): it holds only connector files (`*.safetensors` and their `.lock` files). A model or
    a work dir there would be read as hidden states; eaglet never deletes what it did not ask
    a server to write, and refuses a folder where such files sit."""
    root = Path(folder)
    if not root.exists():
        return None  # the server creates it
    if not root.is_dir():
        return f"{folder} is not a folder"
    others = [
        p.relative_to(root)
        for p in root.rglob("*")
        if p.is_file() and not p.name.endswith((".safetensors", ".safetensors.lock"))
    ]
    if others:
        shown = ", ".join(str(p) for p in sorted(others)[:3])
        return (
            f"{folder} holds files that are not the connector's ({shown}"
            f"{', …' if len(others) > 3 else ''}): point it at the connector's own "
            "shared_storage_path, a folder that holds nothing else"
        )
    return None


class UnreadableFile(RuntimeError):
    """A 200 whose connector file cannot be read here. The server writes the file after
    answering and releases its lock when done or dead, so a server killed mid-write leaves a
    truncated or missing file: sent again elsewhere, like a failed request. A server that
    still answers `/health` wrote it where this machine does not look: raised at once."""


class VllmBackend:
    """Target features of examples from vLLM servers with the hidden-states connector."""

    def __init__(
        self,
        target: TargetConfig,
        settings: HiddenStatesConfig,
        aux_layer_ids: list[int] | None = None,
    ):
        import httpx

        from eaglet.target import load_config

        cfg = load_config(target)
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        # given: resolved by the run's draft method (`layers.layer_ids_of`); None: EAGLE-3's
        self.aux_layer_ids = (
            resolve_aux_layer_ids(settings.aux_layer_ids, self.num_layers)
            if aux_layer_ids is None
            else list(aux_layer_ids)
        )
        self.settings = settings.vllm
        self.norm = FinalNorm(target)
        self.client = httpx.Client(timeout=self.settings.request_timeout_s)
        self.pool = CapturePool(list(self.settings.endpoints))  # balance, failures, rates

    def _local_path(self, url: str, sample_id: str, server_path: Any) -> str:
        """The connector file a response names, inside the connector folder eaglet configured
        (`hidden_states.vllm.connector_path`, or that of the server eaglet started): only
        its file name is taken from the server, so no response can make eaglet read or delete
        a file elsewhere; a name that is not a connector file is an error naming the server."""
        name = Path(server_path).name if isinstance(server_path, str) else ""
        if not name.endswith(".safetensors") or name != str(server_path).rsplit("/", 1)[-1]:
            raise RuntimeError(
                f"sample {sample_id}: {url} named {server_path!r} as its hidden-states file; "
                "a connector file is a .safetensors file: is this the server with eaglet's "
                "connector (eaglet.hidden_states.backends.vllm.server_args)?"
            )
        return str(Path(self.settings.connector_path) / name)

    def one(self, example: Sample) -> dict[str, torch.Tensor]:
        """Features of one example: aux [T, kH], final [T, H] (post-norm), from the capture
        server the pool picks; a server that fails in a way that may pass (no answer, 408,
        429, 5xx, a file it died before finishing) is left for a while and the request sent
        again (`CapturePool`)."""
        import httpx

        server = None
        for _ in range(self.pool.tries):
            server = self.pool.pick(avoid=server)
            url = f"{server.url}/v1/completions"
            try:
                with self.pool.request(server):
                    response = self.client.post(url, json=self._body(example))
            except (httpx.TransportError, httpx.TimeoutException) as exc:
                self.pool.failed(server, f"{type(exc).__name__}: {exc}"[:200])
                continue
            if is_transient_status(response.status_code):
                self.pool.failed(server, f"answered {response.status_code}")
                continue
            try:
                features = self._read(example, url, response)
            except UnreadableFile as exc:
                if self._alive(server.url):  # the same on every try: a folder not shared
                    raise
                self.pool.failed(server, str(exc)[:400])  # died writing it: sent again
                continue
            self.pool.answered(server, len(example.input_ids))
            return features
        raise self.pool.gave_up(example.sample_id)

    def _alive(self, url: str) -> bool:
        """Whether the server at `url` answers `/health` (within 5 s)."""
        import httpx

        try:
            return self.client.get(f"{url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _body(self, example: Sample) -> dict[str, Any]:
        return {
            "model": self.settings.served_model,
            "prompt": example.input_ids,
            "max_tokens": 1,
            "temperature": 0.0,
        }

    def _read(self, example: Sample, url: str, response: Any) -> dict[str, torch.Tensor]:
        """The features a 200 names (its connector file, checked to be this request's)."""
        from safetensors import SafetensorError

        if response.status_code != 200:
            raise RuntimeError(
                f"sample {example.sample_id}: {url} answered {response.status_code}: "
                f"{response.text[:300]}"
            )
        try:
            params = response.json().get("kv_transfer_params") or {}
        except (ValueError, AttributeError):
            raise RuntimeError(
                f"sample {example.sample_id}: {url} answered 200 with a body that is not a JSON "
                f"object: {response.text[:200]!r}"
            ) from None
        if not isinstance(params, dict) or "hidden_states_path" not in params:
            raise RuntimeError(
                f"{url} returned no kv_transfer_params.hidden_states_path: start the server "
                "with eaglet.hidden_states.backends.vllm.server_args (extract_hidden_states + "
                "connector)"
            )
        path = self._local_path(url, example.sample_id, params["hidden_states_path"])
        try:
            data = read_connector_file(path)
        except (OSError, SafetensorError) as exc:
            raise UnreadableFile(
                f"sample {example.sample_id}: the hidden-states file {url} named ({path}) could "
                f"not be read: {exc}. Is hidden_states.vllm.connector_path the connector's "
                "shared_storage_path as seen from this machine?"
            ) from None
        problem = connector_file_problem(data, example.input_ids)
        if problem is not None:  # never delete a file not proven to be this request's
            raise RuntimeError(
                f"sample {example.sample_id}: the file {url} named ({path}) {problem}: not the "
                "hidden-states connector's answer to this request; left in place"
            )
        remove_connector_file(path)
        states = data["hidden_states"]  # [T, L, H]: the k aux layers, then the last one
        k = len(self.aux_layer_ids)
        if states.shape[1] != k + 1:
            raise RuntimeError(
                f"sample {example.sample_id}: the connector file holds {states.shape[1]} layers "
                f"for {states.shape[0]} tokens; expected {k + 1} layers "
                f"{server_layer_ids(self.aux_layer_ids, self.num_layers)}. Start the server "
                "with those layer ids."
            )
        T = states.shape[0]
        return {
            "aux_hidden_states": states[:, :k].float().reshape(T, k * self.hidden_size),
            "final_hidden_states": self.norm(states[:, k]),
        }

    def stream(self, examples: Iterable[Sample]) -> Iterator[tuple[Sample, dict]]:
        """(example, features) in input order, with at most `2 * concurrency` pending."""
        window = 2 * self.settings.concurrency
        with ThreadPoolExecutor(max_workers=self.settings.concurrency) as pool:
            pending: deque = deque()
            for example in examples:
                pending.append((example, pool.submit(self.one, example)))
                if len(pending) >= window:
                    example, future = pending.popleft()
                    yield example, future.result()
            while pending:
                example, future = pending.popleft()
                yield example, future.result()

    def features(
        self, examples: Sequence[Sample], on_tokens: Callable[[int], None] | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """Features of every example, in order; `on_tokens(n)` after each example's n tokens."""
        out = []
        for example, features in self.stream(examples):
            out.append(features)
            if on_tokens is not None:
                on_tokens(len(example.input_ids))
        return out

    def server_stats(self) -> dict[str, dict]:
        """Per capture server: samples, tokens, busy seconds, retries (`CapturePool.stats`)."""
        return self.pool.stats()

    def close(self) -> None:
        self.client.close()


HIDDEN_STATES_NEED = "hidden states come from vLLM's extract_hidden_states connector"
HIDDEN_STATES_INSTEAD = (
    "point it at a vLLM server started with eaglet's server_args, or set "
    "hidden_states.vllm.vllm_python so that eaglet starts one"
)


class VllmServerBackend:
    """`hidden_states.backend: vllm`: the servers of `hidden_states.vllm.endpoints`, or the one
    `started_server` starts for a stage (`hidden_states.vllm.vllm_python`)."""

    name = "vllm"
    settings = VllmSettings
    served = True  # online training fetches the next micro-batches ahead (train.online_prefetch)

    def open(
        self, target: TargetConfig, settings: HiddenStatesConfig, aux_layer_ids: list[int]
    ) -> VllmBackend:
        return VllmBackend(target, settings, aux_layer_ids)

    def serving(self, config: PipelineConfig, folder: Path, report: Callable[[str], None]):
        return started_server(config, folder, report)

    def preflight(self, config: PipelineConfig, report: Any) -> None:
        """The servers, checked now rather than hours into the run: the python eaglet starts
        one with finds vLLM (and its server on 127.0.0.1 is not one that the workers of
        a Dask cluster elsewhere must reach); or the servers someone else runs answer as vLLM
        does, and their connector folder holds only connector files."""
        from eaglet.preflight.endpoints import check_python_with_vllm, check_vllm_server

        settings = config.hidden_states.vllm
        python = settings.vllm_python
        if python:
            check_python_with_vllm("hidden_states.vllm.vllm_python", python, report)
            execution = config.execution
            mapped = execution.task_runner == "dask" and config.train.hidden_states != "online"
            if mapped and execution.dask_address:
                report.problems.append(
                    "hidden_states.vllm.vllm_python starts a vLLM server on 127.0.0.1, which the "
                    f"workers of the Dask cluster at {execution.dask_address} cannot reach: "
                    "start servers they can reach and list them in "
                    "hidden_states.vllm.endpoints"
                )
            return
        if settings.connector_path:
            problem = connector_folder_problem(settings.connector_path)
            if problem:
                report.problems.append(f"hidden_states.vllm.connector_path: {problem}")
        online = " (online training)" if config.train.hidden_states == "online" else ""
        for i, url in enumerate(settings.endpoints):
            setting = f"hidden_states.vllm.endpoints[{i}]{online}"
            check_vllm_server(setting, url, HIDDEN_STATES_NEED, HIDDEN_STATES_INSTEAD, report)


BACKEND = VllmServerBackend()
