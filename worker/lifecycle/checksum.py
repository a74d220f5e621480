"""Weight checksums that agree across processes and ranks serving the same weights.

Each tensor's digest is SHA-256 over its dtype, its shape and its raw little-endian bytes in row-major (contiguous)
order, as served; the overall digest is SHA-256 over the sorted `name digest` lines. Nothing depends on where a
tensor lives or on how it was loaded, so a disk, a streamed and a collective update of the same weights agree.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from tidal.worker.checkpoint.header import dtype_name
from tidal.worker.checkpoint.host_bytes import byte_view

ALGORITHM = "sha256"
_PIECE_BYTES = 256 * 2**20  # device tensors are copied to the host this much at a time


def tensor_digest(tensor: torch.Tensor) -> str:
    digest = hashlib.sha256(f"{dtype_name(tensor.dtype)}{list(tensor.shape)}\n".encode())
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
    for start in range(0, flat.numel(), _PIECE_BYTES):
        piece = flat[start : start + _PIECE_BYTES]
        if piece.device.type != "cpu":
            piece = piece.cpu()
        digest.update(byte_view(piece))  # hashlib releases the GIL on large buffers
    return digest.hexdigest()


def overall_digest(digests: dict[str, str]) -> str:
    lines = "".join(f"{name} {digests[name]}\n" for name in sorted(digests))
    return hashlib.sha256(lines.encode()).hexdigest()


def weights_digests(tensors: dict[str, torch.Tensor], num_threads: int | None = None) -> dict[str, str]:
    """name -> digest, hashed on several threads (hashing, not copying, is the slow part)."""
    workers = num_threads or min(16, os.cpu_count() or 1)
    names = sorted(tensors, key=lambda n: -tensors[n].numel())  # largest first: the pool ends evenly
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tidal-checksum") as pool:
        digests = pool.map(lambda n: tensor_digest(tensors[n]), names)
        return dict(zip(names, digests, strict=True))
