"""A decoder layer's projections at small batch, 8B shapes: cuBLAS with the separate RMSNorm / SiLU-and-mul kernels
against the fused small-batch kernels, in CUDA graphs, as time per layer and TB/s over the weight bytes.

Each timed graph runs the layer's projections over 32 distinct weight sets in turn (more bytes than the L2 holds),
like a decode step runs them over the model's layers; attention is left out (it is the same on both sides).

    python benchmarks/kernels/bench_small_batch_linear.py [--rows 1 2 4 8 16] [--sweep [--shape qwen3-30b-a3b]]

--sweep times tile configs of each fused kernel at one row and prints the best few (what `choose_config` and its
`TUNED_LINEAR_CONFIGS` are fitted to); --shape picks the model whose projections it sweeps (the 8B's by default;
llama3-8b-qkv-rope: its qkv with the rotary and KV-cache write folded in; qwen3-30b-a3b: the attention projections
and the router of its expert layers; qwen3-30b-a3b-qkv-rope: its qkv with the q/k norms too); --weight-dtype fp8
sweeps on e4m3 weights with their own grid (`TUNED_FP8_LINEAR_CONFIGS`).
"""

import argparse
import itertools
import pathlib
import sys
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from common import Row, bandwidth_row, format_table, graph_ms

from tidal.kernels.activation import silu_and_mul_triton
from tidal.kernels.fp8_linear import quantize_rows
from tidal.kernels.rms_norm import rms_norm_triton
from tidal.kernels.rotary_store_kv import HeadNorm
from tidal.kernels.small_batch_linear import (
    LaunchConfig,
    choose_config,
    linear_rows_into_residual_triton,
    linear_rows_triton,
    norm_input_reference,
)
from tidal.kernels.small_batch_qkv import qkv_rope_store_triton

HIDDEN, INTER, QKV, VOCAB, LAYERS = 4096, 14336, 6144, 128256, 32
DTYPE = torch.bfloat16
EPS = 1e-5


class _Layers:
    """32 layers' projection weights and norms, and one step's activations for `rows` rows."""

    def __init__(self, rows: int) -> None:
        def weight(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5

        self.rows = rows
        self.qkv = [weight(QKV, HIDDEN) for _ in range(LAYERS)]
        self.o = [weight(HIDDEN, HIDDEN) for _ in range(LAYERS)]
        self.gate_up = [weight(2 * INTER, HIDDEN) for _ in range(LAYERS)]
        self.down = [weight(HIDDEN, INTER) for _ in range(LAYERS)]
        self.gamma = torch.rand(HIDDEN, device="cuda", dtype=DTYPE) + 0.5
        self.hidden = torch.randn(rows, HIDDEN, device="cuda", dtype=DTYPE)
        self.attn_out = torch.randn(rows, HIDDEN, device="cuda", dtype=DTYPE)
        self.weight_bytes = 2 * HIDDEN * (QKV + HIDDEN + 2 * INTER) + 2 * INTER * HIDDEN  # one layer

    def unfused(self) -> None:
        residual = self.hidden
        delta = self.hidden
        for i in range(LAYERS):
            normed, residual = rms_norm_triton(delta, self.gamma, EPS, residual)
            F.linear(normed, self.qkv[i])
            delta = F.linear(self.attn_out, self.o[i])
            normed, residual = rms_norm_triton(delta, self.gamma, EPS, residual)
            delta = F.linear(silu_and_mul_triton(F.linear(normed, self.gate_up[i])), self.down[i])

    def fused(self) -> None:
        residual = self.hidden
        norm_in = norm_input_reference(residual, self.gamma)
        for i in range(LAYERS):
            linear_rows_triton(norm_in.scaled, self.qkv[i], None, norm_in.partial_sq, EPS)
            residual, norm_in = linear_rows_into_residual_triton(self.attn_out, self.o[i], residual, self.gamma)
            act = linear_rows_triton(norm_in.scaled, self.gate_up[i], None, norm_in.partial_sq, EPS, gated=True)
            residual, norm_in = linear_rows_into_residual_triton(act, self.down[i], residual, self.gamma)


def _per_layer_ms(fn) -> float:
    fn()  # compiles outside the capture
    return graph_ms(fn) / LAYERS


def run(rows_list: tuple[int, ...]) -> list[Row]:
    out: list[Row] = []
    for rows in rows_list:
        layers = _Layers(rows)
        shape = f"8B layer projections, {rows} row(s)"
        base = _per_layer_ms(layers.unfused)
        out.append(bandwidth_row("decoder layer", shape, "cuBLAS + RMSNorm/SiLU kernels [graph]", base,
                                 layers.weight_bytes))  # fmt: skip
        ms = _per_layer_ms(layers.fused)
        out.append(bandwidth_row("decoder layer", shape, "fused small-batch kernels [graph]", ms, layers.weight_bytes,
                                 note=f"{base / ms:.2f}x"))  # fmt: skip
        del layers
        head = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=DTYPE) / HIDDEN**0.5
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=DTYPE)
        shape = f"LM head {VOCAB}x{HIDDEN}, {rows} row(s)"
        base = graph_ms(lambda x=x, head=head: F.linear(x, head))
        out.append(bandwidth_row("lm head", shape, "cuBLAS [graph]", base, head.numel() * 2))
        linear_rows_triton(x, head)
        ms = graph_ms(lambda x=x, head=head: linear_rows_triton(x, head))
        out.append(
            bandwidth_row("lm head", shape, "linear_rows [graph]", ms, head.numel() * 2, note=f"{base / ms:.2f}x")
        )
        del head
        torch.cuda.empty_cache()
    return out


# Shared memory a program may hold on an H100/H200 (227 KB).
SHARED_BYTES = 232448


def _pipeline_bytes(config: LaunchConfig, gated: bool, fp8: bool) -> int:
    """Shared memory of a config's K pipeline: num_stages - 1 buffers of the activations' [16, BLOCK_K] 16-bit tile
    and the weight's [BLOCK_N, BLOCK_K] (two of them gated)."""
    weight_tile = config.block_n * config.block_k * (1 if fp8 else 2) * (2 if gated else 1)
    return (config.num_stages - 1) * (16 * config.block_k * 2 + weight_tile)


def _sweep_configs(n_out: int, k_in: int, splits: tuple[int, ...], gated: bool, fp8: bool) -> list[LaunchConfig]:
    """The tile grid, with each split of K that leaves every split at least one K step. e4m3 weights take half the
    bytes a tile, so their grid reaches wider tiles, longer K steps and programs of fewer warps; a split there is
    kept only while the launch stays within eight warps an SM."""
    if not fp8:
        stage_options = ((4, 3), (4, 4), (4, 6), (8, 4)) if splits == (1,) else ((4, 3), (4, 4))
        return [
            LaunchConfig(n, k, warps, stages, split_k=split)
            for n, k, (warps, stages), split in itertools.product((16, 32, 64), (128, 256, 512), stage_options, splits)
            if k * split <= k_in
        ]
    # Every warp of a program widens the activations' whole [16, BLOCK_K] tile for its share of the outputs, so fewer
    # warps a program convert less per weight byte; more programs (splits) then fill the SMs.
    grid = itertools.product((32, 64, 128), (256, 512, 1024), ((1, 3), (2, 3), (4, 3), (4, 4)), splits)
    configs = [LaunchConfig(n, k, warps, stages, split_k=split) for n, k, (warps, stages), split in grid]
    return [
        c
        for c in configs
        if c.block_k * c.split_k <= k_in
        and (c.split_k == 1 or -(-n_out // c.block_n) * c.split_k * c.num_warps <= 1056)  # 2 x 4 warps an SM
        and _pipeline_bytes(c, gated, fp8) <= SHARED_BYTES
    ]


def _time_configs(
    name: str, weights: list, call, top: int, splits: tuple[int, ...] = (1,), gated: bool = False
) -> None:
    """Each config of `call(weight, config)` over all `weights` in one graph (tensors, or `Fp8Weight`s for the
    e4m3 sweeps); prints the best `top`, then the config `choose_config` gives this shape today (what adopting the
    best would gain). On e4m3 weights the best three are timed again at eight warps."""
    fp8 = isinstance(weights[0], Fp8Weight)
    first = weights[0].weight if fp8 else weights[0]
    n_out = first.shape[0] // 2 if gated else first.shape[0]
    in_use = choose_config(n_out, first.shape[1], gated, fp8)
    configs = _sweep_configs(n_out, first.shape[1], splits, gated, fp8)
    timed: list[tuple[float, LaunchConfig]] = []

    def time_all(candidates: list[LaunchConfig]) -> None:
        for config in candidates:
            if any(config == c for _, c in timed):
                continue

            def all_layers(c: LaunchConfig = config, ws: list = weights, fn=call) -> None:
                for w in ws:
                    fn(w, c)

            try:
                timed.append((graph_ms(all_layers) / len(weights), config))
            except Exception as err:  # a tile too large for shared memory: reported and skipped
                print(f"  {name} {config}: {type(err).__name__}", flush=True)

    time_all(configs if in_use in configs else [*configs, in_use])
    if fp8:
        timed.sort(key=lambda t: t[0])
        wider = [replace(c, num_warps=8, num_stages=s) for _, c in timed[:3] for s in (3, 4)]
        time_all([c for c in wider if _pipeline_bytes(c, gated, fp8) <= SHARED_BYTES])
    timed.sort(key=lambda t: t[0])
    nbytes = first.numel() * first.element_size()
    print(f"{name} {tuple(first.shape)} {first.dtype}, 1 row:")
    for ms, config in timed[:top]:
        print(f"    {ms * 1e3:7.2f} us  {nbytes / ms / 1e9:.2f} TB/s  {config}", flush=True)
    for rank, (ms, config) in enumerate(timed, 1):
        if config == in_use:
            print(f"  in use: {ms * 1e3:7.2f} us  {nbytes / ms / 1e9:.2f} TB/s  {config} (rank {rank})", flush=True)


# Qwen3-30B-A3B's projections around the experts: hidden 2048, 32 q + 4 + 4 kv heads of 128, 128 experts, 48 layers.
QWEN3_MOE = {"hidden": 2048, "qkv": 5120, "q_size": 4096, "experts": 128, "layers": 48}


class Fp8Weight(NamedTuple):
    """A projection as `weight_dtype` "fp8" serves it: e4m3 rows and their fp32 scales."""

    weight: torch.Tensor
    scale: torch.Tensor


def _layer_weights(n: int, k: int, layers: int, fp8: bool) -> list:
    """`layers` random [n, k] weights: bf16 tensors, or with `fp8` quantized `Fp8Weight`s."""
    drawn = [torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5 for _ in range(layers)]
    return [Fp8Weight(*quantize_rows(w)) for w in drawn] if fp8 else drawn


def _split(w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, its scale or None) of a bf16 tensor or an `Fp8Weight`."""
    return (w.weight, w.scale) if isinstance(w, Fp8Weight) else (w, None)


def sweep_qwen3_moe(top: int = 5, fp8: bool = False) -> None:
    """The expert layers' small-batch projections of Qwen3-30B-A3B at one row: qkv (row scale), o (into residual)
    and the router (row scale). `fp8` times o alone: the router stays bf16 with FP8 weights, and the engine's qkv is
    the qkv-rope kernel (--shape qwen3-30b-a3b-qkv-rope)."""
    shape = QWEN3_MOE
    hidden, layers = shape["hidden"], shape["layers"]

    def weights(n: int, k: int) -> list:
        return _layer_weights(n, k, layers, fp8)

    gamma = torch.rand(hidden, device="cuda", dtype=DTYPE) + 0.5
    residual = torch.randn(1, hidden, device="cuda", dtype=DTYPE)
    norm_in = norm_input_reference(residual, gamma)
    attn_out = torch.randn(1, shape["q_size"], device="cuda", dtype=DTYPE)

    def normed(w, c: LaunchConfig) -> None:
        weight, scale = _split(w)
        linear_rows_triton(norm_in.scaled, weight, None, norm_in.partial_sq, EPS, config=c, weight_scale=scale)

    def into_residual(w, c: LaunchConfig) -> None:
        weight, scale = _split(w)
        linear_rows_into_residual_triton(attn_out, weight, residual, gamma, config=c, weight_scale=scale)

    splits = (1, 2, 4, 8)  # few output tiles each: split K for programs in flight
    if not fp8:  # the engine runs the qkv-rope kernel for it; its e4m3 tiles are --shape qwen3-30b-a3b-qkv-rope's
        _time_configs("qkv (row scale)", weights(shape["qkv"], hidden), normed, top, splits)
    _time_configs("o (into residual)", weights(hidden, shape["q_size"]), into_residual, top, splits)
    if not fp8:
        _time_configs("router (row scale)", weights(shape["experts"], hidden), normed, top, splits)


# Llama-3-8B's attention heads: 32 q + 8 kv of 128, no q/k norm (half-head rotary pairs a program).
LLAMA3_8B = {"hidden": HIDDEN, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "layers": LAYERS, "qk_norm": False}
QWEN3_MOE_HEADS = {"hidden": 2048, "q_heads": 32, "kv_heads": 4, "head_dim": 128, "layers": 48, "qk_norm": True}


def sweep_qkv_rope(model: dict, top: int = 6, fp8: bool = False) -> None:
    """A model's qkv at one row with the rotary and KV-cache write in the epilogue (`qkv_rope_store_triton`; with
    "qk_norm" the per-head q/k norms too, whole heads a program): its split of K, K step and warps."""
    hidden, layers, head_dim = model["hidden"], model["layers"], model["head_dim"]
    q_heads, kv_heads = model["q_heads"], model["kv_heads"]
    n_qkv = (q_heads + 2 * kv_heads) * head_dim
    weights = [_split(w) for w in _layer_weights(n_qkv, hidden, layers, fp8)]
    ones = torch.ones(hidden, device="cuda", dtype=DTYPE)
    norm_in = norm_input_reference(torch.randn(1, hidden, device="cuda", dtype=DTYPE), ones)
    head_norm = HeadNorm(torch.rand(head_dim, device="cuda", dtype=DTYPE) + 0.5, 1e-6) if model["qk_norm"] else None
    cos_sin = torch.randn(4096, head_dim, device="cuda", dtype=DTYPE)
    k_cache = torch.zeros(64, 16, kv_heads, head_dim, device="cuda", dtype=DTYPE)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.tensor([100], device="cuda")
    slots = torch.tensor([100], device="cuda")
    timed = []
    # Whole heads (q/k norm) make few programs: split K over more. Half-head pairs make enough; e4m3 halves the
    # bytes of a K step, so its grid reaches longer ones. None: the defaults the engine runs, timed beside the grid.
    if model["qk_norm"]:
        grid = [(None, *c) for c in itertools.product((1, 2, 4, 8), (64, 128, 256), (4, 8))]
    elif fp8:  # the whole half a program (64 dims) too: more bytes a step beside the activations it converts
        grid = [
            (n, s, k, w)
            for n, s, k, w in itertools.product((32, 64), (1, 2, 4), (128, 256, 512, 1024), (1, 2, 4))
            if 3 * k * (32 + 2 * n) <= SHARED_BYTES  # three stages of the activations' and the pair's tiles
        ]
    else:
        grid = [(None, *c) for c in itertools.product((1, 2, 4), (128, 256, 512), (4, 8))]
    for block_n, split_k, block_k, warps in [*grid, (None, None, None, None)]:

        def all_layers(
            n: int | None = block_n, s: int | None = split_k, k: int | None = block_k, w: int | None = warps
        ) -> None:
            for weight, scale in weights:
                qkv_rope_store_triton(norm_in.scaled, weight, None, norm_in.partial_sq, EPS, positions, cos_sin,
                                      k_cache, v_cache, slots, q_heads, kv_heads, head_norm, head_norm, split_k=s,
                                      block_k=k, num_warps=w, weight_scale=scale, block_n=n)  # fmt: skip

        label = f"split_k={split_k} block_k={block_k} num_warps={warps}" + (f" block_n={block_n}" if block_n else "")
        if split_k is None:
            label = "in use (defaults)"
        try:
            timed.append((graph_ms(all_layers) / layers, label))
        except Exception as err:  # a tile too large for shared memory: reported and skipped
            print(f"  {label}: {type(err).__name__}", flush=True)
    timed.sort()
    nbytes = weights[0][0].numel() * weights[0][0].element_size()
    norms = " + q/k norm" if model["qk_norm"] else ""
    print(f"qkv{norms} + rotary + KV store {tuple(weights[0][0].shape)} {weights[0][0].dtype}, 1 row:")
    for ms, config in timed[:top]:
        print(f"    {ms * 1e3:7.2f} us  {nbytes / ms / 1e9:.2f} TB/s  {config}", flush=True)
    for rank, (ms, config) in enumerate(timed, 1):
        if config.startswith("in use"):
            print(f"  {config}: {ms * 1e3:7.2f} us  {nbytes / ms / 1e9:.2f} TB/s (rank {rank})", flush=True)


def sweep(top: int = 3, fp8: bool = False) -> None:
    """The 8B's fused kernels alone over 32 weight copies at one row, for a grid of tiles. On e4m3 weights the qkv
    is left to the qkv-rope sweep (the kernel the engine runs for it) and K may be split."""
    hidden = torch.randn(1, HIDDEN, device="cuda", dtype=DTYPE)
    gamma = torch.rand(HIDDEN, device="cuda", dtype=DTYPE) + 0.5
    norm_in = norm_input_reference(hidden, gamma)
    attn_out = torch.randn(1, HIDDEN, device="cuda", dtype=DTYPE)
    act = torch.randn(1, INTER, device="cuda", dtype=DTYPE)

    def normed(gated: bool):
        def call(w, c: LaunchConfig) -> None:
            weight, scale = _split(w)
            linear_rows_triton(norm_in.scaled, weight, None, norm_in.partial_sq, EPS, gated=gated, config=c,
                               weight_scale=scale)  # fmt: skip

        return call

    def into_residual(x: torch.Tensor):
        def call(w, c: LaunchConfig) -> None:
            weight, scale = _split(w)
            linear_rows_into_residual_triton(x, weight, hidden, gamma, config=c, weight_scale=scale)

        return call

    kernels = {  # name: (weight shape, call, gated)
        "o (into residual)": ((HIDDEN, HIDDEN), into_residual(attn_out), False),
        "gate_up (row scale, gated)": ((2 * INTER, HIDDEN), normed(True), True),
        "down (into residual)": ((HIDDEN, INTER), into_residual(act), False),
    }
    if not fp8:
        kernels = {"qkv (row scale)": ((QKV, HIDDEN), normed(False), False), **kernels}
    for name, ((n, k), call, gated) in kernels.items():
        weights = _layer_weights(n, k, LAYERS, fp8)
        _time_configs(name, weights, call, top, (1, 2, 4, 8) if fp8 else (1,), gated)
        del weights
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    shapes = ["llama3-8b", "llama3-8b-qkv-rope", "qwen3-30b-a3b", "qwen3-30b-a3b-qkv-rope"]
    parser.add_argument("--shape", choices=shapes, default="llama3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--weight-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: the sweeps on e4m3 weights with per-row scales")  # fmt: skip
    args = parser.parse_args()
    fp8 = args.weight_dtype == "fp8"
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA device")
    if args.sweep and args.shape == "qwen3-30b-a3b":
        sweep_qwen3_moe(fp8=fp8)
    elif args.sweep and args.shape.endswith("-qkv-rope"):
        sweep_qkv_rope(QWEN3_MOE_HEADS if args.shape.startswith("qwen3") else LLAMA3_8B, fp8=fp8)
    elif args.sweep:
        sweep(fp8=fp8)
    else:
        print(format_table(run(tuple(args.rows))))


if __name__ == "__main__":
    main()
