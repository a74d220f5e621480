"""The machine: versions for the report, and the H200 figures (copy bandwidth, bf16 peak) a step's bound uses."""

from __future__ import annotations

import datetime
import platform
import statistics

import torch
import transformers

# The issue's measurement on this H200 (device copy, bytes read + written); the targets are judged against it.
ISSUE_COPY_TBS = 4.3
# The H200's dense bf16 tensor-core peak from its spec sheet (no sparsity): the compute side of a step's bound.
H200_BF16_DENSE_TFLOPS = 989.0
# Its dense FP8 (e4m3) peak, twice that: the compute side for projections held in FP8, which run as FP8 GEMMs.
H200_FP8_DENSE_TFLOPS = 1979.0


def environment(device: torch.device) -> dict[str, str | None]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # a CPU-only install may lack it; the CPU path does not use it
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "python": platform.python_version(),
    }


def _median_ms(fn, device: torch.device, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _device_copy_tbs(device: torch.device) -> float:
    src = torch.empty(2**30, dtype=torch.bfloat16, device=device)  # [2^30] = 2 GiB
    dst = torch.empty_like(src)
    return 2 * 2**31 / (_median_ms(lambda: dst.copy_(src), device) * 1e-3) / 1e12


def _pinned_h2d_gbs(device: torch.device) -> float:
    host = torch.empty(2**29, dtype=torch.bfloat16, pin_memory=True)  # 1 GiB
    target = torch.empty(host.shape, dtype=host.dtype, device=device)
    return 2**30 / (_median_ms(lambda: target.copy_(host, non_blocking=True), device) * 1e-3) / 1e9


def measure_bandwidths(device: torch.device) -> dict[str, float]:
    """Device copy of 2 GiB (read + write counted, as the issue does) and a pinned 1 GiB host-to-device copy."""
    with torch.cuda.device(device):
        figures = {"device_copy_tbs": _device_copy_tbs(device), "pinned_h2d_gbs": _pinned_h2d_gbs(device)}
        torch.cuda.empty_cache()  # the buffers are gone: give their memory back before the KV cache is sized
    return figures


def memory_gib(device: torch.device) -> dict[str, float]:
    free, total = torch.cuda.mem_get_info(device)
    return {"free_gib": free / 2**30, "total_gib": total / 2**30}
