"""One-row projections: the engine's row-parallel GEMV (`OneRowConfig`) against its tiled `linear_rows`, per shape.

step_floor.py showed that a batch-1 decode step's chain of launches can stream its bytes in about half the time the
engine's kernels took, if every launch keeps enough programs resident. `kernels/_one_row_kernels.py` is the shape of
kernel that does: each program owns a few whole weight rows (no split of K, no partials), thousands of programs.
`TUNED_ONE_ROW_CONFIGS` routes a shape to it only where this sweep measured it faster, so this script prints, per
projection of the two benchmark models, the tiled kernel's time, the one-row configs' best few, and the table entry
to add when one wins (--write-table FILE keeps them for profile_steps.py --one-row-table FILE, where the decode step
decides).

Each timed graph runs the projection with the epilogue the decode step gives it (o and down into the residual with
the next norm's input, the router with the row scale, gate/up gated, the fused qkv with its rotary, q/k norm and
cache write) over enough distinct weight sets to
pass the L2 (48 layers where they fit in 400 MB), with PDL between launches as the engine launches them.

    cd benchmarks/kernels && python probe_row_gemv.py [--shapes qwen3-o qwen3-router ...] [--weight-dtype fp8|bf16]
        [--write-table FILE]

(Its first run, in 0519273, timed a private copy of the products loop without epilogues: probe-row-gemv-h100.txt.)
`tests/kernels/test_probe_row_gemv.py` runs its cases small on a CPU (interpreted), to keep the script working.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))

from common import graph_ms
from perf import tuned_tables

from tidal.kernels.fp8_linear import quantize_rows
from tidal.kernels.rotary import build_cos_sin_cache
from tidal.kernels.rotary_store_kv import HeadNorm
from tidal.kernels.small_batch_linear import (
    WEIGHTS_FIRST_BYTES_PER_THREAD,
    LaunchConfig,
    OneRowConfig,
    choose_config,
    linear_rows_into_residual_triton,
    linear_rows_reference,
    linear_rows_triton,
)
from tidal.kernels.small_batch_qkv import qkv_rope_store_reference, qkv_rope_store_triton

# A config for `Case.run`: None is the engine's choice (the one-row tables, else the tiled kernel), "tiled" the tiled
# kernel on its defaults, a LaunchConfig the tiled kernel on that tile (not for qkv), a OneRowConfig the row GEMV.
Config = LaunchConfig | OneRowConfig | Literal["tiled"] | None


@dataclass(frozen=True)
class Projection:
    n_out: int  # outputs (gated: of gate and of up each)
    k_in: int
    epilogue: str  # "residual", "row_scale", "gated" (with the row scale), "plain", or "qkv" (rotary, cache write)
    fp8_capable: bool = True  # the router and the LM heads stay 16-bit in every weight mode
    heads: tuple[int, int, int] = (0, 0, 0)  # qkv: query heads, KV heads, head_dim
    qk_norm: bool = False  # qkv: Qwen3's per-head q/k norms


PROJECTIONS = {
    "qwen3-qkv": Projection(5120, 2048, "qkv", heads=(32, 4, 128), qk_norm=True),
    "qwen3-o": Projection(2048, 4096, "residual"),
    "qwen3-router": Projection(128, 2048, "row_scale", fp8_capable=False),
    "qwen3-lm-head": Projection(151936, 2048, "plain", fp8_capable=False),
    "llama3-qkv": Projection(6144, 4096, "qkv", heads=(32, 8, 128)),
    "llama3-o": Projection(4096, 4096, "residual"),
    "llama3-gate-up": Projection(14336, 4096, "gated"),
    "llama3-down": Projection(4096, 14336, "residual"),
    "llama3-lm-head": Projection(128256, 4096, "plain", fp8_capable=False),
}
LAYER_BYTES_BUDGET = 400 * 2**20


def one_row_variants(gated: bool, k_in: int, weight_itemsize: int) -> list[OneRowConfig]:
    """Rows a program x inputs a load x warps: at most 64 fp32 products a thread (32 when gated: two accumulators),
    at least 1,024 weights a load; then the weights-first programs (whole rows loaded before the wait) whose rows
    fit their register budget."""
    limit = 32 if gated else 64
    streamed = [
        OneRowConfig(rows, block_k, warps)
        for rows, block_k, warps in itertools.product((1, 2, 4, 8, 16), (512, 1024, 2048), (2, 4, 8))
        if 1024 <= rows * block_k <= limit * 32 * warps
    ]
    whole = triton.next_power_of_2(k_in)
    candidates = [
        OneRowConfig(rows, whole, warps, weights_first=True)
        for rows, warps in itertools.product((1, 2, 4, 8, 16), (2, 4, 8))
    ]
    held = 2 if gated else 1
    weights_first = [
        v for v in candidates
        if v.held_bytes_per_thread(k_in, held * v.block_n, weight_itemsize) <= WEIGHTS_FIRST_BYTES_PER_THREAD
    ]  # fmt: skip
    return streamed + weights_first


class Case:
    """One projection's weights over several layers and one step's inputs, and a call of it with a config."""

    def __init__(self, projection: Projection, fp8: bool, device: torch.device, layers: int | None = None) -> None:
        self.projection, self.fp8 = projection, fp8 and projection.fp8_capable
        rows_total = 2 * projection.n_out if projection.epilogue == "gated" else projection.n_out
        layer_bytes = rows_total * projection.k_in * (1 if self.fp8 else 2)
        self.layers = layers or max(4, min(48, LAYER_BYTES_BUDGET // layer_bytes))
        self.weights = []
        for _ in range(self.layers):
            w = torch.randn(rows_total, projection.k_in, device=device, dtype=torch.bfloat16) / projection.k_in**0.5
            self.weights.append(quantize_rows(w) if self.fp8 else (w, None))
        self.layer_bytes = layer_bytes
        self.a = torch.randn(1, projection.k_in, device=device, dtype=torch.bfloat16)
        self.partials = torch.rand(16, 1, device=device) * projection.k_in / 16 + 0.5
        self.residual = torch.randn(1, projection.n_out, device=device, dtype=torch.bfloat16)
        self.gamma = torch.rand(projection.n_out, device=device, dtype=torch.bfloat16) + 0.5
        _, kv_heads, head_dim = projection.heads
        if projection.epilogue == "qkv":
            self.cos_sin = build_cos_sin_cache(head_dim, 256, 10000.0, None, torch.bfloat16, device)
            self.positions = torch.tensor([159], device=device)
            self.slots = torch.tensor([21], device=device)
            self.caches = [torch.zeros(4, 16, kv_heads, head_dim, device=device, dtype=torch.bfloat16) for _ in "kv"]
            norm = [HeadNorm(torch.rand(head_dim, device=device, dtype=torch.bfloat16) + 0.5, 1e-6) for _ in "qk"]
            self.norms = norm if projection.qk_norm else [None, None]

    def run(self, layer: int, config: Config) -> torch.Tensor:
        w, scale = self.weights[layer]
        epilogue = self.projection.epilogue
        if epilogue == "qkv":  # its tiled kernel takes its own defaults
            one_row = config if isinstance(config, OneRowConfig) else "off" if config == "tiled" else "tuned"
            return qkv_rope_store_triton(self.a, w, None, self.partials, 1e-6, self.positions, self.cos_sin,
                                         *self.caches, self.slots, *self.projection.heads[:2], *self.norms,
                                         weight_scale=scale, one_row=one_row)  # fmt: skip
        if config == "tiled":
            config = choose_config(self.projection.n_out, self.projection.k_in, epilogue == "gated", self.fp8)
        if epilogue == "residual":
            return linear_rows_into_residual_triton(self.a, w, self.residual, self.gamma, None, config, scale)[0]
        if epilogue == "plain":
            return linear_rows_triton(self.a, w, config=config, weight_scale=scale)
        return linear_rows_triton(self.a, w, None, self.partials, 1e-6, gated=epilogue == "gated", config=config,
                                  weight_scale=scale)  # fmt: skip

    def reference(self) -> torch.Tensor:
        w, scale = self.weights[0]
        epilogue = self.projection.epilogue
        partials = self.partials if epilogue in ("row_scale", "gated", "qkv") else None
        if epilogue == "qkv":
            caches = [c.clone() for c in self.caches]
            return qkv_rope_store_reference(self.a, w, None, partials, 1e-6, self.positions, self.cos_sin, *caches,
                                            self.slots, *self.projection.heads[:2], *self.norms,
                                            weight_scale=scale)  # fmt: skip
        y = linear_rows_reference(self.a, w, None, partials, 1e-6, gated=epilogue == "gated", weight_scale=scale)
        return (y.float() + self.residual.float()).to(y.dtype) if epilogue == "residual" else y

    def us_per_layer(self, config: Config) -> float:
        def chain() -> None:
            for layer in range(self.layers):
                self.run(layer, config)

        chain()  # compiles outside the capture
        return graph_ms(chain) * 1e3 / self.layers


def relative_error(case: Case, config: Config) -> float:
    got, want = case.run(0, config).float(), case.reference().float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


class Winners:
    """The one-row entries a sweep found, per table, and the keys it probed (those it found none for included)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuned_tables.Table] = {"linear": {}, "qkv": {}}
        self.probed: dict[str, set[tuple]] = {"linear": set(), "qkv": set()}


def table_key(case: Case) -> tuple[str, tuple]:
    """(which table, the key) of a case's shape, as the kernels' wrappers look it up."""
    p = case.projection
    if p.epilogue == "qkv":
        return "qkv", (p.heads[0], p.heads[1], p.heads[2], p.k_in, p.qk_norm, case.fp8)
    return "linear", (p.n_out, p.k_in, p.epilogue == "gated", case.fp8)


def probe(name: str, fp8: bool, device: torch.device, top: int, winners: Winners) -> None:
    projection = PROJECTIONS[name]
    case = Case(projection, fp8, device)
    qkv = projection.epilogue == "qkv"
    gated = projection.epilogue == "gated"
    kind = "e4m3" if case.fp8 else "bf16"
    print(f"\n# {name}: {projection.n_out} x {projection.k_in} {kind}, {projection.epilogue}, "
          f"{case.layer_bytes / 1e6:.2f} MB a layer, {case.layers} layers")  # fmt: skip
    tiled_us = case.us_per_layer("tiled")
    engine_us = case.us_per_layer(None)
    tiled = "qkv defaults" if qkv else choose_config(projection.n_out, projection.k_in, gated, case.fp8)
    print(f"{tiled_us:8.2f} us {case.layer_bytes / tiled_us / 1e6:5.2f} TB/s  tiled {tiled}")
    print(f"{engine_us:8.2f} us {case.layer_bytes / engine_us / 1e6:5.2f} TB/s  the engine's choice today")
    timed = []
    # A qkv program holds a rotary pair's two rows a dim (two accumulators, as gated), at most the half-head's dims.
    half = projection.heads[2] // 2
    itemsize = 1 if case.fp8 else 2
    variants = [v for v in one_row_variants(gated or qkv, projection.k_in, itemsize) if not qkv or v.block_n <= half]
    for config in variants:
        timed.append((case.us_per_layer(config), config, relative_error(case, config)))
    timed.sort(key=lambda row: row[0])
    for us, config, err in timed[:top]:
        print(f"{us:8.2f} us {case.layer_bytes / us / 1e6:5.2f} TB/s  {config} (err {err:.1e})")
    best_us, best, _ = timed[0]
    table, key = table_key(case)
    winners.probed[table].add(key)
    if best_us < 0.97 * tiled_us:
        winners.entries[table][key] = best
        source_table = "TUNED_ONE_ROW_QKV_CONFIGS" if qkv else "TUNED_ONE_ROW_CONFIGS"
        print(f"{source_table} entry: {key}: {best}  # {best_us:.2f} us against {tiled_us:.2f} tiled; the step decides")
    else:
        print("no entry: the tiled kernel is within 3% or faster")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(PROJECTIONS), default=sorted(PROJECTIONS))
    parser.add_argument("--weight-dtype", choices=["fp8", "bf16"], default="fp8")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument(
        "--write-table", type=pathlib.Path, metavar="FILE",
        help="merge the entries found into FILE (perf/tuned_tables.py) for profile_steps.py --one-row-table",
    )  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}; {args.weight_dtype} weights where the engine quantizes them")
    winners = Winners()
    for name in args.shapes:
        probe(name, args.weight_dtype == "fp8", device, args.top, winners)
        torch.cuda.empty_cache()
    if args.write_table is not None:
        for table in (t for t in ("linear", "qkv") if winners.probed[t]):  # a table not probed stays unnamed
            tuned_tables.merge_into(args.write_table, table, winners.entries[table], winners.probed[table])
        print(f"\nentries written to {args.write_table}: {tuned_tables.read(args.write_table)}")


if __name__ == "__main__":
    main()
