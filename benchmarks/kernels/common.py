"""Shared pieces of the kernel benchmarks: timing, the device's measured ceilings, and result rows."""

import json
from dataclasses import asdict, dataclass, field

import torch
import triton
import triton.testing

# The ceilings for an H200 (measured there earlier); the run also measures its own and reports both.
COPY_CEILING_TBS = 4.3
MATMUL_CEILING_TFLOPS = 790.0


@dataclass
class Row:
    kernel: str
    shape: str
    impl: str
    ms: float
    metric: str  # "TB/s" or "TFLOP/s"
    value: float
    fraction: float  # of the ceiling
    target: float | None = None  # required fraction, where the issue sets one
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        return "PASS" if self.fraction >= self.target else f"MISS ({self.fraction / self.target:.0%} of target)"


def gpu_tag() -> str:
    """A short name of this GPU for result files: "h200", "h100", else the device name in lower case with dashes."""
    name = torch.cuda.get_device_name().lower()
    known = next((tag for tag in ("h200", "h100") if tag in name), None)
    return known or "-".join(name.replace("nvidia", "").split())


def bench_ms(fn, rep_ms: int = 60) -> float:
    """Median time of fn in milliseconds, CUDA events, L2 flushed between runs (triton.testing.do_bench)."""
    return triton.testing.do_bench(fn, warmup=15, rep=rep_ms, return_mode="median")


def graph_ms(fn, rep_ms: int = 60) -> float:
    """Median time of replaying fn captured in a CUDA graph: the launch gaps of several small kernels disappear, as
    in the engine's captured decode step. fn must have run once before (Triton compiles outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay, rep_ms)


def bandwidth_row(kernel, shape, impl, ms, num_bytes, target=None, note="", **extra) -> Row:
    tbs = num_bytes / (ms * 1e-3) / 1e12
    return Row(kernel, shape, impl, ms, "TB/s", tbs, tbs / COPY_CEILING_TBS, target, note, extra)


def compute_row(kernel, shape, impl, ms, flops, target=None, note="", **extra) -> Row:
    tflops = flops / (ms * 1e-3) / 1e12
    return Row(kernel, shape, impl, ms, "TFLOP/s", tflops, tflops / MATMUL_CEILING_TFLOPS, target, note, extra)


def measure_ceilings() -> list[Row]:
    """A 2 GiB device copy (bytes read + written) and an 8192^3 bf16 matmul on random data."""
    src = torch.randn(2**29, device="cuda")  # 2 GiB fp32
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    rows = [bandwidth_row("ceiling: device copy", "2 GiB", "torch copy_", ms, 2 * src.numel() * 4)]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    rows.append(compute_row("ceiling: bf16 matmul", "8192^3", "torch matmul", ms, 2 * 8192**3))
    return rows


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp64; NaN shows as nan."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def format_table(rows: list[Row]) -> str:
    lines = [
        "| kernel | shape | impl | ms | achieved | of ceiling | target | verdict | note |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        target = f"{r.target:.0%}" if r.target is not None else ""
        lines.append(
            f"| {r.kernel} | {r.shape} | {r.impl} | {r.ms:.4f} | {r.value:.1f} {r.metric} | {r.fraction:.1%} "
            f"| {target} | {r.verdict} | {r.note} |"
        )
    return "\n".join(lines)


def to_json(rows: list[Row], environment: dict) -> str:
    return json.dumps(
        {"environment": environment, "results": [asdict(r) | {"verdict": r.verdict} for r in rows]}, indent=1
    )
