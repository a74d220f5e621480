"""Paged decode and prefill attention: Triton variants vs torch SDPA on the same K/V laid out densely."""

import torch
import torch.nn.functional as F
from common import Row, bandwidth_row, bench_ms, compute_row, graph_ms, relative_error

from tidal.kernels.decode_attention import choose_num_splits, paged_decode_attention_triton
from tidal.kernels.prefill_attention import PrefillConfig, default_config, paged_prefill_attention_triton


def _paged(batch, context, num_kv_heads, head_dim, block_size):
    """Random caches with each sequence's blocks scattered (shuffled block ids), and the same K/V densely."""
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device="cuda").int().view(batch, blocks_per_seq)
    dense_k = k_cache[tables.long()].reshape(batch, context, num_kv_heads, head_dim).transpose(1, 2)
    dense_v = v_cache[tables.long()].reshape(batch, context, num_kv_heads, head_dim).transpose(1, 2)
    return k_cache, v_cache, tables, dense_k.contiguous(), dense_v.contiguous()


def bench_decode(batch=64, context=4096, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, sweep=True):
    k_cache, v_cache, tables, dense_k, dense_v = _paged(batch, context, num_kv_heads, head_dim, block_size)
    q = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    want = F.scaled_dot_product_attention(q[:, :, None], dense_k, dense_v, scale=scale, enable_gqa=True)[:, :, 0]
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * 2
    shape = f"B{batch} ctx{context} {num_heads}/{num_kv_heads}h d{head_dim} bs{block_size} bf16"
    target = 0.8 if (batch, context, head_dim) == (64, 4096, 128) else None
    default_splits = choose_num_splits(
        batch, num_kv_heads, context, torch.cuda.get_device_properties(0).multi_processor_count
    )
    variants = [(None, None, 4, 3)]
    if sweep:
        variants += [(s, n, w, st) for s in (1, 2, 4) for n, w, st in ((64, 4, 3), (128, 4, 2))]
    rows = []
    for splits, block_n, warps, stages in variants:

        def run(splits=splits, block_n=block_n, warps=warps, stages=stages):
            return paged_decode_attention_triton(
                q, k_cache, v_cache, tables, seq_lens, scale, num_splits=splits, block_n=block_n,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip

        err = relative_error(run(), want)
        impl = "triton default" if splits is None else f"triton splits={splits} block_n={block_n} w{warps} s{stages}"
        note = f"rel err {err:.1e}" + (f"; default splits={default_splits}" if splits is None else "")
        rows.append(bandwidth_row("decode attention", shape, impl, bench_ms(run), kv_bytes, target, note))
        if splits is None:
            rows.append(
                bandwidth_row("decode attention", shape, impl + " [CUDA graph]", graph_ms(run), kv_bytes, target)
            )
    ms = bench_ms(lambda: F.scaled_dot_product_attention(q[:, :, None], dense_k, dense_v, scale=scale, enable_gqa=True))
    rows.append(bandwidth_row("decode attention", shape, "torch SDPA (dense KV)", ms, kv_bytes))
    return rows


def bench_prefill(batch=8, length=2048, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, sweep=True):
    k_cache, v_cache, tables, dense_k, dense_v = _paged(batch, length, num_kv_heads, head_dim, block_size)
    q = torch.randn(batch * length, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * length
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    dense_q = q.view(batch, length, num_heads, head_dim).transpose(1, 2)
    want = F.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=True, scale=scale, enable_gqa=True)
    want = want.transpose(1, 2).reshape(batch * length, num_heads, head_dim)
    flops = 4 * batch * num_heads * head_dim * (length * (length + 1) // 2)  # QK^T and PV over the causal half
    shape = f"{batch}x{length} causal {num_heads}/{num_kv_heads}h d{head_dim} bs{block_size} bf16"
    configs = [default_config(head_dim, num_heads // num_kv_heads)]
    if sweep:
        configs += [
            PrefillConfig(128, 64, 8, 3, q_heads=1), PrefillConfig(128, 64, 8, 3, q_heads=4),
            PrefillConfig(128, 64, 8, 3, heads_first=True), PrefillConfig(128, 128, 8, 2, q_heads=2),
            PrefillConfig(64, 64, 4, 3, q_heads=2), PrefillConfig(128, 64, 8, 4, q_heads=2),
        ]  # fmt: skip
    rows = []
    for i, config in enumerate(configs):

        def run(config=config):
            return paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu, seq_lens, scale, config=config)

        err = relative_error(run(), want)
        layout = f"qh{config.q_heads}" + (" heads-first" if config.heads_first else "")
        tiles = f"m{config.block_m} n{config.block_n} w{config.num_warps} s{config.num_stages} {layout}"
        impl = ("triton default " if i == 0 else "triton ") + tiles
        rows.append(compute_row("prefill attention", shape, impl, bench_ms(run), flops, 0.5, f"rel err {err:.1e}"))
    ms = bench_ms(
        lambda: F.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=True, scale=scale, enable_gqa=True)
    )
    rows.append(compute_row("prefill attention", shape, "torch SDPA (dense KV)", ms, flops))
    return rows


def run(sweep: bool = True) -> list[Row]:
    rows = bench_decode(sweep=sweep)
    rows += bench_decode(batch=4, context=32768, sweep=False)  # long context: where split-K matters
    rows += bench_decode(batch=64, context=4096, block_size=128, sweep=False)
    rows += bench_prefill(sweep=sweep)
    return rows
