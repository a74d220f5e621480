"""Timing shared by both sides: steady-state decode from per-token timestamps, and figures as plain data."""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class DecodeRun:
    """One decode measurement: `batch` rows generated `new_tokens` each; the last `timed_steps` steps timed."""

    batch: int
    prompt_len: int
    new_tokens: int
    timed_steps: int
    ms_per_step: float
    outputs: list[list[int]] = field(repr=False)  # [batch][new_tokens] generated ids, for the agreement check
    forward_ms: float | None = None  # the model's forward alone (engine only): step time minus host work

    @property
    def tokens_per_s(self) -> float:
        return self.batch * 1000.0 / self.ms_per_step

    def figures(self) -> dict[str, float | int | None]:
        return {
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "new_tokens": self.new_tokens,
            "timed_steps": self.timed_steps,
            "ms_per_step": self.ms_per_step,
            "tokens_per_s": self.tokens_per_s,
            "forward_ms": self.forward_ms,
        }


@dataclass
class OfflineRun:
    """`requests` prompts of `input_len` tokens, each generating `output_len`, all submitted at once."""

    requests: int
    input_len: int
    output_len: int
    seconds: float
    output_tokens: int
    decode_forward_ms: float | None = None  # engine only: the forward of one full-batch decode step

    def figures(self) -> dict[str, float | int | None]:
        return {
            "decode_forward_ms": self.decode_forward_ms,
            "requests": self.requests,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "seconds": self.seconds,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": self.output_tokens / self.seconds,
            "total_tokens_per_s": (self.output_tokens + self.requests * self.input_len) / self.seconds,
        }


def steady_ms_per_step(marks: list[float], warmup: int) -> float:
    """marks[k] = when every row had k + 1 tokens -> mean ms per step after the first `warmup` tokens."""
    if len(marks) <= warmup:
        raise ValueError(f"{len(marks)} token timestamps leave nothing to time after {warmup} warm-up tokens")
    return (marks[-1] - marks[warmup - 1]) * 1000.0 / (len(marks) - warmup)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """perf_counter after the device finished what was queued (so a wall-clock interval is device time too)."""
    sync(device)
    return time.perf_counter()


def median(values: list[float]) -> float:
    return statistics.median(values)


def kernel_times(run: Callable[[], object], calls: int) -> dict[str, list[float]]:
    """Each CUDA kernel's (and copy's) device times in us over `calls` calls of `run`, by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile  # only where there is a device to profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name].append(event.device_time)
    return per_name


def kernel_busy_ms(run: Callable[[], object], device: torch.device, calls: int = 3) -> float | None:
    """ms the device spends in kernels and copies per call of `run`, or None off CUDA. Set against a wall-clock
    figure it tells device-bound from host-bound: an eager prefill whose host queues kernels slower than the GPU
    runs them shows busy well under wall."""
    if device.type != "cuda":
        return None
    sync(device)
    return sum(sum(times) for times in kernel_times(run, calls).values()) / 1e3 / calls
