"""The memory in use on each GPU as the driver counts it (nvidia-smi), for the group benchmarks, whose ranks have a
GPU each (CUDA_VISIBLE_DEVICES), as pods do.

The driver's count is the one that matters when a rank's group is re-formed: it includes what torch's allocator
does not see (the CUDA context, NCCL's communicator buffers, memory mapped through the CUDA virtual-memory API), so
a communicator of an old epoch left alive shows up here as growth across a recovery. It is read per GPU rather than
per process because inside a container the driver often cannot name the processes.
"""

from __future__ import annotations

import shutil
import subprocess

MIB = 2**20


def gpu_memory_used(timeout_s: float = 10.0) -> dict[str, int] | None:
    """GPU index (as CUDA_VISIBLE_DEVICES names it) -> bytes in use, or None where nvidia-smi is missing or fails."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    query = [tool, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    try:
        listing = subprocess.run(query, capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_memory_used(listing)


def parse_memory_used(listing: str) -> dict[str, int]:
    """nvidia-smi's `index, used MiB` lines -> bytes by GPU index; a line the driver could not fill ("[N/A]") is
    left out."""
    used = {}
    for line in listing.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            used[fields[0]] = int(fields[1]) * MIB
    return used


def rank_memory(visible_devices: tuple[str, ...] | None, ranks: list[int]) -> dict[int, int] | None:
    """Bytes in use on each rank's GPU (rank r has visible_devices[r % len], as WorkerLaunch gives them; ranks that
    share a GPU each show its total), or None without GPUs or nvidia-smi."""
    if not visible_devices:
        return None
    used = gpu_memory_used()
    if used is None:
        return None
    return {rank: used.get(visible_devices[rank % len(visible_devices)], 0) for rank in ranks}
