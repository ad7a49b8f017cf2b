"""The prepared dataset on disk (prepare_data's ``prepared/``, written by ``prepare.write_prepared``), read in one place.

A HF dataset saved to disk with ``input_ids``, ``loss_mask``, ``seq_len`` (torch format, what speculators' trainer
reads), ``messages`` (the conversation as JSON) and ``origin`` (file:line). The workflow's own readers want plain
Python rows, so `open_prepared` returns the dataset without that format. ``datasets`` is imported only when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_workflow.settings.errors import StageError

if TYPE_CHECKING:
    import datasets


def open_prepared(prepared_dir: str | Path) -> datasets.Dataset:
    """prepare_data's dataset with plain Python rows (lists of ints, not tensors); StageError when it is missing."""
    import datasets

    if not Path(prepared_dir).is_dir():
        raise StageError(f"the prepared dataset {prepared_dir} does not exist; run prepare_data first")
    return datasets.load_from_disk(str(prepared_dir)).with_format(None)


def read_input_ids(prepared_dir: str | Path) -> list[list[int]]:
    """Every prepared row's token ids, in row order (the row is the hidden-state file's number)."""
    return [list(map(int, ids)) for ids in open_prepared(prepared_dir)["input_ids"]]
