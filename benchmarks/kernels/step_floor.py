"""The floor of a batch-1 decode step's launch structure: the same chain of launches, each a perfect streaming read.

A batch-1 decode step is a chain of dependent launches (Qwen3-30B-A3B: six a layer, 289 in all), each reading its
weights once. This benchmark replaces every launch with a kernel that only streams the same number of bytes from
its own buffer (no arithmetic worth the name), captures the chain in a CUDA graph as the engine does, and times it.
What it measures is therefore what no kernel written for that launch structure can beat:

- `one launch`: all of the step's bytes in a single kernel, the device's own copy rate for this read;
- `chain, PDL`: the chain with programmatic dependent launch, each kernel waiting before its reads and letting the
  next launch after them (the engine's kernels do the same);
- `chain, PDL early`: the next launch allowed right after the wait, so its programs sit resident while this runs;
- `chain, no PDL`: plain stream order;
- `empty chain`: the same launches reading nothing, the latency of a dependent launch alone.

The launch list is computed from the preset's shape (perf/presets.py) and the engine's batch-1 kernels, so the bytes
match the step's bound. Run on the GPU:

    cd benchmarks/kernels && python step_floor.py --preset qwen3-30b-a3b --weight-dtype fp8
    cd benchmarks/kernels && python step_floor.py --preset qwen3-30b-a3b --weight-dtype bf16
    cd benchmarks/kernels && python step_floor.py --preset llama3-8b --weight-dtype bf16

On a CPU (`TRITON_INTERPRET=1 ... --smoke`) it runs a few small launches to check the code, not to time anything.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for perf.presets

from perf.presets import PRESETS

from tidal.kernels._device import multiprocessor_count, pdl_launch_options
from tidal.kernels._triton_utils import let_next_kernel_launch, wait_for_previous_kernel

WORDS_PER_LOAD = 1024  # int32 words a program loads at a time: 4 KiB, a vector of 8 words a thread at 4 warps


@dataclass(frozen=True)
class Launch:
    name: str
    num_bytes: int


def batch1_launches(preset_name: str, weight_bytes: float, context: int) -> list[Launch]:
    """The engine's batch-1 decode launches for a preset, with the bytes each reads (weights; attention its cache).

    Dense layers: fused norm + qkv + rotary, attention, o (+ residual), fused norm + gate/up, down (5 a layer).
    MoE layers: qkv + rotary, attention, o, router, the experts' gate/up, their down (6 a layer). Then the LM head,
    kept in bf16 as the engine keeps it. The router stays bf16 too (it is 0.5 MB a layer)."""
    config = PRESETS[preset_name].overrides
    hidden, layers, head_dim = config["hidden_size"], config["num_hidden_layers"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    vocab = PRESETS[preset_name].vocab_size or 512
    qkv = int(hidden * (heads + 2 * kv_heads) * head_dim * weight_bytes)
    kv_cache = context * kv_heads * head_dim * 2 * 1  # an FP8 cache: ~ nothing next to the weights either way
    o_proj = int(heads * head_dim * hidden * weight_bytes)
    experts = config.get("num_experts", 0)
    per_layer = [Launch("qkv", qkv), Launch("attention", kv_cache), Launch("o", o_proj)]
    if experts:
        top_k, width = config["num_experts_per_tok"], config["moe_intermediate_size"]
        per_layer += [
            Launch("router", hidden * experts * 2),
            Launch("gate_up", int(top_k * 2 * width * hidden * weight_bytes)),
            Launch("down", int(top_k * width * hidden * weight_bytes)),
        ]
    else:
        width = config["intermediate_size"]
        per_layer += [
            Launch("gate_up", int(2 * width * hidden * weight_bytes)),
            Launch("down", int(width * hidden * weight_bytes)),
        ]
    return [launch for _ in range(layers) for launch in per_layer] + [Launch("lm_head", vocab * hidden * 2)]


@triton.jit
def stream_kernel(
    src_ptr,
    out_ptr,
    num_words,
    WORDS_PER_PROGRAM: tl.constexpr,
    BLOCK: tl.constexpr,
    READ: tl.constexpr,
    EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program p sums (as int32, wrapping) words [p * WORDS_PER_PROGRAM, ...) of src and stores one word, so the loads
    cannot be dropped. The wait comes first, as in a kernel that reads the previous kernel's output."""
    wait_for_previous_kernel(USE_PDL)
    if EARLY:
        let_next_kernel_launch(USE_PDL)
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    if READ:
        start = pid.to(tl.int64) * WORDS_PER_PROGRAM
        for offset in range(0, WORDS_PER_PROGRAM, BLOCK):
            words = start + offset + tl.arange(0, BLOCK)
            acc += tl.load(src_ptr + words, mask=words < num_words, other=0, eviction_policy="evict_first")
    if not EARLY:
        let_next_kernel_launch(USE_PDL)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@dataclass(frozen=True)
class Prepared:
    buffer: torch.Tensor  # int32 words
    programs: int
    words_per_program: int


def prepare(launch: Launch, device: torch.device, programs_per_sm: int) -> Prepared:
    words = max(1, -(-launch.num_bytes // 4))
    # As many programs as the device holds at `programs_per_sm` each, but no program with less than one load.
    programs = max(1, min(multiprocessor_count(device) * programs_per_sm, -(-words // WORDS_PER_LOAD)))
    per_program = -(-words // programs)
    per_program = -(-per_program // WORDS_PER_LOAD) * WORDS_PER_LOAD
    buffer = torch.ones(words, dtype=torch.int32, device=device)
    return Prepared(buffer, programs, per_program)


def run_chain(chain: list[Prepared], out: torch.Tensor, *, read: bool, early: bool, pdl: bool) -> None:
    options = pdl_launch_options(out.device) if pdl else {"USE_PDL": False, "launch_pdl": False}
    for item in chain:
        stream_kernel[(item.programs,)](
            item.buffer, out, item.buffer.numel(), item.words_per_program, WORDS_PER_LOAD, read, early, **options
        )


def graph_us(fn, replays: int) -> float:
    """Mean microseconds of one replay of fn captured in a CUDA graph (fn has run once: Triton compiled outside)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--weight-dtype", default="fp8", choices=["fp8", "bf16"])
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="a few small launches, to check the code on a CPU")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    launches = batch1_launches(args.preset, 1.0 if args.weight_dtype == "fp8" else 2.0, args.context)
    if args.smoke:
        launches = [Launch(launch.name, min(launch.num_bytes, 1 << 16)) for launch in launches[:7]]
    total = sum(launch.num_bytes for launch in launches)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {args.preset}, {args.weight_dtype} weights, batch 1, context {args.context}: {len(launches)} launches, "
          f"{total / 1e9:.3f} GB; device {name}")  # fmt: skip
    out = torch.zeros(multiprocessor_count(device) * max(args.programs_per_sm) if device.type == "cuda" else 4096,
                      dtype=torch.int32, device=device)  # fmt: skip
    if device.type != "cuda":
        chain = [prepare(launch, device, 1) for launch in launches]
        run_chain(chain, out, read=True, early=False, pdl=False)
        expected = sum(item.buffer.numel() for item in chain)
        print(f"smoke: {len(chain)} launches ran; last program's sum {int(out[0])} (buffer of ones)")
        assert 0 < int(out[0]) <= expected
        return

    one_us = chain_us([Launch("all", total)], out, 4, dict(read=True, early=False, pdl=False), args.replays)
    print(f"one launch over {total / 1e9:.3f} GB: {one_us:8.1f} us ({total / one_us / 1e6:.2f} TB/s)")
    print("  us/step  per launch  TB/s   variant")
    variants = {
        "chain, PDL": dict(read=True, early=False, pdl=True),
        "chain, PDL early": dict(read=True, early=True, pdl=True),
        "chain, no PDL": dict(read=True, early=False, pdl=False),
        "empty chain, PDL": dict(read=False, early=False, pdl=True),
        "empty chain, no PDL": dict(read=False, early=False, pdl=False),
    }
    for per_sm in args.programs_per_sm:
        for variant, flags in variants.items():
            us = chain_us(launches, out, per_sm, flags, args.replays)
            rate = total / us / 1e6 if flags["read"] else float("nan")
            print(f"{us:9.1f}  {us / len(launches):10.2f}  {rate:4.2f}   {variant}, {per_sm} programs a multiprocessor")


def chain_us(launches: list[Launch], out: torch.Tensor, per_sm: int, flags: dict[str, bool], replays: int) -> float:
    """One variant's graph replay time. The previous variant's buffers went with its call, so they are handed back
    to the device first: two copies of a bf16 step's 6 GB need not fit beside each other."""
    torch.cuda.empty_cache()
    chain = [prepare(launch, out.device, per_sm) for launch in launches]
    return graph_us(lambda: run_chain(chain, out, **flags), replays)


if __name__ == "__main__":
    main()
