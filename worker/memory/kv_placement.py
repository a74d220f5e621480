"""Where each layer's K and V tensors sit in the KV cache's region, and in what order its memory is mapped on a wake
(pure arithmetic, no torch).

Creating physical device memory costs ~1.7 ms per GiB on an H200 and does not overlap the weights' host-to-device
copy (benchmarks/results/lifecycle-wake-breakdown-h200.txt): a 111 GiB cache would add ~0.2 s to every wake. So a
wake maps a *first share* of every K/V tensor (its first `first_blocks` blocks), serving resumes on those blocks, and
the rest of each tensor is mapped afterwards and handed to the block manager when it is all there.

Every tensor ("plane") starts on a boundary of the mapping granularity, so a plane's leading blocks can be mapped
on their own; at most one granule per plane is mapped beyond the blocks it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.worker.memory.layout import align_up


@dataclass(frozen=True)
class Piece:
    offset: int  # bytes from the region's start; a multiple of the granularity
    size: int  # bytes; a multiple of the granularity


@dataclass(frozen=True)
class KVPlacement:
    plane_offsets: list[int]  # bytes from the region's start of each plane: layer i's K is 2i, its V 2i + 1
    plane_bytes: int  # bytes each plane's blocks take
    total: int  # the region's size
    first: list[Piece]  # mapped before serving resumes
    rest: list[Piece]  # mapped after, while serving
    first_blocks: int  # blocks (the lowest ids) that lie wholly in `first` in every plane


def place_kv(
    num_planes: int, num_blocks: int, block_bytes: int, granularity: int, first_share_bytes: int
) -> KVPlacement:
    """Planes of `num_blocks` blocks of `block_bytes` each; the first share of each plane is at least
    `first_share_bytes` (whole granules, at least one block), the whole plane if that is smaller."""
    if min(num_planes, num_blocks, block_bytes, granularity) < 1:
        raise ValueError(
            f"need positive sizes, got {num_planes} planes, {num_blocks} blocks of {block_bytes} bytes, "
            f"granularity {granularity}"
        )
    plane_bytes = num_blocks * block_bytes
    stride = align_up(plane_bytes, granularity)
    offsets = [i * stride for i in range(num_planes)]
    first_size = min(align_up(max(first_share_bytes, block_bytes), granularity), stride)
    first_blocks = min(num_blocks, first_size // block_bytes)
    first = [Piece(offset, first_size) for offset in offsets]
    rest = [Piece(offset + first_size, stride - first_size) for offset in offsets if stride > first_size]
    return KVPlacement(offsets, plane_bytes, num_planes * stride, first, rest, first_blocks)


def packed_kv(num_planes: int, num_blocks: int, block_bytes: int) -> KVPlacement:
    """Planes back to back, all mapped at once (a region without piecewise mapping)."""
    plane_bytes = num_blocks * block_bytes
    stride = align_up(plane_bytes)
    offsets = [i * stride for i in range(num_planes)]
    total = num_planes * stride
    return KVPlacement(offsets, plane_bytes, total, [Piece(0, total)], [], num_blocks)
