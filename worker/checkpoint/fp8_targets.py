"""Reading 16/32-bit checkpoint weights into FP8 ones, and which checkpoint tensors that takes (pure planning).

A model that holds FP8 weights (tidal.worker.layers.fp8_weights) serves each such projection as two tensors: the
e4m3 `<name>.weight` and its fp32 `<name>.weight_scale`, one per output channel. A checkpoint may give them two ways:
- the weight in a float dtype, no scale: the reader quantizes each row as it arrives (`QuantizeInto`), on the
  destination's device, so a bf16 checkpoint never needs a bf16 copy of the model beside the FP8 one;
- the weight in e4m3 with its scale (what this worker's own served tensors are, e.g. a checkpoint written from
  them): both read as they are.
`plan_reads` (or its two halves) turns the model's expected tensors and destinations into the ones a given
checkpoint needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from tidal.kernels.fp8_linear import quantize_rows_into_
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.worker.checkpoint.header import StoredTensor, dtype_name
from tidal.worker.checkpoint.judge import Expected

SCALE_SUFFIX = "_scale"  # <name>.weight -> <name>.weight_scale
# The stored float dtypes a quantizing read accepts.
QUANTIZABLE_DTYPES = frozenset({"float16", "bfloat16", "float32"})


@dataclass(frozen=True)
class QuantizeInto:
    """A destination that takes a float tensor [N, K] and keeps it as e4m3 rows with one scale each."""

    weight: torch.Tensor  # [N, K] e4m3: a view of the served (or host) weight
    scale: torch.Tensor  # [N] fp32

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def row_length(self) -> int:
        return int(self.weight.shape[1])

    def write_rows(self, begin: int, rows: torch.Tensor) -> None:
        """Quantize `rows` [R, K] (any float dtype, any device) into rows [begin, begin + R)."""
        end = begin + rows.shape[0]
        quantize_rows_into_(rows, self.weight[begin:end], self.scale[begin:end])


Destination = torch.Tensor | QuantizeInto


class HasDtype(Protocol):
    @property
    def dtype(self) -> torch.dtype: ...


def fp8_weight_scales(served: Mapping[str, HasDtype]) -> dict[str, str]:
    """Served e4m3 weight name -> its scale's name (`served`: the live tensors, or their slots' descriptions)."""
    return {
        name: name + SCALE_SUFFIX
        for name, t in served.items()
        if t.dtype == FP8_E4M3 and name.endswith(".weight") and name + SCALE_SUFFIX in served
    }


def stored_dtypes(stored: Mapping[str, StoredTensor]) -> dict[str, str]:
    """name -> dtype name of a checkpoint's tensors (what the planning below looks at)."""
    return {name: t.dtype_name for name, t in stored.items()}


def _quantized_on_read(scales: Mapping[str, str], dtypes: Mapping[str, str]) -> dict[str, str]:
    """The pairs of `scales` whose weight the candidate (`dtypes`: name -> dtype name) does not give in e4m3 (a
    given e4m3 weight and its scale are taken as they are)."""
    return {weight: scale for weight, scale in scales.items() if dtypes.get(weight) != dtype_name(FP8_E4M3)}


def plan_expected(
    expected: Mapping[str, Expected], scales: Mapping[str, str], dtypes: Mapping[str, str]
) -> dict[str, Expected]:
    """What a candidate (a checkpoint, a broadcast; `dtypes`: its name -> dtype name) must hold: for each FP8
    weight it gives in another dtype, a float dtype is accepted and the scale is not expected (a given one is then
    an extra)."""
    out = dict(expected)
    for weight, scale in _quantized_on_read(scales, dtypes).items():
        out[weight] = Expected(expected[weight].shape, QUANTIZABLE_DTYPES)
        out.pop(scale, None)
    return out


def plan_destinations(
    destinations: Mapping[str, torch.Tensor], scales: Mapping[str, str], dtypes: Mapping[str, str]
) -> dict[str, Destination]:
    """Where each tensor of a candidate (`dtypes` as for plan_expected) goes: an FP8 weight it gives in a float
    dtype into a `QuantizeInto` of the weight's and the scale's destinations; everything else into its own."""
    out: dict[str, Destination] = dict(destinations)
    for weight, scale in _quantized_on_read(scales, dtypes).items():
        out[weight] = QuantizeInto(destinations[weight], destinations[scale])
        out.pop(scale, None)
    return out


def plan_reads(
    expected: Mapping[str, Expected], served: Mapping[str, torch.Tensor], stored: Mapping[str, StoredTensor]
) -> tuple[dict[str, Expected], dict[str, Destination]]:
    """`plan_expected` and `plan_destinations` for a model's served tensors."""
    scales, dtypes = fp8_weight_scales(served), stored_dtypes(stored)
    return plan_expected(expected, scales, dtypes), plan_destinations(served, scales, dtypes)
