"""A/B of weights-first small-batch projections and an earlier launch of the next kernel, through profile_steps.py.

    AB=early,o=32/4/8,router=32/8/4,qkv=8/4 python benchmarks/ab_weights_first.py --preset qwen3-30b-a3b \
        --weight-dtype fp8 --kv-cache-dtype fp8 --batches 1 2 --context 160

AB is a comma list (empty: the code as it is):
- `early`: the small-batch and small-batch MoE kernels let the next kernel launch right after their own wait on the
  previous one (as decode attention does) instead of after their K loop, so a weights-first kernel after them can be
  resident, and streaming its weights, while they run;
- `o=BN/SPLIT/WARPS`, `router=BN/SPLIT/WARPS`: weights-first entries (`LaunchConfig.weights_first`) for
  Qwen3-30B-A3B's o projection (2048 x 4096) and router (128 x 2048), in both weight dtypes' tables;
- `qkv=SPLIT/WARPS`: the decoder's fused qkv weights-first at that split of K (Qwen3-30B-A3B's 2048 inputs).

Each variant must run in a fresh process: the swaps happen before any kernel compiles. Choose tiles whose programs
fit in one wave (benchmarks/kernels/register_report.py gives their registers), or the second wave loads after the
first instead of during the previous kernel.
"""

import functools
import os
import runpy
import sys

import triton
import triton.language as tl

import tidal.kernels._moe_small_batch_kernels as moe_small_batch_kernels
import tidal.kernels._small_batch_kernels as small_batch_kernels
import tidal.kernels.small_batch_linear as small_batch_linear
import tidal.worker.models.decoder as decoder
from tidal.kernels._triton_utils import let_next_kernel_launch, wait_for_previous_kernel
from tidal.kernels.small_batch_linear import LaunchConfig

PROJECTIONS = {"o": (2048, 4096), "router": (128, 2048)}  # (outputs, inputs) of Qwen3-30B-A3B's
QKV_INPUTS = 2048


@triton.jit
def wait_then_let_next_launch(USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    let_next_kernel_launch(USE_PDL)


@triton.jit
def no_launch_signal(USE_PDL: tl.constexpr):
    pass


def apply(spec: list[str]) -> None:
    for item in spec:
        name, _, value = item.partition("=")
        if name == "early":
            for module in (small_batch_kernels, moe_small_batch_kernels):
                module.wait_for_previous_kernel = wait_then_let_next_launch  # type: ignore[assignment]
                module.let_next_kernel_launch = no_launch_signal  # type: ignore[assignment]
        elif name in PROJECTIONS:
            block_n, split, warps = (int(v) for v in value.split("/"))
            n_out, k_in = PROJECTIONS[name]
            config = LaunchConfig(block_n, triton.cdiv(k_in, split), warps, 1, split_k=split, weights_first=True)
            small_batch_linear.TUNED_LINEAR_CONFIGS[(n_out, k_in, False)] = config
            small_batch_linear.TUNED_FP8_LINEAR_CONFIGS[(n_out, k_in, False)] = config
        elif name == "qkv":
            split, warps = (int(v) for v in value.split("/"))
            decoder.qkv_rope_store_triton = functools.partial(  # type: ignore[assignment]
                decoder.qkv_rope_store_triton, split_k=split, block_k=triton.cdiv(QKV_INPUTS, split),
                num_warps=warps, num_stages=1, weights_first=True,
            )  # fmt: skip
        else:
            raise SystemExit(f"unknown AB item {item!r}")


def main() -> None:
    spec = [item for item in os.environ.get("AB", "").split(",") if item]
    apply(spec)
    print(f"A/B: {','.join(spec) or 'plain'}", flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.argv = ["profile_steps.py", *sys.argv[1:]]
    sys.path.insert(0, here)
    runpy.run_path(os.path.join(here, "profile_steps.py"), run_name="__main__")


if __name__ == "__main__":
    main()
