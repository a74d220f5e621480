"""Placing tensors back to back in one flat region (pure arithmetic, no torch)."""

from __future__ import annotations

import itertools

# Every tensor starts on this boundary: enough for vectorised loads and for the kernels' alignment checks.
ALIGNMENT = 256


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def pack(sizes: list[int], alignment: int = ALIGNMENT) -> tuple[list[int], int]:
    """Byte sizes -> (offset of each, total bytes), each offset aligned."""
    offsets = []
    total = 0
    for size in sizes:
        total = align_up(total, alignment)
        offsets.append(total)
        total += size
    return offsets, align_up(total, alignment)


def check_tiling(spans: list[tuple[str, int, int]], covered: list[tuple[int, int]]) -> list[str]:
    """Named (name, offset, nbytes) spans must not overlap and must cover every (offset, nbytes) of `covered`
    exactly. -> problems (empty when they tile)."""
    problems = []
    ordered = sorted(spans, key=lambda s: s[1])
    for (a, a_off, a_len), (b, b_off, _) in itertools.pairwise(ordered):
        if a_off + a_len > b_off:
            problems.append(f"{a} and {b} overlap")
    named_bytes = sum(n for _, _, n in spans)
    covered_bytes = sum(n for _, n in covered)
    if named_bytes != covered_bytes:
        problems.append(f"named tensors cover {named_bytes} bytes of {covered_bytes}")
    return problems
