"""Device facts the kernel wrappers size their grids by, read once per device."""

import functools

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
