"""Registers, spills and shared memory of the small-batch kernels' launches on an H100/H200 (sm_90), from ptxas, on
a machine with no GPU.

    python benchmarks/kernels/register_report.py [--model ...]   # exit status 1 if one spills

Each wrapper runs on CPU tensors of the model's shapes (allocated, never touched) with its Triton kernels swapped for
recorders, so the launch the engine would make (the tuned tiles of `TUNED_SMALL_BATCH_CONFIGS`, `TUNED_LINEAR_CONFIGS`,
their FP8 tables and the qkv defaults, with their constexprs) is captured without running: Qwen3-30B-A3B's expert
kernels at every token count of its table, its projections at one and two rows, the 8B's at one row, a whole-head qkv at
head_dim 256, the FP8 table's projections on e4m3 weights; and Qwen3-30B-A3B's FP8 experts: the small-batch kernels with
their scales, the grouped GEMMs W8A16 at decode counts and W8A8 at prefill counts (FP8 tensor cores; compiled here
before any GPU has run them); and decode attention at both models' heads. Each recorded launch is bound by Triton's own
launcher code for an sm_90 backend (the constants it makes of integers equal to 1, its 16-divisibility hints, PDL on),
compiled for sm_90, and ptxas -v (Triton's) reports its resources. A spill moves a tile that should stay in registers to
local memory: on these bandwidth-bound kernels that costs more than the tile saves, and a config that spills is a
mistake to catch before device time goes on it (tests/kernels/test_register_report.py runs this on every push).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

import tidal.kernels._moe_config as moe_config
import tidal.kernels.decode_attention as decode_attention
import tidal.kernels.fp8_linear as fp8_linear
import tidal.kernels.fused_moe as fused_moe
import tidal.kernels.fused_moe_small_batch as moe_small_batch
import tidal.kernels.small_batch_linear as small_batch_linear
import tidal.kernels.small_batch_qkv as small_batch_qkv
from tidal.kernels._moe_small_batch_config import TUNED_SMALL_BATCH_CONFIGS, small_batch_moe_config
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.kernels.kv_layout import new_kv_cache_pair
from tidal.kernels.moe_expert_scales import ExpertScales
from tidal.kernels.rotary_store_kv import HeadNorm
from tidal.kernels.small_batch_linear import NormInput, OneRowConfig

SM90 = GPUTarget("cuda", 90, 32)
# The kernels these wrappers launch, by the module attribute each wrapper calls them through.
RECORDED: list[tuple[ModuleType, str]] = [
    (moe_small_batch, "pair_gate_up_kernel"),
    (moe_small_batch, "token_down_kernel"),
    (fused_moe, "topk_softmax_kernel"),
    (fused_moe, "expert_histogram_kernel"),
    (fused_moe, "expert_layout_kernel"),
    (fused_moe, "place_pairs_kernel"),
    (fused_moe, "grouped_gemm_kernel"),
    (fused_moe, "combine_kernel"),
    (fp8_linear, "quantize_rows_kernel"),
    (small_batch_linear, "linear_rows_kernel"),
    (small_batch_linear, "one_row_linear_kernel"),
    (small_batch_qkv, "qkv_rope_kernel"),
    (small_batch_qkv, "one_row_qkv_kernel"),
    (decode_attention, "decode_split_kernel"),
]


@dataclass(frozen=True)
class Launch:
    kernel: JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, kernel: JITFunction, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, args, kwargs))

        return record


@contextmanager
def recording() -> Iterator[list[Launch]]:
    launches: list[Launch] = []
    originals = [(module, name, getattr(module, name)) for module, name in RECORDED]
    for module, name, kernel in originals:
        setattr(module, name, _Recorder(kernel, launches))
    try:
        yield launches
    finally:
        for module, name, kernel in originals:
            setattr(module, name, kernel)


@dataclass(frozen=True)
class Bound:
    """A launch as Triton's launcher binds it for an sm_90 backend."""

    kernel: JITFunction
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: Any  # the backend's CUDAOptions
    constants: dict[str, Any]  # constexprs by name, runtime integers equal to 1 included

    def key(self) -> str:
        """What sets the compiled code apart: two launches with the same key compile to the same kernel."""
        options = self.options
        return f"{self.kernel.__name__} {self.constants} {sorted(self.attrs)} {options.num_warps} {options.num_stages}"

    def describe(self) -> str:
        """The kernel and what it is compiled for: its constants as bound for sm_90, warps and stages."""
        constants = {k: int(v) if isinstance(v, bool) else v for k, v in self.constants.items() if k != "USE_PDL"}
        shown = " ".join(f"{k}={v}" for k, v in constants.items())
        return f"{self.kernel.__name__} [{shown}] warps={self.options.num_warps} stages={self.options.num_stages}"


def bind_sm90(launch: Launch) -> Bound:
    """The launch bound by Triton's own launcher code for an sm_90 backend, as on an H100/H200: the same
    integer-equal-to-1 constants, 16-divisibility hints and do-not-specialise rules. PDL is on, as there."""
    fn = launch.kernel
    backend = make_backend(SM90)
    kwargs = {**launch.kwargs, "launch_pdl": True}
    if "USE_PDL" in fn.arg_names:
        kwargs["USE_PDL"] = True
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    constants = {fn.arg_names[path[0]]: value for path, value in constexprs.items()}
    return Bound(fn, signature, constexprs, attrs, options, constants)


def _ptxas() -> str:
    path = triton.knobs.nvidia.ptxas.path  # the wheel's own, or TRITON_PTXAS_PATH as triton.compile uses
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"no ptxas at {path!r}: the triton wheel ships one for its CUDA backend")
    return str(path)


def sm90_resources(launch: Launch) -> Resources:
    return _compiled_resources(bind_sm90(launch))


def _compiled_resources(bound: Bound) -> Resources:
    source = ASTSource(fn=bound.kernel, signature=bound.signature, constexprs=bound.constexprs, attrs=bound.attrs)
    compiled = triton.compile(source, target=SM90, options=bound.options.__dict__)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull], capture_output=True,
                                text=True, check=True).stderr  # fmt: skip
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    registers = re.search(r"Used (\d+) registers", report)
    if spills is None or registers is None:
        raise RuntimeError(f"ptxas -v printed no resource line for {bound.kernel.__name__}:\n{report}")
    return Resources(int(registers[1]), int(spills[1]), int(spills[2]), int(compiled.metadata.shared))


# ----- the launches of each model's small-batch decode step -----


def _empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def qwen3_30b_a3b_launches() -> list[Launch]:
    """Qwen3-30B-A3B's expert kernels at every token count of its tuned table (fused counts in the decoder's form),
    its o and router projections at one and two rows, and its whole-head qkv with the q/k norms."""
    hidden, experts, top_k, inter, heads, kv_heads, head_dim = 2048, 128, 8, 768, 32, 4, 128
    w13, w2 = _empty(experts, 2 * inter, hidden), _empty(experts, hidden, inter)
    with recording() as launches:
        for tokens, config in TUNED_SMALL_BATCH_CONFIGS[(experts, top_k, hidden, inter)]:
            logits = _empty(tokens, experts, dtype=torch.float32)
            if config.fuse_into_layer:
                x = NormInput(_empty(tokens, hidden), _empty(hidden // 64, tokens, dtype=torch.float32))
                fused_moe.fused_moe_into_residual_triton(x, 1e-6, w13, w2, logits, top_k, True, _empty(tokens, hidden),
                                                         _empty(hidden), config)  # fmt: skip
            else:
                fused_moe.fused_moe_triton(_empty(tokens, hidden), w13, w2, logits, top_k, True, config)
        for rows in (1, 2):
            attention = _empty(rows, heads * head_dim)
            small_batch_linear.linear_rows_into_residual_triton(attention, _empty(hidden, heads * head_dim),
                                                                _empty(rows, hidden), _empty(hidden))  # fmt: skip
            partials = _empty(hidden // 64, rows, dtype=torch.float32)
            small_batch_linear.linear_rows_triton(_empty(rows, hidden), _empty(experts, hidden), None, partials, 1e-6)
            small_batch_linear.linear_rows_triton(_empty(rows, hidden), _empty(151936, hidden))  # the LM head
        _qkv(hidden, heads, kv_heads, head_dim, qk_norm=True)
    return launches


def llama3_8b_launches() -> list[Launch]:
    """The 8B's small-batch projections at one row (the rule's tiles) and its half-head qkv."""
    hidden, inter, heads, kv_heads, head_dim, vocab = 4096, 14336, 32, 8, 128, 128256
    with recording() as launches:
        row, residual, gamma = _empty(1, hidden), _empty(1, hidden), _empty(hidden)
        partials = _empty(hidden // 32, 1, dtype=torch.float32)
        small_batch_linear.linear_rows_into_residual_triton(row, _empty(hidden, hidden), residual, gamma)  # o
        small_batch_linear.linear_rows_triton(row, _empty(2 * inter, hidden), None, partials, 1e-6, gated=True)
        small_batch_linear.linear_rows_into_residual_triton(_empty(1, inter), _empty(hidden, inter), residual, gamma)
        small_batch_linear.linear_rows_triton(row, _empty(vocab, hidden))  # the LM head
        _qkv(hidden, heads, kv_heads, head_dim, qk_norm=False)
    return launches


def _qkv(hidden: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool, one_row: OneRowConfig | None = None,
         weight_dtype: torch.dtype = torch.bfloat16) -> None:  # fmt: skip
    rows, blocks = 1, 4
    norm = HeadNorm(_empty(head_dim), 1e-6) if qk_norm else None
    n_out = (heads + 2 * kv_heads) * head_dim
    scale = _empty(n_out, dtype=torch.float32) if weight_dtype == FP8_E4M3 else None
    small_batch_qkv.qkv_rope_store_triton(
        _empty(rows, hidden), _empty(n_out, hidden, dtype=weight_dtype), None,
        _empty(hidden // 64, rows, dtype=torch.float32), 1e-6, _empty(rows, dtype=torch.int64),
        _empty(4096, head_dim), _empty(blocks, 16, kv_heads, head_dim), _empty(blocks, 16, kv_heads, head_dim),
        _empty(rows, dtype=torch.int64), heads, kv_heads, norm, norm, weight_scale=scale,
        one_row=one_row or "tuned",
    )  # fmt: skip


def fp8_projections_launches() -> list[Launch]:
    """The small-batch projections on e4m3 weights at one row, as `choose_config` tiles them from
    TUNED_FP8_LINEAR_CONFIGS: the 8B's o, gate/up and down, and Qwen3-30B-A3B's o."""
    fp8, scale = FP8_E4M3, torch.float32
    with recording() as launches:
        for hidden, attention, inter in ((4096, 4096, 14336), (2048, 4096, None)):
            residual, gamma = _empty(1, hidden), _empty(hidden)
            small_batch_linear.linear_rows_into_residual_triton(_empty(1, attention), _empty(hidden, attention,
                dtype=fp8), residual, gamma, weight_scale=_empty(hidden, dtype=scale))  # fmt: skip
            if inter is None:
                continue
            partials = _empty(hidden // 32, 1, dtype=torch.float32)
            small_batch_linear.linear_rows_triton(_empty(1, hidden), _empty(2 * inter, hidden, dtype=fp8), None,
                partials, 1e-6, gated=True, weight_scale=_empty(2 * inter, dtype=scale))  # fmt: skip
            small_batch_linear.linear_rows_into_residual_triton(_empty(1, inter), _empty(hidden, inter, dtype=fp8),
                residual, gamma, weight_scale=_empty(hidden, dtype=scale))  # fmt: skip
    return launches


def qwen3_30b_a3b_fp8_experts_launches() -> list[Launch]:
    """Qwen3-30B-A3B's FP8 experts: the small-batch kernels at every token count of their table (the FP8 entries where
    there are, else the 16-bit ones), the grouped GEMMs W8A16 at 64 and 256 tokens (the tuned tiles) and W8A8 at
    1024 and 4096 (the default tiles, with the activations' threshold set as a measured one would be)."""
    hidden, experts, top_k, inter = 2048, 128, 8, 768
    w13, w2 = _empty(experts, 2 * inter, hidden, dtype=FP8_E4M3), _empty(experts, hidden, inter, dtype=FP8_E4M3)
    scales = ExpertScales(_empty(experts, 2 * inter, dtype=torch.float32), _empty(experts, hidden, dtype=torch.float32))
    threshold = moe_config.FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT
    moe_config.FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT = 32
    try:
        with recording() as launches:
            for tokens, _ in TUNED_SMALL_BATCH_CONFIGS[(experts, top_k, hidden, inter)]:
                logits = _empty(tokens, experts, dtype=torch.float32)
                config = small_batch_moe_config(tokens, top_k, experts, hidden, inter, fp8_experts=True)
                fused_moe.fused_moe_triton(_empty(tokens, hidden), w13, w2, logits, top_k, True, config, scales)
            for tokens in (64, 256, 1024, 4096):
                weights, ids = _empty(tokens, top_k, dtype=torch.float32), _empty(tokens, top_k, dtype=torch.int32)
                fused_moe.fused_moe_experts_triton(_empty(tokens, hidden), w13, w2, weights, ids,
                                                   allow_small_batch=False, scales=scales)  # fmt: skip
    finally:
        moe_config.FP8_ACTIVATIONS_MIN_ROWS_PER_EXPERT = threshold
    return launches


def whole_head_256_launches() -> list[Launch]:
    """The whole-head qkv (q/k norm folded in) at head_dim 256, which no supported family has yet: its defaults
    were timed at 128 only, so at least they should not spill when such a model comes."""
    with recording() as launches:
        _qkv(4096, 16, 4, 256, qk_norm=True)
    return launches


def one_row_qkv_launches() -> list[Launch]:
    """The one-row qkv (`one_row_qkv_kernel`) at configs its sweep may pick, on e4m3 weights: Qwen3-30B-A3B's with
    the q/k norms (several programs a head), the 8B's without; and Qwen3's as its FP8 table entry launches it
    (the bf16 entry shows in the model's own launches)."""
    with recording() as launches:
        _qkv(2048, 32, 4, 128, qk_norm=True, weight_dtype=FP8_E4M3)  # TUNED_ONE_ROW_QKV_CONFIGS at one row
        for config in (OneRowConfig(4, 1024, 4), OneRowConfig(8, 512, 8), OneRowConfig(16, 1024, 8)):
            _qkv(2048, 32, 4, 128, qk_norm=True, one_row=config, weight_dtype=FP8_E4M3)
            _qkv(4096, 32, 8, 128, qk_norm=False, one_row=config, weight_dtype=FP8_E4M3)
    return launches


def weights_first_launches() -> list[Launch]:
    """Qwen3-30B-A3B's one-row projections as weights-first programs (`OneRowConfig.weights_first`: whole rows held
    in registers through the wait), at fixed tiles (the tables' own show in the model's launches, which take them
    at one row): the FP8 o into the residual, the 16-bit router, the FP8 qkv with its q/k norms."""
    hidden, attention, experts, heads, kv_heads, head_dim = 2048, 4096, 128, 32, 4, 128
    with recording() as launches:
        small_batch_linear.linear_rows_into_residual_triton(
            _empty(1, attention), _empty(hidden, attention, dtype=FP8_E4M3), _empty(1, hidden), _empty(hidden),
            config=OneRowConfig(8, 2048, 8, weights_first=True), weight_scale=_empty(hidden, dtype=torch.float32),
        )  # fmt: skip
        small_batch_linear.linear_rows_triton(_empty(1, hidden), _empty(experts, hidden), None,
                                              _empty(256, 1, dtype=torch.float32), 1e-6,
                                              config=OneRowConfig(2, 2048, 8, weights_first=True))  # fmt: skip
        _qkv(hidden, heads, kv_heads, head_dim, qk_norm=True, one_row=OneRowConfig(2, 1024, 2, weights_first=True),
             weight_dtype=FP8_E4M3)  # fmt: skip
    return launches


def _decode_attention(batch: int, heads: int, kv_heads: int, cache_dtype: torch.dtype, num_splits: int,
                      early_first_tile: bool) -> None:  # fmt: skip
    """One decode attention launch over a 4096-token table of 16-token pages (head_dim 128), the cache in the layout
    its dtype takes. The splits and the early tile are given as an H100/H200 (132 multiprocessors) chooses them:
    this machine's CPU count would choose others."""
    head_dim, block_size, width = 128, 16, 256
    block_shape = (block_size, kv_heads, head_dim)
    k_cache, v_cache = new_kv_cache_pair(batch * width, block_shape, cache_dtype, torch.device("cpu"))
    decode_attention.paged_decode_attention_triton(
        _empty(batch, heads, head_dim), k_cache, v_cache, _empty(batch, width, dtype=torch.int32),
        _empty(batch, dtype=torch.int32), head_dim**-0.5, num_splits=num_splits, early_first_tile=early_first_tile,
    )  # fmt: skip


def decode_attention_launches() -> list[Launch]:
    """Decode attention as the engine launches it on an H100/H200: Qwen3-30B-A3B's heads (32 q, 4 KV) over an FP8
    cache (V tokens innermost) at one sequence (16 splits, each one's first tile read before the wait as the engine
    launches it, and not, as TIDAL_DECODE_EARLY_TILE=0 asks) and at 256 (unsplit, the many-programs tile); the
    8B's (32 q, 8 KV) over a bf16 cache at one sequence, its first tiles early."""
    with recording() as launches:
        _decode_attention(1, 32, 4, FP8_E4M3, num_splits=16, early_first_tile=True)
        _decode_attention(1, 32, 4, FP8_E4M3, num_splits=16, early_first_tile=False)  # TIDAL_DECODE_EARLY_TILE=0
        _decode_attention(256, 32, 4, FP8_E4M3, num_splits=1, early_first_tile=False)
        _decode_attention(1, 32, 8, torch.bfloat16, num_splits=12, early_first_tile=True)
    return launches


MODELS: dict[str, Callable[[], list[Launch]]] = {
    "qwen3-30b-a3b": qwen3_30b_a3b_launches,
    "llama3-8b": llama3_8b_launches,
    "qkv-head-dim-256": whole_head_256_launches,
    "qwen3-30b-a3b-fp8-experts": qwen3_30b_a3b_fp8_experts_launches,
    "fp8-projections": fp8_projections_launches,
    "one-row-qkv": one_row_qkv_launches,
    "weights-first": weights_first_launches,
    "decode-attention": decode_attention_launches,
}


def report(models: list[str]) -> list[tuple[str, str, Resources]]:
    """(model, launch, its resources) for every distinct launch of the models' small-batch steps."""
    rows: list[tuple[str, str, Resources]] = []
    for model in models:
        seen: set[str] = set()
        for launch in MODELS[model]():
            bound = bind_sm90(launch)
            if bound.key() not in seen:
                seen.add(bound.key())
                rows.append((model, bound.describe(), _compiled_resources(bound)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), nargs="+", default=sorted(MODELS))
    args = parser.parse_args()
    spilled = 0
    for model, name, res in report(args.model):
        spills = res.spill_store_bytes + res.spill_load_bytes
        spilled += spills > 0
        print(f"{model:<14} regs {res.registers:>3}  spill st/ld {res.spill_store_bytes:>5}/{res.spill_load_bytes:<5} "
              f"smem {res.shared_bytes:>6}  {name}", flush=True)  # fmt: skip
    print(f"{spilled} launch(es) spill registers" if spilled else "no launch spills registers")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
