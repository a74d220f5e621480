"""Device facts the kernel wrappers size their grids by, read once per device."""

import functools
import os

import torch

# Under the interpreter (CPU tensors) there is no device to ask; a small count still exercises the split paths.
CPU_MULTIPROCESSORS = 4


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_MULTIPROCESSORS
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


# TIDAL_PDL=0 turns programmatic dependent launch off (for A/B timing, or a driver that mishandles it).
_PDL_SWITCH = os.environ.get("TIDAL_PDL", "1") != "0"


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, (9, 0) on Hopper; PDL and the FP8 KV cache both depend on it."""
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def uses_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: Hopper or newer, compiled (the
    interpreter cannot run the grid-dependency instructions). A PDL kernel's programs may start while the previous
    kernel's last ones still run, which hides the launch gap between the many small kernels of a decode step."""
    if device.type != "cuda" or not _PDL_SWITCH or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return cuda_capability(device) >= (9, 0)


def pdl_launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a kernel launch: `USE_PDL` for the kernel and `launch_pdl` for Triton's launcher."""
    use = uses_pdl(device)
    return {"USE_PDL": use, "launch_pdl": use}
