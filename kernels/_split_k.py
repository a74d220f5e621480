"""Arrival counters of the split-K kernels that reduce in the kernel itself (one owner per device).

A split-K program writes its fp32 partial tile to a workspace and counts itself in on its output tile's counter; the
program that arrives last adds the partials in split order (so the result does not depend on which one was last),
runs the epilogue, and sets the counter back to zero for the next launch. No second launch, no atomics on the
output, the same bits every run. Users: the small-batch projections (`linear_rows` with split_k, one counter per
output tile), the small-batch qkv on whole heads (`small_batch_qkv`, one per tile), the small-batch MoE down pass
(one per token and H-tile) and the decode attention's split merge (one per sequence and KV head).

Sharing one buffer is safe because launches on the step's one stream do not overlap in what they touch: under
programmatic dependent launch a kernel may start before the previous one ends, so every kernel that uses the
counters must call `wait_for_previous_kernel` before its first counter or workspace access (all of them do it first).

The counters are zeroed once, eagerly: a CUDA graph replays kernels, not the zeroing, so they must exist before the
first capture (the graph runner warms every batch size up outside its graphs, which makes them).
"""

import torch

# Output tiles a split-K launch may have: the small-batch projections have a few hundred, the MoE down pass one per
# (token, H-tile), up to 16 x 1024.
MAX_TILES = 16384

_counters: dict[tuple[str, int | None], torch.Tensor] = {}


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """[>= tiles] int32 zeros on `device`, shared by every split-K launch there: kernels on one stream run one after
    another and each leaves the counters at zero."""
    if tiles > MAX_TILES:
        raise ValueError(f"a split-K launch may have at most {MAX_TILES} output tiles, got {tiles}")
    if device.type == "cuda":
        key = ("cuda", device.index if device.index is not None else torch.cuda.current_device())
    else:
        key = (device.type, device.index)
    counters = _counters.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K arrival counters are made eagerly: run the kernel once before a graph capture")
        counters = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # zero before any stream uses them
        _counters[key] = counters
    return counters


def split_buffers(
    stand_in: torch.Tensor, tiles: int, splits: int, partial_elements: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (fp32 workspace for every split's partial of every tile [tiles * splits * partial_elements], the arrival
    counters) on `stand_in`'s device. With one split neither is read and both are `stand_in` (a tensor the launch
    has anyway: a null pointer is refused by Triton's launcher)."""
    if splits == 1:
        return stand_in, stand_in
    workspace = torch.empty(tiles * splits * partial_elements, dtype=torch.float32, device=stand_in.device)
    return workspace, arrival_counters(stand_in.device, tiles)
