"""Whether new weights hold NaN or +/-Inf: such a checkpoint (a diverged training run) is refused, not served.

One pass over values already in memory: `torch.aminmax` (no temporary tensor; NaN propagates into both, an Inf shows
as the minimum or the maximum) says whether a tensor is finite: ~0.035 s per GiB of bfloat16 on a busy 2-core CPU,
where `torch.isfinite(t).all()` took 4 s (and a bool tensor half the size of a bfloat16 one). Only a tensor that is
not finite is counted exactly, in slices, for the message.
"""

from __future__ import annotations

import torch

from tidal.worker.checkpoint.errors import CheckpointError
from tidal.worker.checkpoint.header import dtype_name

_SLICE_ELEMENTS = 16 * 2**20  # an exact count's (or a float8 tensor's) temporaries: a slice at a time
# The float8 dtypes, which aminmax and isfinite do not all take: looked at through float32, a slice at a time.
_FLOAT8 = frozenset(
    d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")) if d is not None
)


class NonFiniteValuesError(CheckpointError):
    """The checkpoint is readable and fits the model, but some of its tensors hold NaN or Inf values."""


class FiniteCheck:
    """The values of the tensors read for one checkpoint, checked as they arrive (`add`), reported at the end.

    A CPU tensor is judged at once (its memory may be reused right after, a staging buffer's); a device tensor's
    check is queued on its stream and judged by `problems`, after the caller has waited for its copies."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}  # name -> non-finite values found so far (0: checked, all finite)
        self._notes: dict[str, str] = {}
        self._deferred: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, values, their min and max)

    def add(self, name: str, values: torch.Tensor, converted_from: torch.dtype | None = None) -> None:
        """Check `values` (all or part of tensor `name`). `converted_from`: the stored dtype, when `values` were
        converted from it, so that a value past the new dtype's range (turned into Inf) is explained."""
        if not values.is_floating_point() or values.numel() == 0:
            return
        self._counts.setdefault(name, 0)
        if converted_from is not None and _narrower(values.dtype, converted_from):
            self._notes[name] = f", or beyond {dtype_name(values.dtype)}'s range"
        extremes = _extremes(values)
        if values.device.type == "cpu":
            self._judge(name, values, extremes)
        else:
            self._deferred.append((name, values, extremes))

    def problems(self) -> list[str]:
        """One line per tensor that holds non-finite values, e.g. "w: 12 non-finite values (NaN or Inf)"."""
        for name, values, extremes in self._deferred:
            self._judge(name, values, extremes)
        self._deferred.clear()
        return [
            f"{name}: {n} non-finite value{'' if n == 1 else 's'} (NaN or Inf{self._notes.get(name, '')})"
            for name, n in self._counts.items()
            if n
        ]

    def raise_if_any(self) -> None:
        problems = self.problems()
        if problems:
            raise NonFiniteValuesError(problems)

    def _judge(self, name: str, values: torch.Tensor, extremes: torch.Tensor) -> None:
        if not bool(torch.isfinite(extremes).all()):
            self._counts[name] += count_non_finite(values)


def count_non_finite(values: torch.Tensor) -> int:
    """How many of `values` are NaN or +/-Inf, counted a slice at a time (a bool mask of a whole multi-GiB tensor
    would cost as much memory again)."""
    if not values.is_floating_point():
        return 0
    flat = values.reshape(-1)
    count = 0
    for begin in range(0, flat.numel(), _SLICE_ELEMENTS):
        part = _comparable(flat[begin : begin + _SLICE_ELEMENTS])
        count += part.numel() - int(torch.isfinite(part).sum())
    return count


def _extremes(values: torch.Tensor) -> torch.Tensor:
    """[min, max] of `values` (more pairs for a float8 tensor, one per slice), on its device, without waiting."""
    if values.dtype not in _FLOAT8:
        low, high = torch.aminmax(values)
        return torch.stack([low, high])
    flat = values.reshape(-1)
    return torch.cat(
        [
            torch.stack(torch.aminmax(_comparable(flat[begin : begin + _SLICE_ELEMENTS])))
            for begin in range(0, flat.numel(), _SLICE_ELEMENTS)
        ]
    )


def _comparable(values: torch.Tensor) -> torch.Tensor:
    return values.float() if values.dtype in _FLOAT8 else values


def _narrower(dtype: torch.dtype, source: torch.dtype) -> bool:
    """Whether converting `source` to `dtype` can plausibly overflow (float16 from 32 or 16-bit brain floats, not
    bfloat16 from float32, whose largest values differ by under 1%)."""
    return source.is_floating_point and torch.finfo(dtype).max * 2 < torch.finfo(source).max
