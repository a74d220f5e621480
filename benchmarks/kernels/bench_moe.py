"""Fused MoE (8 experts, top-2, hidden 4096, intermediate 14336, bf16): TFLOP/s for many tokens, and for a few tokens
the bandwidth of reading the selected experts' weights. Baseline: a torch bf16 loop over experts."""

import torch
import torch.nn.functional as F
from common import Row, bandwidth_row, bench_ms, compute_row, graph_ms, relative_error

from tidal.kernels._moe_config import GemmTiles, MoeConfig, default_moe_config
from tidal.kernels.fused_moe import fused_moe_experts_triton, topk_route_reference, topk_route_triton

EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 4096, 14336
EXPERT_BYTES = 3 * INTER * HIDDEN * 2

LARGE_SWEEP = [
    MoeConfig(128, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 4)),
    MoeConfig(128, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 3), group_m=16),
    MoeConfig(128, GemmTiles(128, 64, 8, 4), GemmTiles(256, 64, 8, 3), group_m=4),
    MoeConfig(128, GemmTiles(128, 64, 8, 3), GemmTiles(256, 64, 8, 4)),
]
SMALL_SWEEP = [
    MoeConfig(16, GemmTiles(32, 128, 4, 4), GemmTiles(16, 256, 4, 4)),
    MoeConfig(16, GemmTiles(64, 128, 4, 5), GemmTiles(32, 128, 4, 5)),
    MoeConfig(16, GemmTiles(128, 64, 4, 4), GemmTiles(64, 128, 4, 4)),
]


def torch_moe(x, w13, w2, weights, ids):
    """bf16 expert loop: the plain-PyTorch way to run this layer."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = x[token] @ w13[e].t()
        act = F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]
        out.index_add_(0, token, (act @ w2[e].t()).float() * weights[token, slot, None])
    return out.to(x.dtype)


def _describe(c: MoeConfig) -> str:
    g, d = c.gate_up, c.down
    return (
        f"m{c.block_m} gu(n{g.block_n} k{g.block_k} w{g.num_warps} s{g.num_stages}) "
        f"dn(n{d.block_n} k{d.block_k} w{d.num_warps} s{d.num_stages})"
    )


def bench_tokens(tokens, w13, w2, sweep) -> list[Row]:
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    weights, ids = topk_route_triton(logits, TOP_K, True)
    ref_w, ref_ids = topk_route_reference(logits, TOP_K, True)
    route_ok = bool(torch.equal(ids, ref_ids)) and float((weights - ref_w).abs().max()) < 1e-5
    want = torch_moe(x, w13, w2, weights, ids)
    shape = f"T{tokens} E{EXPERTS} top{TOP_K} H{HIDDEN} I{INTER} bf16"
    large = tokens > 32
    selected = int(ids.unique().numel())
    flops, nbytes = 6 * tokens * TOP_K * INTER * HIDDEN, selected * EXPERT_BYTES

    def row(impl, ms, target=None, note=""):
        if large:
            return compute_row("fused MoE", shape, impl, ms, flops, target, note)
        return bandwidth_row("fused MoE", shape, impl, ms, nbytes, target, note + f"; {selected} experts read")

    configs = [default_moe_config(tokens, TOP_K, EXPERTS)]
    if sweep:
        configs += LARGE_SWEEP if large else SMALL_SWEEP
    rows = []
    for i, config in enumerate(configs):
        err = relative_error(fused_moe_experts_triton(x, w13, w2, weights, ids, config), want)
        ms = bench_ms(lambda config=config: fused_moe_experts_triton(x, w13, w2, weights, ids, config), rep_ms=100)
        impl = ("triton default " if i == 0 else "triton ") + _describe(config)
        note = f"rel err vs torch bf16 {err:.1e}; routing kernel {'matches' if route_ok else 'DIFFERS'}"
        rows.append(row(impl, ms, 0.6 if large else 0.7, note))
        if not large:
            ms = graph_ms(lambda config=config: fused_moe_experts_triton(x, w13, w2, weights, ids, config))
            rows.append(row(impl + " [CUDA graph]", ms, 0.7, note))
    rows.append(row("torch bf16 expert loop", bench_ms(lambda: torch_moe(x, w13, w2, weights, ids), rep_ms=100)))
    ms = bench_ms(lambda: topk_route_triton(logits, TOP_K, True))
    rows.append(bandwidth_row("topk routing", f"T{tokens} E{EXPERTS}", "triton", ms, logits.numel() * 4))
    return rows


def run(sweep: bool = True, token_counts=(1, 2, 4, 8, 16, 8192)) -> list[Row]:
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) / INTER**0.5
    return [row for tokens in token_counts for row in bench_tokens(tokens, w13, w2, sweep)]
