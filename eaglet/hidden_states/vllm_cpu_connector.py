"""vLLM's ExampleHiddenStatesConnector made to run on a CPU-only torch (loaded BY THE vLLM
SERVER through `kv_connector_module_path`, never imported by eaglet: it imports vllm).

The stock connector's writer (`_submit_async_write`) copies the slots out of the KV cache on a
CUDA stream into pinned memory and waits on a CUDA event; none of that exists on a CPU build.
This subclass overrides only that method: it copies the slots synchronously on the CPU and
hands the tensors to the same file writer with a done-event stand-in. Everything else (file
names, lock files, `kv_transfer_params.hidden_states_path` in the response) is the stock
connector's. On GPUs use the stock connector (see docs/hidden-states.md).

    --kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
      "kv_connector_module_path": "eaglet.hidden_states.vllm_cpu_connector",
      "kv_role": "kv_producer",
      "kv_connector_extra_config": {"shared_storage_path": "/shared/hs"}}'
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event of a finished device-to-host copy."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()  # on the CPU
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "two saves for one request"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(
            self._write_tensors, tensors, done, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
