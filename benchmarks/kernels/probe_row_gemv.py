"""Probe: a one-row projection as a row-parallel GEMV of many small programs, against the engine's `linear_rows`.

step_floor.py showed that a batch-1 decode step's chain of launches can stream its bytes in about half the time the
engine's kernels take, if every launch keeps enough programs resident (its `chain, PDL` rows at 2-8 programs a
multiprocessor against 1). The engine's batch-1 projections run few, large programs: Qwen3-30B-A3B's o projection
128 (64 outputs by a quarter of K each, the split's partials added by the last), its whole-head qkv 80. This probe
asks whether the other shape of the same work wins: each program owns a few whole weight rows (no split of K, so no
partials and no arrival count), streams them in long contiguous runs, and there are thousands of programs.

Each timed graph runs the projection over 48 distinct weight sets (more bytes than the L2 holds), as a decode step
runs it over the model's layers, with PDL between launches as the engine launches them. Only the products and the
per-row FP8 scale are computed: no epilogue (norm, residual, rotary), on either side.

    cd benchmarks/kernels && python probe_row_gemv.py [--shapes o qkv router] [--layers 48]

On a CPU (`TRITON_INTERPRET=1 ... --smoke`) it checks one small variant against torch and times nothing.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from common import graph_ms

from tidal.kernels._device import pdl_launch_options
from tidal.kernels._triton_utils import let_next_kernel_launch, wait_for_previous_kernel
from tidal.kernels.fp8_linear import quantize_rows
from tidal.kernels.small_batch_linear import choose_config, linear_rows_triton

# (outputs, inputs, e4m3 weights) of Qwen3-30B-A3B's batch-1 projections: o, the fused qkv (32 + 2 x 4 heads of
# 128), the router (kept 16-bit by the engine).
SHAPES = {"o": (2048, 4096, True), "qkv": (5120, 2048, True), "router": (128, 2048, False)}
# (rows a program, inputs a load, warps, load stages): fp32 products of a step stay in registers, so rows x inputs
# stays within 64 a thread; and at least 2 KB of e4m3 a load.
VARIANTS = [
    (rows, block_k, warps, stages)
    for rows, block_k, warps, stages in itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8), (1, 3))
    if 2048 <= rows * block_k <= 64 * 32 * warps
]


@triton.jit
def row_gemv_kernel(a_ptr, w_ptr, scale_ptr, y_ptr, n_out, k_in: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, W_SCALED: tl.constexpr,
                    USE_PDL: tl.constexpr):  # fmt: skip
    """Program p: y[rows] = W[rows] @ a (one row of activations), rows = [p * BLOCK_N, (p + 1) * BLOCK_N), times each
    row's scale for e4m3 weights. The weights are no kernel's output, but a program waits before reading anything,
    as the engine's kernels do."""
    wait_for_previous_kernel(USE_PDL)
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    out_mask = outs < n_out
    rows = w_ptr + outs.to(tl.int64)[:, None] * k_in
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, k_in, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_in
        w = tl.load(rows + ks[None, :], mask=out_mask[:, None] & k_mask[None, :], other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        a = tl.load(a_ptr + ks, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    let_next_kernel_launch(USE_PDL)
    y = tl.sum(acc, axis=1)
    if W_SCALED:
        y *= tl.load(scale_ptr + outs, mask=out_mask, other=1.0)
    tl.store(y_ptr + outs, y.to(y_ptr.dtype.element_ty), mask=out_mask)


def row_gemv(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, variant: tuple[int, int, int, int]):
    rows, block_k, warps, stages = variant
    n_out, k_in = w.shape
    y = torch.empty(n_out, dtype=a.dtype, device=a.device)
    row_gemv_kernel[(triton.cdiv(n_out, rows),)](
        a, w, scale if scale is not None else w, y, n_out, k_in, BLOCK_N=rows,
        BLOCK_K=min(block_k, triton.next_power_of_2(k_in)), STAGES=stages, W_SCALED=scale is not None,
        num_warps=warps, **pdl_launch_options(a.device),
    )  # fmt: skip
    return y


def layer_weights(n_out: int, k_in: int, fp8: bool, layers: int, device: torch.device):
    """`layers` distinct weight sets: (weight, per-row scale or None)."""
    out = []
    for _ in range(layers):
        w = torch.randn(n_out, k_in, device=device, dtype=torch.bfloat16) / k_in**0.5
        out.append(quantize_rows(w) if fp8 else (w, None))
    return out


def reference(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    y = w.float() @ a.float()
    return y if scale is None else y * scale


def probe(name: str, layers: int, device: torch.device) -> None:
    n_out, k_in, fp8 = SHAPES[name]
    weights = layer_weights(n_out, k_in, fp8, layers, device)
    a = torch.randn(1, k_in, device=device, dtype=torch.bfloat16)
    num_bytes = sum(w.numel() * w.element_size() for w, _ in weights) / layers
    want = reference(a[0], *weights[0])
    config = choose_config(n_out, k_in, fp8_weights=fp8)
    kind = "e4m3" if fp8 else "bf16"
    print(f"\n# {name}: {n_out} x {k_in} {kind}, {num_bytes / 1e6:.2f} MB a layer, {layers} layers")

    def engine() -> None:
        for w, scale in weights:
            linear_rows_triton(a, w, weight_scale=scale)

    results = []
    engine()
    us = graph_ms(engine) * 1e3 / layers
    programs = triton.cdiv(n_out, config.block_n) * config.split_k
    label = f"linear_rows {config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages} "
    results.append((us, label + f"split {config.split_k} ({programs} programs)"))
    for variant in VARIANTS:
        rows = variant[0]
        err = (row_gemv(a[0], *weights[0], variant).float() - want).abs().max().item() / want.abs().max().item()

        def chain(variant=variant) -> None:
            for w, scale in weights:
                row_gemv(a[0], w, scale, variant)

        us = graph_ms(chain) * 1e3 / layers
        label = f"row_gemv {variant[0]} rows x {variant[1]} w{variant[2]} s{variant[3]}"
        results.append((us, label + f" ({triton.cdiv(n_out, rows)} programs, err {err:.1e})"))
    print(f"{results[0][0]:8.2f} us {num_bytes / results[0][0] / 1e6:5.2f} TB/s  {results[0][1]}  [the engine's]")
    for us, label in sorted(results[1:])[:8]:
        print(f"{us:8.2f} us {num_bytes / us / 1e6:5.2f} TB/s  {label}")


def smoke() -> None:
    for fp8 in (False, True):
        (w, scale), a = layer_weights(24, 96, fp8, 1, torch.device("cpu"))[0], torch.randn(96, dtype=torch.bfloat16)
        got = row_gemv(a, w, scale, (4, 32, 1, 1)).float()
        want = reference(a, w, scale)
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2), (got, want)
    print("smoke: row_gemv matches torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["o", "qkv", "router"])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--smoke", action="store_true", help="one small variant against torch, on a CPU")
    args = parser.parse_args()
    if args.smoke:
        smoke()
        return
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}; {len(VARIANTS)} row_gemv variants a shape")
    for name in args.shapes:
        probe(name, args.layers, device)


if __name__ == "__main__":
    main()
