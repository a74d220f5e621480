"""Filling a freshly built model from its checkpoint (tidal.worker.checkpoint), with start-up's errors.

Every name, shape and dtype is checked before the first tensor is copied. The model may be built in another float
dtype than the checkpoint stores (`--dtype`): the reader converts, and quantizes into FP8 weights
(tidal.worker.checkpoint.fp8_targets).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from tidal.worker.checkpoint.directory import stored_tensors
from tidal.worker.checkpoint.errors import CheckpointError, CheckpointFilesMissingError, CheckpointUnfitError
from tidal.worker.checkpoint.fp8_targets import plan_reads
from tidal.worker.checkpoint.header import StoredTensor, dtype_name
from tidal.worker.checkpoint.judge import Expected, tensors_to_read
from tidal.worker.checkpoint.reader import CONVERTIBLE_DTYPES, LoadReport, read_tensors
from tidal.worker.checkpoint.values import NonFiniteValuesError
from tidal.worker.loader.errors import CheckpointMismatchError, MissingModelFileError, ModelLoadError
from tidal.worker.models.base import CausalLM


def find_checkpoint(model_path: Path) -> dict[str, StoredTensor]:
    """The tensors the model directory's checkpoint holds, each header checked."""
    with _as_load_error(model_path):
        return stored_tensors(model_path)


def load_weights(model_path: Path, stored: dict[str, StoredTensor], model: CausalLM) -> LoadReport:
    """Check `stored` against the model's checkpoint tensors, then copy each into its live tensor."""
    targets = model.checkpoint_weights()
    expected = {
        name: Expected(tuple(t.shape), CONVERTIBLE_DTYPES | {dtype_name(t.dtype)}) for name, t in targets.items()
    }
    expected, destinations = plan_reads(expected, targets, stored)  # FP8 weights from a 16-bit checkpoint
    with _as_load_error(model_path):
        tensors = tensors_to_read(stored, expected, allow_extra=False, is_ignored=model.ignored_checkpoint_tensor)
        with torch.no_grad():
            return read_tensors(tensors, destinations)


@contextlib.contextmanager
def _as_load_error(model_path: Path) -> Iterator[None]:
    try:
        yield
    except CheckpointFilesMissingError as err:
        raise MissingModelFileError("; ".join(err.problems)) from err
    except CheckpointUnfitError as err:
        raise CheckpointMismatchError("checkpoint does not fit the model: " + "; ".join(err.problems)) from err
    except NonFiniteValuesError as err:  # a diverged training run's weights: serving them would give garbage
        raise ModelLoadError(f"the checkpoint in {model_path} holds NaN or Inf: " + "; ".join(err.problems)) from err
    except CheckpointError as err:
        raise ModelLoadError(f"cannot read the checkpoint in {model_path}: " + "; ".join(err.problems)) from err
