"""Linear layers for a few rows (decode at small batch) with the decoder's small ops folded into their epilogues: the
torch references, the Triton kernel and the wrappers.

At batch 1-16 a projection just streams its weight matrix once. cuBLAS picks split-K kernels for the narrow ones (a
reduce kernel after each), and every RMSNorm and SiLU-and-mul between projections is a launch of its own that moves a
few KB; on an 8B model at batch 1 the norms, activations and reduces took 0.3 ms of a 4.5 ms forward. Here one
program computes BLOCK_N outputs of every row over the whole K (no split, no reduce) and finishes the op that follows:

- `linear_rows`: y = a @ W^T (+ bias). With `norm_partials` the input is an RMSNorm whose scale was left out
  (a = h * gamma, see below) and the epilogue multiplies each row by 1 / rms(h). With `gated`, W stacks gate and up
  and the epilogue returns silu(gate) * up: the gated MLP's first projection and its activation in one launch.
- `linear_rows_into_residual`: h = residual + (a @ W^T + bias) is the new residual stream; the epilogue also writes
  h * gamma of the next RMSNorm and each program's sum of h^2 over its columns (`NormInput`). The next `linear_rows`
  adds those partial sums (a fixed order: the result does not depend on timing) and scales. So a decoder layer's
  two RMSNorms cost no launch at all.

Normalising after the products instead of before rounds differently from RMSNorm-then-linear (h * gamma is rounded
to 16 bits, not h * gamma / rms); the results agree to bf16 precision, not bit for bit.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from tidal.kernels._device import pdl_launch_options
from tidal.kernels._one_row_kernels import one_row_linear_kernel
from tidal.kernels._small_batch_kernels import linear_rows_kernel
from tidal.kernels._split_k import split_buffers
from tidal.kernels._validate import (
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_same_dtype,
    check_shape,
)
from tidal.kernels.kv_cache_dtype import FP8_E4M3

# Rows are padded to one tensor-core tile of 16; beyond that a real GEMM wins.
MAX_ROWS = 16
HALF_DTYPES = (torch.float16, torch.bfloat16)


class NormInput(NamedTuple):
    """An RMSNorm's input, not yet scaled: rms_norm(h) = scaled * rsqrt(sum(partial_sq, dim 0) / H + eps)."""

    scaled: torch.Tensor  # [M, H] h * gamma, in h's dtype
    partial_sq: torch.Tensor  # [P, M] fp32 sums of h^2 over P disjoint column ranges


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # Programs per output tile, each over 1/split_k of K; the last to finish adds the partials in a fixed order and
    # runs the epilogue (kernels/_split_k.py). More programs in flight for a projection with few output tiles.
    split_k: int = 1


# Measured best at one row on an H200 for shapes the rule in `choose_config` serves poorly, by (outputs, inputs,
# gated). The rule was fitted to the 8B's projections, whose 96-128 programs each stream 4096 inputs; Qwen3-30B-A3B's
# expert layers have narrower projections around the experts (a 2048-wide o gets 64 programs of 32 outputs, the
# 128-expert router 4), which do better with K split over more programs
# (benchmarks/kernels/bench_small_batch_linear.py --sweep --shape qwen3-30b-a3b, over 48 layers' weights in a graph):
# its o 7.66 us (2.19 TB/s) against 8.02 for the best unsplit tile; its router 3.31 us against 4.45. Its qkv keeps the
# rule's tile (8.45 us, 2.48 TB/s; no split did better).
TUNED_LINEAR_CONFIGS: dict[tuple[int, int, bool], LaunchConfig] = {
    (2048, 4096, False): LaunchConfig(64, 256, 4, 4, split_k=4),
    (128, 2048, False): LaunchConfig(32, 128, 4, 3, split_k=8),
}


# The same for e4m3 weights (FP8 weights, kernels/fp8_linear.py). A K step of e4m3 weights is half the bytes, and the
# kernel widens each weight and (x4: every warp holds the activations' whole tile) each activation in registers, so
# per byte the loop issues ~4.5x the instructions of a 16-bit one (sm_90 SASS of the 8B o projection: 1,055 a 16 KB
# step against 235 a 32 KB step). Wider tiles spread the activations' conversion over more weights, and a split of K
# keeps enough programs. Measured on an H100 over 32 (8B) or 48 (Qwen3-30B-A3B) layers' weights in a graph
# (bench_small_batch_linear.py --sweep [--shape qwen3-30b-a3b] --weight-dtype fp8): the 8B o 10.69 us against 12.67
# on the rule's tile, its down 25.50 against 34.80 (its gate/up keeps the rule's, the best of the grid); Qwen3's o
# 7.71 us against 8.29 or more for its 16-bit entry. A shape missing here takes its 16-bit entry, then the rule.
TUNED_FP8_LINEAR_CONFIGS: dict[tuple[int, int, bool], LaunchConfig] = {
    (4096, 4096, False): LaunchConfig(128, 256, 4, 4, split_k=4),
    (4096, 14336, False): LaunchConfig(128, 256, 8, 4, split_k=4),
    (2048, 4096, False): LaunchConfig(64, 512, 4, 4, split_k=4),
}


# A weights-first program holds its whole rows in registers through its wait: at most this many bytes of them a
# thread (64 registers), so the tile never spills.
WEIGHTS_FIRST_BYTES_PER_THREAD = 256


@dataclass(frozen=True)
class OneRowConfig:
    """A one-row launch of the row-parallel GEMV (`_one_row_kernels.py`): each program owns `block_n` whole weight
    rows and streams them `block_k` inputs at a time; no split of K.

    weights_first: each program loads its rows whole, as one tile (block_k is then ignored), before it waits for the
    previous kernel. Weights are no kernel's output, so where the previous kernel lets this one launch early (decode
    attention does, right after its own wait), this projection's weight stream overlaps it rather than following it.
    Loads before the wait see only what kernels before the previous one wrote; weights are written between steps
    (loads, updates), and a step's first launch (the embedding gather) is not a PDL launch, so those writes are
    complete before any program of the step starts."""

    block_n: int
    block_k: int
    num_warps: int
    weights_first: bool = False

    def held_bytes_per_thread(self, k_in: int, rows_per_program: int, weight_itemsize: int) -> int:
        """Bytes of weights a thread holds through the wait when weights-first, each program owning
        `rows_per_program` rows (the gated and qkv kernels hold two sets of block_n) of K = k_in."""
        whole: int = max(16, triton.next_power_of_2(k_in))
        return rows_per_program * whole * weight_itemsize // (32 * self.num_warps)

    def launch_block_k(self, k_in: int, rows_per_program: int, weight_itemsize: int) -> int:
        """BLOCK_K of a launch over K = k_in; a weights-first tile past its register budget is a ValueError."""
        whole: int = max(16, triton.next_power_of_2(k_in))
        if not self.weights_first:
            return min(self.block_k, whole)
        per_thread = self.held_bytes_per_thread(k_in, rows_per_program, weight_itemsize)
        if per_thread > WEIGHTS_FIRST_BYTES_PER_THREAD:
            raise ValueError(f"a weights-first program of {rows_per_program} rows of {whole} inputs over "
                             f"{self.num_warps} warps holds {per_thread} bytes of them a thread, over the "
                             f"{WEIGHTS_FIRST_BYTES_PER_THREAD} that fit its registers")  # fmt: skip
        return whole


# Shapes where one row takes the row-parallel GEMV, measured on an H100 at one row over 48 layers' weights in a
# graph (benchmarks/kernels/probe_row_gemv.py, probe-row-gemv-h100.txt), by (outputs, inputs, gated, e4m3 weights).
# Qwen3-30B-A3B's o projection in FP8: 4.89 us against 7.30 for its TUNED_FP8_LINEAR_CONFIGS tile (8 rows a program
# rather than the 2 that measured 4.68: a quarter of the partial sums for the norm that reads them); its router
# (16-bit in every weight mode): 1.62 us against 3.43 for its split-K tile. Inside the FP8 decode step at batch 1
# (profile_steps.py, profile-steps-qwen3-30b-a3b-h100-one-row-ab.txt) the step took 2,644 us against 2,706: much of
# the kernels' gain is hidden there, as the o projection's programs wait out decode attention, which lets them
# launch at its start. So both now load their weights first (`weights_first`), the o at 4 rows a program (512
# programs): the weight stream runs while attention does. With the qkv's entry likewise, the FP8 step at batch 1,
# context 160 took 2,290 / 2,292 us against 2,459 / 2,459 with all three streamed after the wait (H100, 200 steps
# a run; the same tiles weights-first 2,313 / 2,319: profile-steps-qwen3-30b-a3b-h100-one-row-weights-first-ab.txt).
# Qwen3's bf16 o as a row GEMV (1 row, weights first: 7.79 us alone against 9.19 tiled) gained nothing in the bf16
# step (3,442 against 3,391 us), so it keeps the tiled kernel. Other shapes keep the tiled kernel until measured.
TUNED_ONE_ROW_CONFIGS: dict[tuple[int, int, bool, bool], OneRowConfig] = {
    (2048, 4096, False, True): OneRowConfig(4, 4096, 8, weights_first=True),
    (128, 2048, False, False): OneRowConfig(2, 2048, 8, weights_first=True),
}


def choose_one_row_config(n_out: int, k_in: int, gated: bool, fp8_weights: bool) -> OneRowConfig | None:
    """The row-parallel GEMV's config for a one-row launch of this shape, or None: the tiled kernel."""
    return TUNED_ONE_ROW_CONFIGS.get((n_out, k_in, gated, fp8_weights))


def choose_config(n_out: int, k_in: int, gated: bool = False, fp8_weights: bool = False) -> LaunchConfig:
    """A shape in TUNED_LINEAR_CONFIGS (for e4m3 weights TUNED_FP8_LINEAR_CONFIGS first) takes its entry. Otherwise
    tiles measured on an H200 at one row (benchmarks/kernels/bench_small_batch_linear.py --sweep), each the best or
    within 1% of it for the 8B shapes: narrow outputs (o, down: 4096) take 32 outputs by 512 inputs, so 128 programs
    each stream a long run of K; wider ones (qkv, LM head) 64 by 256; the gated gate/up pair, whose program reads two
    tiles per step, 64 by 128 with three in flight. K narrower than the tile takes a narrower tile."""
    key = (n_out, k_in, gated)
    tuned = (TUNED_FP8_LINEAR_CONFIGS.get(key) if fp8_weights else None) or TUNED_LINEAR_CONFIGS.get(key)
    if tuned is not None:
        return tuned
    if gated:
        block_n, block_k, stages = 64, 128, 3
    elif n_out <= 4096:
        block_n, block_k, stages = 32, 512, 4
    else:
        block_n, block_k, stages = 64, 256, 4
    return LaunchConfig(block_n, min(block_k, max(16, triton.next_power_of_2(k_in))), num_warps=4, num_stages=stages)


def _check(
    a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_out: int, weight_scale: torch.Tensor | None
) -> None:
    check_ndim("a", a, 2)
    check_dtype("a", a, (*HALF_DTYPES, torch.float32))
    check_ndim("weight", weight, 2)
    if weight.shape[1] != a.shape[1]:
        raise ValueError(f"weight must have {a.shape[1]} input features, got shape {tuple(weight.shape)}")
    check_weight_scale(a, weight, weight_scale)
    check_last_dim_contiguous("a", a)
    check_last_dim_contiguous("weight", weight)
    if bias is not None:
        check_shape("bias", bias, (n_out,))
        check_contiguous("bias", bias)
    if a.shape[0] > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows, got {a.shape[0]}: use a GEMM")


def check_weight_scale(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> None:
    """A weight is in the activations' dtype without a scale, or e4m3 (FP8 weights, kernels/fp8_linear.py) with one
    fp32 scale per row."""
    if weight.dtype != FP8_E4M3:
        check_same_dtype("a and weight", a, weight)
        if weight_scale is not None:
            raise ValueError(f"weight_scale is for e4m3 weights; this weight is {weight.dtype}")
        return
    if weight_scale is None:
        raise ValueError("an e4m3 weight needs its weight_scale (one per row)")
    check_shape("weight_scale", weight_scale, (weight.shape[0],))
    check_dtype("weight_scale", weight_scale, (torch.float32,))
    check_contiguous("weight_scale", weight_scale)


def weight_products(a: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.Tensor:
    """a [M, K] @ weight [N, K]^T in fp32, an e4m3 weight's products then scaled per output channel (as the kernels
    scale their sums)."""
    y = a.float() @ weight.float().T
    return y if weight_scale is None else y * weight_scale[None, :]


def _check_partials(partial_sq: torch.Tensor, num_rows: int) -> None:
    check_ndim("partial_sq", partial_sq, 2)
    check_dtype("partial_sq", partial_sq, (torch.float32,))
    if partial_sq.shape[1] != num_rows:
        raise ValueError(f"partial_sq must have one column per row ({num_rows}), got {tuple(partial_sq.shape)}")
    check_contiguous("partial_sq", partial_sq)


# ----- references -----


def norm_input_reference(hidden: torch.Tensor, gamma: torch.Tensor) -> NormInput:
    """The NormInput of `hidden` [M, H] (one partial sum per row): how a stream enters the first layer."""
    hf = hidden.float()
    return NormInput((hf * gamma.float()).to(hidden.dtype), (hf * hf).sum(dim=1)[None, :].contiguous())


def linear_rows_reference(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_partials: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """a [M, K] @ weight [N, K]^T -> [M, N] (gated: [M, N / 2]); see the module docstring. `weight_scale`: an e4m3
    weight's per-row scales."""
    n_out = weight.shape[0]
    _check(a, weight, bias, n_out, weight_scale)
    y = weight_products(a, weight, weight_scale)  # [M, N]
    if norm_partials is not None:
        _check_partials(norm_partials, a.shape[0])
        y = y * torch.rsqrt(norm_partials.sum(dim=0) / a.shape[1] + eps)[:, None]
    if bias is not None:
        y = y + bias.float()
    if gated:
        gate, up = y.chunk(2, dim=1)
        y = F.silu(gate) * up
    return y.to(a.dtype)


def linear_rows_into_residual_reference(
    a: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int = 32,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, NormInput]:
    """-> (h = residual + linear(a), NormInput of h for the RMSNorm with weight `gamma`); partial sums over
    `block_n` columns each, as the kernel's programs make them."""
    n_out = weight.shape[0]
    _check(a, weight, bias, n_out, weight_scale)
    check_shape("residual", residual, (a.shape[0], n_out))
    check_shape("gamma", gamma, (n_out,))
    y = (weight_products(a, weight, weight_scale) + (bias.float() if bias is not None else 0.0)).to(a.dtype)  # [M, N]
    h = (y.float() + residual.float()).to(a.dtype)  # rounded as the unfused residual add rounds it
    hf = h.float()
    scaled = (hf * gamma.float()).to(a.dtype)
    sq = F.pad(hf * hf, (0, -n_out % block_n)).view(a.shape[0], -1, block_n).sum(dim=2)  # [M, P]
    return h, NormInput(scaled, sq.T.contiguous())


def _inputs(
    a: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    norm_partials: torch.Tensor | None,
    residual: torch.Tensor | None,
    gamma: torch.Tensor | None,
    partial_sq: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The kernels' first seven pointers; an absent input passes a tensor the launch has anyway (Triton's launcher
    refuses a null pointer), which the kernel never reads."""
    return (
        a,
        weight,
        weight_scale if weight_scale is not None else partial_sq,
        bias if bias is not None else weight,
        norm_partials if norm_partials is not None else a,
        residual if residual is not None else a,
        gamma if gamma is not None else weight,
    )


def _launch(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    n_out: int,
    norm_partials: torch.Tensor | None,
    eps: float,
    gated: bool,
    residual: torch.Tensor | None,
    gamma: torch.Tensor | None,
    config: LaunchConfig | OneRowConfig | None,
    weight_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (y, h * gamma, partial sums); the last two are empty unless `residual` is given. One row of a shape in
    TUNED_ONE_ROW_CONFIGS (or any row given a OneRowConfig) runs the row-parallel GEMV, the rest the tiled kernel;
    the outputs are the same, one partial sum per program (N-tile)."""
    num_rows, k_in = a.shape
    fp8 = weight.dtype == FP8_E4M3
    if config is None and num_rows == 1:
        config = choose_one_row_config(n_out, k_in, gated, fp8)
    one_row = isinstance(config, OneRowConfig)
    if one_row and num_rows != 1:
        raise ValueError(f"a one-row config launches one row, got {num_rows}")
    config = config or choose_config(n_out, k_in, gated, fp8)
    if isinstance(config, LaunchConfig) and config.split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {config.split_k}")
    num_programs = triton.cdiv(n_out, config.block_n)
    into_residual = residual is not None
    y = torch.empty((num_rows, n_out), dtype=a.dtype, device=a.device)
    scaled = torch.empty((num_rows, n_out) if into_residual else (0, 0), dtype=a.dtype, device=a.device)
    partial_sq = torch.empty((num_programs if into_residual else 0, num_rows), dtype=torch.float32, device=a.device)
    if num_rows == 0 or n_out == 0:
        return y, scaled, partial_sq
    if k_in == 0:
        raise ValueError("a linear layer needs at least one input feature")
    inputs = _inputs(a, weight, weight_scale, bias, norm_partials, residual, gamma, partial_sq)
    num_partials = norm_partials.shape[0] if norm_partials is not None else 0
    epilogue = {
        "ROW_SCALE": norm_partials is not None,
        "GATED": gated,
        "INTO_RESIDUAL": into_residual,
        "HAS_BIAS": bias is not None,
    }
    if isinstance(config, OneRowConfig):
        one_row_linear_kernel[(num_programs,)](
            *inputs, y, scaled, partial_sq, n_out, k_in, weight.stride(0), num_partials, eps, **epilogue,
            BLOCK_N=config.block_n,
            BLOCK_K=config.launch_block_k(k_in, config.block_n * (2 if gated else 1), weight.element_size()),
            # The previous norm's partial sums in one load where they are few (the one-row o projection leaves 256).
            BLOCK_P=min(1024, max(16, triton.next_power_of_2(num_partials))),
            WEIGHTS_FIRST=config.weights_first,
            num_warps=config.num_warps,
            **pdl_launch_options(a.device),
        )  # fmt: skip
        return y, scaled, partial_sq
    # A split's partial: its BLOCK_M x BLOCK_N tile, and the up tile's beside it.
    workspace, counters = split_buffers(partial_sq, num_programs, config.split_k, 2 * MAX_ROWS * config.block_n)
    linear_rows_kernel[(num_programs, config.split_k)](
        *inputs,
        y,
        scaled,
        partial_sq,
        num_rows,
        n_out,
        k_in,
        a.stride(0),
        weight.stride(0),
        residual.stride(0) if residual is not None else 0,
        num_partials,
        eps,
        workspace,
        counters,
        **epilogue,
        IS_FP32=a.dtype == torch.float32,
        SPLIT_K=config.split_k,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        BLOCK_P=64,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl_launch_options(a.device),
    )
    return y, scaled, partial_sq


def linear_rows_triton(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    norm_partials: torch.Tensor | None = None,
    eps: float = 0.0,
    gated: bool = False,
    config: LaunchConfig | OneRowConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel; same contract as `linear_rows_reference`. At one row a shape in TUNED_ONE_ROW_CONFIGS (or
    a OneRowConfig given) takes the row-parallel GEMV."""
    n_total = weight.shape[0]
    if gated and n_total % 2 != 0:
        raise ValueError(f"a gated weight stacks gate and up: its rows must be even, got {n_total}")
    _check(a, weight, bias, n_total, weight_scale)
    if norm_partials is not None:
        _check_partials(norm_partials, a.shape[0])
    n_out = n_total // 2 if gated else n_total
    return _launch(a, weight, bias, n_out, norm_partials, eps, gated, None, None, config, weight_scale)[0]


def linear_rows_into_residual_triton(
    a: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    gamma: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: LaunchConfig | OneRowConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, NormInput]:
    """The Triton kernel; same contract as `linear_rows_into_residual_reference` with block_n = config.block_n (the
    chosen config's when None is given)."""
    n_out = weight.shape[0]
    _check(a, weight, bias, n_out, weight_scale)
    check_shape("residual", residual, (a.shape[0], n_out))
    check_same_dtype("a and residual", a, residual)
    check_last_dim_contiguous("residual", residual)
    check_shape("gamma", gamma, (n_out,))
    check_contiguous("gamma", gamma)
    h, scaled, partial_sq = _launch(a, weight, bias, n_out, None, 0.0, False, residual, gamma, config, weight_scale)
    return h, NormInput(scaled, partial_sq)


def uses_small_batch_kernels(x: torch.Tensor) -> bool:
    """Whether a step of `x`'s rows takes these kernels: CUDA, 16-bit, at most MAX_ROWS rows. fp32 and larger
    batches keep the unfused layers (cuBLAS and the RMSNorm / activation kernels)."""
    return x.is_cuda and x.dtype in HALF_DTYPES and x.shape[0] <= MAX_ROWS
