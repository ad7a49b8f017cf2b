"""Hidden-state files: naming, reading, the layer-id convention, size estimates and per-file checks.

File layout (what vLLM's hidden-states connector writes and speculators' FileTransfer reads):
``hs_<row>.safetensors`` with ``hidden_states`` [T, L, H] (bf16) and ``token_ids`` int64 [T], where row is the
sample's index in the prepared dataset and L the number of captured layer ids.

Layer ids follow vLLM's convention: id k in 1..N-1 is the residual stream after decoder layer k-1 (= HF
``output_hidden_states[k]``); id N is the pre-norm output of the last layer (NOT HF ``hidden_states[-1]``,
which is post-norm). EAGLE-3 uses [2, N//2, N-3] as draft input plus N as the verifier's last state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BYTES_PER_ELEMENT = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
SAFETENSORS_OVERHEAD = 256  # header and alignment per file, generous


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default capture: [2, N//2, N-3] for the draft plus N for the verifier's last state."""
    return [2, num_layers // 2, num_layers - 3, num_layers]


def resolve_layer_ids(num_layers: int, configured: Sequence[int] | None) -> list[int]:
    """The configured ids, or EAGLE-3's default; raises ValueError naming the problem."""
    ids = list(configured) if configured else eagle3_layer_ids(num_layers)
    problems = []
    if len(ids) < 2:
        problems.append("need at least two ids (draft inputs plus the verifier's last state)")
    out_of_range = [i for i in ids if not 1 <= i <= num_layers]
    if out_of_range:
        problems.append(f"ids {out_of_range} are outside 1..{num_layers} (the target has {num_layers} layers)")
    if ids and ids[-1] != num_layers:
        problems.append(f"the last id must be {num_layers} (the verifier's final pre-norm state), got {ids[-1]}")
    if len(set(ids)) != len(ids):
        if configured:
            problems.append(f"ids {ids} contain duplicates; list each layer id once")
        else:
            problems.append(
                f"EAGLE-3's default ids {ids} collide on a {num_layers}-layer target; set "
                "hidden_states.layer_ids explicitly"
            )
    elif ids != sorted(ids):
        # vLLM stores captures sorted by id: any other order would silently permute the file's L axis
        problems.append(f"ids {ids} must be in increasing order")
    if problems:
        raise ValueError(f"hidden_states.layer_ids {ids}: " + "; ".join(problems))
    return ids


def hs_file(files_dir: str | Path, row: int) -> Path:
    return Path(files_dir) / f"hs_{row}.safetensors"


def read_hidden_states(files_dir: str | Path, row: int, positions: slice | None = None) -> torch.Tensor:
    """A sample's ``hidden_states`` [T, L, H], or only the token `positions` of it (read lazily: a slice of a long
    sample reads only those rows)."""
    from safetensors import safe_open

    with safe_open(str(hs_file(files_dir, row)), framework="pt", device="cpu") as handle:
        if positions is None:
            return handle.get_tensor("hidden_states")
        return handle.get_slice("hidden_states")[positions]


def read_sample(files_dir: str | Path, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample's (hidden_states [T, L, H], token_ids [T])."""
    from safetensors import safe_open

    with safe_open(str(hs_file(files_dir, row)), framework="pt", device="cpu") as handle:
        return handle.get_tensor("hidden_states"), handle.get_tensor("token_ids")


@dataclasses.dataclass(frozen=True)
class HiddenStateFiles:
    """A folder of hidden-state files of one shape, [T, layer_count, hidden_size]: what extraction writes, resumes and
    checks (and the canary and validation check) passed as one thing."""

    folder: Path
    layer_count: int
    hidden_size: int

    def path(self, row: int) -> Path:
        return hs_file(self.folder, row)

    def check(self, path: Path, expected_ids: list[int], *, full: bool) -> str | None:
        """check_file with this folder's shape: None when `path` is a valid sample of `expected_ids`."""
        return check_file(path, expected_ids, self.layer_count, self.hidden_size, full=full)

    def estimate_bytes(self, token_counts: list[int]) -> int:
        return estimate_bytes(token_counts, self.layer_count, self.hidden_size)


def shard_rows(num_rows: int, replicas: int, replica: int) -> list[int]:
    """Rows of one replica: disjoint, covering, balanced (row % replicas == replica)."""
    if not 0 <= replica < replicas:
        raise ValueError(f"replica {replica} is outside 0..{replicas - 1}")
    return list(range(replica, num_rows, replicas))


def estimate_bytes(token_counts: list[int], layer_count: int, hidden_size: int, element: str = "bfloat16") -> int:
    """Disk needed for these samples: tokens x layers x hidden x bytes, plus token ids and headers."""
    # element: the files' element type (vLLM's connector writes bf16 whatever target.dtype says)
    per_token = layer_count * hidden_size * BYTES_PER_ELEMENT[element] + 8
    return sum(token_counts) * per_token + SAFETENSORS_OVERHEAD * len(token_counts)


def human_bytes(n: float) -> str:
    if n <= 0:
        return "0 B"
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    k = min(int(math.log(n, 1024)), len(units) - 1)
    return f"{n / 1024**k:.2f} {units[k]}"


def check_file(path: Path, expected_ids: list[int], layer_count: int, hidden_size: int, *, full: bool) -> str | None:
    """None if the file is a valid sample, else the reason. `full` also reads the tensor (finite, non-constant).

    The quick form reads only the header and token ids, so resume scans are cheap; the full form is what
    validate_hidden_states runs on every file.
    """
    from safetensors import safe_open

    if not path.exists():
        return "missing"
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            keys = set(handle.keys())
            if keys != {"hidden_states", "token_ids"}:
                return f"keys {sorted(keys)} != ['hidden_states', 'token_ids']"
            hs_slice = handle.get_slice("hidden_states")
            shape = list(hs_slice.get_shape())
            dtype = hs_slice.get_dtype()
            token_ids = handle.get_tensor("token_ids")
            expected_shape = [len(expected_ids), layer_count, hidden_size]
            if shape != expected_shape:
                return f"hidden_states shape {shape} != expected {expected_shape} [T, L, H]"
            if dtype.upper() not in ("BF16", "F16", "F32", "F8_E4M3"):
                return f"hidden_states dtype {dtype} is not a float type"
            if token_ids.tolist() != list(expected_ids):
                return "token_ids differ from the prepared input_ids"
            if full:
                return values_problem(handle.get_tensor("hidden_states"))
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a bad sample; the reason is kept
        return f"unreadable: {exc!r}"
    return None


def values_problem(hidden: torch.Tensor) -> str | None:
    """None if a sample's hidden_states [T, L, H] are finite and not constant, else the reason."""
    import torch

    if not bool(torch.isfinite(hidden).all()):
        return "hidden_states contain NaN or Inf"
    flat = hidden.float().reshape(hidden.shape[0] * hidden.shape[1], -1)
    if hidden.shape[0] > 1 and float(flat.std()) == 0.0:
        return "hidden_states are constant (degenerate)"
    return None


def check_sample(
    sample: dict[str, torch.Tensor], expected_ids: Sequence[int], layer_count: int, hidden_size: int, dtype: str
) -> str | None:
    """None if a sample loaded in memory (the online trainer's, as it arrives) is what a valid file holds, else the
    reason: the keys, shape [T, L, H], `dtype` (the target's), the token ids and the values (check_file's checks)."""
    import torch

    if set(sample) != {"hidden_states", "token_ids"}:
        return f"keys {sorted(sample)} != ['hidden_states', 'token_ids']"
    hidden, token_ids = sample["hidden_states"], sample["token_ids"]
    expected_shape = [len(expected_ids), layer_count, hidden_size]
    if list(hidden.shape) != expected_shape:
        return f"hidden_states shape {list(hidden.shape)} != expected {expected_shape} [T, L, H]"
    if hidden.dtype != getattr(torch, dtype, None):
        return f"hidden_states dtype {hidden.dtype} != the target's {dtype}"
    if token_ids.tolist() != list(expected_ids):
        return "token_ids differ from the prepared input_ids"
    return values_problem(hidden)


def check_rows(lengths: Sequence[int], count: int) -> list[int]:
    """The rows online training checks on disk before it starts (train.online.check_samples): the longest, the
    shortest, and the rest evenly spaced over the dataset; sorted, at most `count`, every row when there are fewer."""
    rows = len(lengths)
    if count >= rows:
        return list(range(rows))
    longest = max(range(rows), key=lambda r: lengths[r])
    shortest = min(range(rows), key=lambda r: lengths[r])
    candidates = [longest, shortest, *(int(i * rows / count) for i in range(count))]
    chosen = list(dict.fromkeys(candidates))  # in order of preference, each once
    return sorted(chosen[:count])


def rows_on_disk(lengths: Sequence[int], online_check_samples: int | None) -> list[int]:
    """The prepared rows extraction writes and validation checks: every row offline (None), the check set online
    (train.online.check_samples: the trainer generates the rest itself)."""
    if online_check_samples is None:
        return list(range(len(lengths)))
    return check_rows(lengths, online_check_samples)
