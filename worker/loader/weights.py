"""Copying safetensors checkpoints into a model's live tensors, checking every name and shape first.

Checking before copying means a checkpoint that does not fit changes nothing, which is what an in-place
weight update needs too (`load_checkpoint_into` works on any name -> tensor map).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tidal.worker.loader.errors import CheckpointMismatchError, ModelLoadError, some_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    num_tensors: int
    num_bytes: int
    seconds: float


def _read_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Checkpoint name -> (file, shape), reading only the headers."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name in found:
                        raise CheckpointMismatchError(f"tensor {name!r} appears in both {found[name][0]} and {path}")
                    found[name] = (path, tuple(f.get_slice(name).get_shape()))
        except (OSError, RuntimeError) as err:  # safetensors raises these for unreadable/corrupt files
            raise ModelLoadError(f"cannot read safetensors file {path}: {err}") from err
    return found


def check_checkpoint(
    files: list[Path], targets: dict[str, torch.Tensor], is_ignored: Callable[[str], bool]
) -> dict[str, Path]:
    """Raise CheckpointMismatchError unless the files hold exactly `targets` (names and shapes). -> name -> file."""
    headers = _read_headers(files)
    unexpected = sorted(n for n in headers if n not in targets and not is_ignored(n))
    missing = sorted(n for n in targets if n not in headers)
    wrong_shape = [
        f"{n}: checkpoint {list(shape)} vs model {list(targets[n].shape)}"
        for n, (_, shape) in sorted(headers.items())
        if n in targets and shape != tuple(targets[n].shape)
    ]
    problems = []
    if unexpected:
        problems.append(f"unexpected tensors (not in this architecture): {some_of(unexpected)}")
    if missing:
        problems.append(f"missing tensors: {some_of(missing)}")
    if wrong_shape:
        problems.append(f"wrong shapes: {some_of(wrong_shape)}")
    if problems:
        raise CheckpointMismatchError("checkpoint does not fit the model: " + "; ".join(problems))
    return {n: path for n, (path, _) in headers.items() if n in targets}


def load_checkpoint_into(
    files: list[Path], targets: dict[str, torch.Tensor], is_ignored: Callable[[str], bool]
) -> LoadReport:
    """Check, then copy each checkpoint tensor into its target in place (converting the dtype)."""
    start = time.monotonic()
    where = check_checkpoint(files, targets, is_ignored)
    num_tensors = num_bytes = 0
    for path in files:
        names = [n for n, p in where.items() if p == path]
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                tensor = f.get_tensor(name)
                targets[name].copy_(tensor)
                num_tensors += 1
                num_bytes += tensor.numel() * tensor.element_size()
        log.info(
            "loaded %s: %d/%d tensors, %.1f MiB so far, %.2fs",
            path.name,
            num_tensors,
            len(targets),
            num_bytes / 2**20,
            time.monotonic() - start,
        )
    return LoadReport(num_tensors, num_bytes, time.monotonic() - start)
