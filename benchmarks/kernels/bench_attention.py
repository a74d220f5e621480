"""Paged decode and prefill attention: Triton variants vs torch SDPA on the same K/V laid out densely.

run_all.py runs the suite; run alone, this file sweeps the decode kernel's tiles at one shape (the offline 8B run's
batch-256 step with an FP8 cache by default, where the kernel reached 51% of the copy bandwidth against 82% with
bf16; kernels-h200-attention-fp8-v-layout.md) and prints the default beside the best:

    cd benchmarks/kernels && python bench_attention.py [--batch 256 --context 400 --cache fp8 --top 12]
        [--splits 0 2 --block-n 64 128]   (a narrower grid: each variant compiles its own kernel)
        [--heads 32 4]                    (query and KV heads; the default is the 8B's 32 / 8)
"""

import argparse

import torch
import torch.nn.functional as F
from common import Row, bandwidth_row, bench_ms, compute_row, graph_ms, relative_error
from triton.runtime.errors import OutOfResources

from tidal.kernels.decode_attention import choose_num_splits, paged_decode_attention_triton
from tidal.kernels.kv_cache_dtype import FP8_E4M3, to_cache_dtype
from tidal.kernels.kv_layout import cache_view, is_tokens_innermost, new_kv_cache_pair
from tidal.kernels.prefill_attention import PrefillConfig, default_config, paged_prefill_attention_triton


def _paged(batch, context, num_kv_heads, head_dim, block_size, cache_dtype=torch.bfloat16, v_tokens_innermost=None):
    """Random caches with each sequence's blocks scattered (shuffled block ids), V laid out as the engine keeps it
    for `cache_dtype` (kernels/kv_layout.py) unless `v_tokens_innermost` says, and the same K/V densely in bf16."""
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    block_shape = (block_size, num_kv_heads, head_dim)
    k_cache, v_cache = new_kv_cache_pair(num_blocks, block_shape, cache_dtype, torch.device("cuda"))
    if v_tokens_innermost is not None:
        flat = torch.empty(v_cache.numel(), dtype=cache_dtype, device="cuda")
        v_cache = cache_view(flat, block_shape, v_tokens_innermost)
    for cache in (k_cache, v_cache):
        cache.copy_(to_cache_dtype(torch.randn(cache.shape, device="cuda", dtype=torch.bfloat16), cache_dtype))
    tables = torch.randperm(num_blocks, device="cuda").int().view(batch, blocks_per_seq)
    k_cache_bf16, v_cache_bf16 = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    dense_k = k_cache_bf16[tables.long()].reshape(batch, context, num_kv_heads, head_dim).transpose(1, 2)
    dense_v = v_cache_bf16[tables.long()].reshape(batch, context, num_kv_heads, head_dim).transpose(1, 2)
    return k_cache, v_cache, tables, dense_k.contiguous(), dense_v.contiguous()


def _cache_name(v_cache):
    if v_cache.dtype != FP8_E4M3:
        return str(v_cache.dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    return "fp8 cache, V " + ("tokens inner" if is_tokens_innermost(v_cache) else "dims inner")


# The whole-grid sweep's axes, (splits, block_n, num_warps, num_stages); splits 0: the wrapper's default.
SWEEP_SPLITS = (0, 1, 2, 4)
SWEEP_BLOCK_N = (16, 32, 64, 128)


def decode_sweep(splits=SWEEP_SPLITS, block_ns=SWEEP_BLOCK_N, warps=(2, 4, 8), stages=(1, 2, 3, 4)):
    return [(s or None, n, w, st) for s in splits for n in block_ns for w in warps for st in stages]


def bench_decode(batch=64, context=4096, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, sweep=True,
                 cache_dtype=torch.bfloat16, stages_sweep=False, v_tokens_innermost=None,
                 variants=None):  # fmt: skip
    """`stages_sweep`: the default splits at 2 and 3 stages too (what decode_attention.STAGES chose). `variants`:
    (splits, block_n, warps, stages) to time after the default instead of those two sweeps (None: the wrapper's
    choice)."""
    k_cache, v_cache, tables, dense_k, dense_v = _paged(batch, context, num_kv_heads, head_dim, block_size,
                                                        cache_dtype, v_tokens_innermost)  # fmt: skip
    q = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    want = F.scaled_dot_product_attention(q[:, :, None], dense_k, dense_v, scale=scale, enable_gqa=True)[:, :, 0]
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * cache_dtype.itemsize
    shape = f"B{batch} ctx{context} {num_heads}/{num_kv_heads}h d{head_dim} bs{block_size} {_cache_name(v_cache)}"
    target = 0.8 if (batch, context, head_dim) == (64, 4096, 128) else None
    default_splits = choose_num_splits(
        batch, num_kv_heads, context, torch.cuda.get_device_properties(0).multi_processor_count
    )
    if variants is None:
        variants = []
        if stages_sweep:
            variants += [(None, None, 4, 2), (None, None, 4, 3)]
        if sweep:
            variants += [(s, n, w, st) for s in (1, 2, 4) for n, w, st in ((64, 4, 3), (128, 4, 2))]
    variants = [(None, None, None, None), *variants]
    rows = []
    for splits, block_n, warps, stages in variants:

        def run(splits=splits, block_n=block_n, warps=warps, stages=stages):
            return paged_decode_attention_triton(
                q, k_cache, v_cache, tables, seq_lens, scale, num_splits=splits, block_n=block_n,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip

        try:
            err = relative_error(run(), want)
        except OutOfResources as exc:  # a sweep's tile that does not fit (shared memory, registers)
            print(f"skipped splits={splits} block_n={block_n} w{warps} s{stages}: {exc}", flush=True)
            continue
        if splits is None and block_n is None:
            impl = "triton default" if stages is None else f"triton default splits s{stages}"
        else:
            impl = f"triton splits={splits or 'default'} block_n={block_n} w{warps} s{stages}"
        note = f"rel err {err:.1e}" + (f"; default splits={default_splits}" if splits is None else "")
        rows.append(bandwidth_row("decode attention", shape, impl, bench_ms(run), kv_bytes, target, note))
        if splits is None and block_n is None and stages is None:
            rows.append(
                bandwidth_row("decode attention", shape, impl + " [CUDA graph]", graph_ms(run), kv_bytes, target)
            )
    ms = bench_ms(lambda: F.scaled_dot_product_attention(q[:, :, None], dense_k, dense_v, scale=scale, enable_gqa=True))
    rows.append(bandwidth_row("decode attention", shape, "torch SDPA (dense KV)", ms, kv_bytes))
    return rows


def bench_prefill(batch=8, length=2048, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, sweep=True,
                  cache_dtype=torch.bfloat16, v_tokens_innermost=None):  # fmt: skip
    k_cache, v_cache, tables, dense_k, dense_v = _paged(batch, length, num_kv_heads, head_dim, block_size,
                                                        cache_dtype, v_tokens_innermost)  # fmt: skip
    q = torch.randn(batch * length, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * length
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    dense_q = q.view(batch, length, num_heads, head_dim).transpose(1, 2)
    want = F.scaled_dot_product_attention(dense_q, dense_k, dense_v, is_causal=True, scale=scale, enable_gqa=True)
    want = want.transpose(1, 2).reshape(batch * length, num_heads, head_dim)
    flops = 4 * batch * num_heads * head_dim * (length * (length + 1) // 2)  # QK^T and PV over the causal half
    shape = f"{batch}x{length} causal {num_heads}/{num_kv_heads}h d{head_dim} bs{block_size} {_cache_name(v_cache)}"
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
    # An FP8 cache beside bf16 at the 8B offline run's decode shape (a context with a partial last tile), and at
    # the long one; the FP8 cache in both V layouts (kernels/kv_layout.py).
    rows += bench_decode(batch=256, context=400, sweep=False, stages_sweep=True)
    for v_inner in (True, False):
        rows += bench_decode(batch=256, context=400, sweep=False, cache_dtype=FP8_E4M3, stages_sweep=v_inner,
                             v_tokens_innermost=v_inner)  # fmt: skip
        rows += bench_decode(sweep=False, cache_dtype=FP8_E4M3, v_tokens_innermost=v_inner)
        rows += bench_prefill(sweep=False, cache_dtype=FP8_E4M3, v_tokens_innermost=v_inner)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=400, help="tokens of every sequence (400: a partial tile)")
    parser.add_argument("--cache", choices=["bf16", "fp8"], default="fp8", help="fp8: V tokens innermost, as served")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--splits", type=int, nargs="+", default=SWEEP_SPLITS, help="0: the wrapper's choice")
    parser.add_argument("--block-n", type=int, nargs="+", default=SWEEP_BLOCK_N)
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("Q", "KV"),
                        help="query and KV heads (Qwen3-30B-A3B: 32 4)")  # fmt: skip
    args = parser.parse_args()
    sweep = decode_sweep(args.splits, args.block_n)
    cache_dtype = FP8_E4M3 if args.cache == "fp8" else torch.bfloat16
    rows = bench_decode(batch=args.batch, context=args.context, num_heads=args.heads[0], num_kv_heads=args.heads[1],
                        sweep=False, cache_dtype=cache_dtype, variants=sweep)  # fmt: skip
    print(f"{rows[0].shape}; {len(sweep)} tile variants")
    sdpa = rows[-1]
    timed = sorted((r for r in rows[:-1] if not r.impl.endswith("[CUDA graph]")), key=lambda r: r.ms)
    ranked = [("default", rows[0])] + [(f"#{i + 1}", r) for i, r in enumerate(timed[: args.top])] + [("SDPA", sdpa)]
    for label, row in ranked:
        print(f"{label:>8} {row.ms * 1e3:8.1f} us {row.value:5.2f} TB/s {row.fraction:6.1%}  {row.impl}  {row.note}")


if __name__ == "__main__":
    main()
