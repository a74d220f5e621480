"""RMSNorm(+residual), SiLU-and-mul, KV cache store and rotary: Triton vs torch, GB/s over the bytes each must move."""

import torch
import torch.nn.functional as F
from common import Row, bandwidth_row, bench_ms, graph_ms, relative_error

from tidal.kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from tidal.kernels.kv_cache import store_kv_reference, store_kv_triton
from tidal.kernels.rms_norm import rms_norm_reference, rms_norm_triton
from tidal.kernels.rotary import apply_rotary_reference, apply_rotary_triton, build_cos_sin_cache


def bench_rms_norm(tokens: int = 8192, hidden: int = 4096) -> list[Row]:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    shape = f"{tokens}x{hidden} bf16"
    err = relative_error(
        rms_norm_triton(x, weight, 1e-6, residual)[0], rms_norm_reference(x, weight, 1e-6, residual)[0]
    )
    rows = []
    nbytes = 4 * x.numel() * 2  # read x, residual; write out, new residual
    ms = bench_ms(lambda: rms_norm_triton(x, weight, 1e-6, residual))
    rows.append(bandwidth_row("rms_norm+residual", shape, "triton", ms, nbytes, 0.8, f"rel err {err:.1e}"))
    ms = bench_ms(lambda: rms_norm_reference(x, weight, 1e-6, residual))
    rows.append(bandwidth_row("rms_norm+residual", shape, "torch reference (eager)", ms, nbytes))
    ms = graph_ms(lambda: rms_norm_triton(x, weight, 1e-6, residual))
    rows.append(bandwidth_row("rms_norm+residual", shape, "triton [CUDA graph]", ms, nbytes, 0.8))
    ms = bench_ms(lambda: rms_norm_triton(x, weight, 1e-6))
    rows.append(bandwidth_row("rms_norm", shape, "triton", ms, 2 * x.numel() * 2, 0.8))
    ms = graph_ms(lambda: rms_norm_triton(x, weight, 1e-6))
    rows.append(bandwidth_row("rms_norm", shape, "triton [CUDA graph]", ms, 2 * x.numel() * 2, 0.8))
    ms = bench_ms(lambda: F.rms_norm(x, (hidden,), weight, 1e-6))
    rows.append(bandwidth_row("rms_norm", shape, "torch F.rms_norm", ms, 2 * x.numel() * 2))
    return rows


def bench_silu_and_mul(tokens: int = 8192, inter: int = 4096) -> list[Row]:
    x = torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16)
    shape = f"[{tokens}, 2x{inter}] -> [{tokens}, {inter}] bf16"
    err = relative_error(silu_and_mul_triton(x), silu_and_mul_reference(x))
    nbytes = 3 * tokens * inter * 2
    rows = []
    for block in (1024, 2048, 4096):
        ms = bench_ms(lambda block=block: silu_and_mul_triton(x, block=block))
        rows.append(
            bandwidth_row("silu_and_mul", shape, f"triton block {block}", ms, nbytes, 0.8, f"rel err {err:.1e}")
        )
    ms = graph_ms(lambda: silu_and_mul_triton(x))
    rows.append(bandwidth_row("silu_and_mul", shape, "triton default [CUDA graph]", ms, nbytes, 0.8))
    ms = bench_ms(lambda: F.silu(x[:, :inter]) * x[:, inter:])
    rows.append(bandwidth_row("silu_and_mul", shape, "torch F.silu * up", ms, nbytes))
    return rows


def bench_store_kv(tokens: int = 8192, num_kv_heads: int = 8, head_dim: int = 128) -> list[Row]:
    k = torch.randn(tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    num_blocks, block_size = tokens // 16 + 64, 16
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    nbytes = 4 * k.numel() * 2
    shape = f"{tokens} tokens, {num_kv_heads}x{head_dim} bf16"
    rows = [
        bandwidth_row(
            "store_kv", shape, "triton", bench_ms(lambda: store_kv_triton(k, v, k_cache, v_cache, slots)), nbytes
        )
    ]
    ms = bench_ms(lambda: store_kv_reference(k, v, k_cache, v_cache, slots))
    rows.append(bandwidth_row("store_kv", shape, "torch reference (index_put)", ms, nbytes))
    return rows


def bench_rotary(tokens: int = 8192, num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128) -> list[Row]:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    cache = build_cos_sin_cache(head_dim, 131072, 500000.0, scaling, torch.bfloat16, "cuda")
    q = torch.randn(tokens, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 131072, (tokens,), device="cuda")
    err = relative_error(
        apply_rotary_triton(q.clone(), k.clone(), positions, cache, True)[0],
        apply_rotary_reference(q.clone(), k.clone(), positions, cache, True)[0],
    )
    nbytes = 2 * (q.numel() + k.numel()) * 2 + tokens * head_dim * 2
    shape = f"{tokens} tokens, {num_heads}/{num_kv_heads} heads x {head_dim} bf16, neox"
    ms = bench_ms(lambda: apply_rotary_triton(q, k, positions, cache, True))
    rows = [bandwidth_row("rotary", shape, "triton", ms, nbytes, note=f"rel err {err:.1e}")]
    ms = bench_ms(lambda: apply_rotary_reference(q, k, positions, cache, True))
    rows.append(bandwidth_row("rotary", shape, "torch reference (eager)", ms, nbytes))
    return rows


def run() -> list[Row]:
    return [*bench_rms_norm(), *bench_silu_and_mul(), *bench_store_kv(), *bench_rotary()]
