"""vLLM's ExampleHiddenStatesConnector made to run on vLLM's CPU build, for the capture tests.

The stock connector copies the captured hidden states out of its cache on a CUDA stream into pinned memory and
writes them from a thread; a CPU-only torch has neither streams nor pinned memory. This subclass does the same
extraction synchronously on the CPU and leaves everything else (which layers, the file format, the lock file,
the path returned in `kv_transfer_params`) to vLLM's own code. It runs inside vLLM's process, imported through
`kv_connector_module_path`, so it imports nothing from eyas.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the stock connector polls: the CPU copy is finished when it returns."""

    @staticmethod
    def query() -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hidden, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock a reader waits on
        self._req_copy_events[pending.req_id] = _Done()
