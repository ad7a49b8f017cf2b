"""The online trainer's side of train.hidden_states: online (speculators 0.9.0 on-demand generation).

Installed by the trainer entry when ``EAGLE3_ONLINE_SPEC`` is set (train_draft sets it, with the server's key in
``EAGLE3_VLLM_API_KEY``: never on a command line). speculators' DataLoader asks the vLLM server for each sample's
hidden states, loads the file the server wrote, runs its own check (token ids, length, finite) and deletes the
file. This module replaces the dataset class speculators builds with a subclass that adds, in every DataLoader
worker (the subclass travels with the pickled dataset into spawned workers; a patch of speculators' class would
not):

- the server's API key on the client speculators creates (it hard-codes ``api_key="EMPTY"``);
- our check of every sample as it arrives, before training sees it: keys, shape [T, L, H] with the run's layer
  count and hidden size, the target's dtype, token ids, finite and not constant (``files.hidden_states.check_sample``,
  the same checks validate_hidden_states runs on files). A failed check counts as a failed round, so
  speculators generates the sample again (``--generation-validation-retries``);
- the sample policy: a sample still failing after the retries is appended to ``failures_path`` (row, reason,
  pid); up to ``max_failed_samples`` distinct rows are skipped (speculators drops the sample), one more raises
  ``OnlineSampleFailure``, which ends the trainer with this message;
- a per-process, per-split count of the samples checked (``counts_dir/checked-<pid>-<first row>.json``), read into
  draft/training.json;
- ``requests_in_flight`` (train.online.requests_in_flight) requests at once within each DataLoader worker (the
  training process with ``train.num_workers: 0``). speculators builds a packed batch's samples one at a time, one
  synchronous request each, and waits for each file's lock by polling every 0.1 s: one request in flight per worker
  (measured 0.52x offline's steps/s on an H200 with 4 workers, docs/benchmarks.md). PyTorch's map-style fetcher
  hands the batch sampler's whole batch to ``__getitems__`` when the dataset defines it; ours fetches the batch's
  samples in a bounded thread pool, each through the same per-sample path (retries, our check, the policy, the count,
  the file deleted), and returns them in the sampler's order, so the batches are the ones the serial fetch builds.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import threading
import types
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import speculators.train.data as data
from speculators.train.recovery import GenerationRecoveryGuard, SampleUnavailable

from eagle3_workflow.files.hidden_states import check_sample
from eagle3_workflow.trainer.online_spec import API_KEY_ENV, ONLINE_SPEC_ENV, OnlineSpec, record_failure

# the batch's samples run in threads (CheckedArrowDataset.__getitems__): what they share in this process (the
# checked counts, the failures file's read-append-count, the recovery guard's consecutive count) is updated under
# this lock; the client is set up once, under its own (its model lookup is a request)
_STATE_LOCK = threading.Lock()
_CLIENT_LOCK = threading.Lock()


class _Counter:
    """This process's checked samples, rewritten after each (a kill loses nothing already counted)."""

    def __init__(self, counts_dir: Path, split_start: int) -> None:
        # a process holds two datasets (the training and the validation split): one file each
        self.path = counts_dir / f"checked-{os.getpid()}-{split_start}.json"
        self.samples = self.tokens = 0

    def add(self, tokens: int) -> None:
        """Under _STATE_LOCK (the batch's threads share the counter and its file)."""
        self.samples, self.tokens = self.samples + 1, self.tokens + tokens
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".tmp")
        partial.write_text(json.dumps({"samples": self.samples, "tokens": self.tokens}), encoding="utf-8")
        os.replace(partial, self.path)


class _LockedRecoveryGuard(GenerationRecoveryGuard):
    """speculators' retry guard, its consecutive-failure count updated under the lock (samples run in threads)."""

    def _record_exhausted(self, *args: Any, **kwargs: Any) -> SampleUnavailable:
        with _STATE_LOCK:
            return super()._record_exhausted(*args, **kwargs)

    def _record_success(self) -> None:
        with _STATE_LOCK:
            super()._record_success()


@contextlib.contextmanager
def _keyed_openai(data_module: Any, api_key: str) -> Iterator[None]:
    """speculators' data module sees an ``openai`` whose OpenAI client carries the server's key."""
    real = data_module.openai

    class KeyedOpenAI(real.OpenAI):  # type: ignore[misc,name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["api_key"] = api_key
            super().__init__(*args, **kwargs)

    data_module.openai = types.SimpleNamespace(OpenAI=KeyedOpenAI)
    try:
        yield
    finally:
        data_module.openai = real


class CheckedArrowDataset(data.ArrowDataset):
    """speculators' ArrowDataset with our key, checks, policy and counts (see the module's docstring). At module
    level: a spawned DataLoader worker unpickles the dataset by importing this class by name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if "messages" in self.data.column_names:
            # prepare_data stores each conversation as JSON text for the workflow's own readers; speculators would
            # take a messages column for multimodal turns and re-render it. Text-only: input_ids alone are sent
            # (the Completions API), exactly the tokens the trainer trains on.
            self.data = self.data.remove_columns(["messages"])
        self.online = OnlineSpec.from_env(os.environ[ONLINE_SPEC_ENV])
        self._counter: _Counter | None = None
        guard = self.generation_recovery
        self.generation_recovery = _LockedRecoveryGuard(guard.retries, guard.max_consecutive_failures)

    def __getitems__(self, indices: Sequence[int]) -> list:
        """The batch's samples, up to ``requests_in_flight`` generated at once, in the order asked (PyTorch's
        fetcher calls this with the batch sampler's batch; see the module's docstring). An exception of one sample
        (OnlineSampleFailure past the limit) ends the batch once the samples already running have finished."""
        indices = list(indices)
        workers = min(self.online.requests_in_flight, len(indices))
        if workers <= 1:
            return [self[index] for index in indices]
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="online-sample")
        try:
            return list(pool.map(self.__getitem__, indices))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _setup_client(self) -> None:
        quiet_http_logs()  # in each DataLoader worker (a spawned process configures its logging anew)
        with _CLIENT_LOCK:
            if self.client is not None:  # another of the batch's threads set it up while this one waited
                return
            with _keyed_openai(data, os.environ.get(API_KEY_ENV, "EMPTY")):
                super()._setup_client()

    def _generate_hidden_states_once(self, dataset_item: dict, client_item: Any) -> dict:
        sample = super()._generate_hidden_states_once(dataset_item, client_item)
        expected = dataset_item["input_ids"].tolist()
        spec = self.online
        problem = check_sample(sample, expected, spec.layer_count, spec.hidden_size, spec.dtype)
        if problem is not None:
            raise ValueError(f"the generated sample failed the workflow's check: {problem}")
        with _STATE_LOCK:  # one counter per process and split, whichever of the batch's threads comes first
            if self._counter is None:
                self._counter = _Counter(Path(spec.counts_dir), self.start_file_idx)
            self._counter.add(len(expected))
        return sample

    def _get_raw_data(self, index: int) -> Any:
        result = super()._get_raw_data(index)
        if isinstance(result, SampleUnavailable) and result.counts_as_failure:
            with _STATE_LOCK:
                record_failure(self.online, self._map_to_file_idx(index), result.reason)
        return result

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_counter"] = None  # each worker counts in its own file
        return state


def quiet_http_logs() -> None:
    """The OpenAI client logs every request at INFO (three lines per sample in the trainer's log): warnings only."""
    for name in ("httpx", "httpcore", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)


def apply_online_patches() -> None:
    """Make speculators build CheckedArrowDataset (its loaders look the class up in their module at call time)."""
    import speculators.train.dataloader as dataloader

    if not hasattr(dataloader, "ArrowDataset"):
        raise RuntimeError(
            "speculators.train.dataloader has no ArrowDataset: the installed speculators differs from 0.9.0; "
            "update eagle3_workflow/trainer/online_samples.py"
        )
    guarded = ("_record_exhausted", "_record_success", "retries", "max_consecutive_failures")
    probe = GenerationRecoveryGuard(retries=0, max_consecutive_failures=1)
    missing = [name for name in guarded if not hasattr(probe, name)]
    missing += [] if "generation_recovery" in inspect.getsource(data.ArrowDataset.__init__) else ["generation_recovery"]
    if missing:
        raise RuntimeError(
            f"speculators' GenerationRecoveryGuard / ArrowDataset lack {missing}, which the workflow's concurrent "
            "fetch (train.online.requests_in_flight) guards with a lock: the installed speculators differs from "
            "0.9.0; update eagle3_workflow/trainer/online_samples.py"
        )
    dataloader.ArrowDataset = CheckedArrowDataset
    quiet_http_logs()
