"""The small-batch kernels' launches compiled for sm_90 spill no registers (benchmarks/kernels/register_report.py):
ptxas from the triton wheel, no GPU needed. Both checks run in a fresh interpreter without TRITON_INTERPRET, which
this folder's conftest sets on a CPU and which would hand the compiler interpreted kernels."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "kernels" / "register_report.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=540)


@pytest.mark.slow
def test_tuned_launches_spill_no_registers() -> None:
    result = _run(str(SCRIPT))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no launch spills registers" in result.stdout
    # The 1-token gate/up entry asks for four K steps in flight: Triton pipelines them through shared memory.
    (pipelined,) = [
        line
        for line in result.stdout.splitlines()
        if line.startswith("qwen3-30b-a3b ") and "pair_gate_up_kernel [num_tokens=1" in line
    ]
    assert "STAGES=4" in pipelined and int(pipelined.split("smem")[1].split()[0]) > 0, pipelined
    # Every kernel of both models' small-batch steps was compiled and reported.
    for kernel in ("pair_gate_up_kernel", "token_down_kernel", "topk_softmax_kernel", "linear_rows_kernel",
                   "one_row_linear_kernel", "qkv_rope_kernel"):  # fmt: skip
        assert kernel in result.stdout, result.stdout
    # FP8 experts: the grouped GEMMs W8A16 and W8A8 (e4m3 operands on the tensor cores) compile for sm_90 unspilled.
    assert "W_SCALED=1 A_SCALED=0" in result.stdout and "W_SCALED=1 A_SCALED=1" in result.stdout, result.stdout
    # The projections on e4m3 weights take their own table's wide, split tiles (TUNED_FP8_LINEAR_CONFIGS).
    fp8_projections = [line for line in result.stdout.splitlines() if line.startswith("fp8-projections ")]
    assert any("SPLIT_K=4 BLOCK_M=16 BLOCK_N=128 BLOCK_K=256" in line for line in fp8_projections), result.stdout


SPILLING_DOWN_PASS = """
import sys
import torch
sys.path.insert(0, "benchmarks/kernels")
from register_report import _empty, recording, sm90_resources
import tidal.kernels.fused_moe as fused_moe
from tidal.kernels._moe_small_batch_config import GemvTiles, SmallBatchMoeConfig

# One warp holding eight pairs' 32 x 128 tiles of W2 a step: 1,024 fp32 a thread, past the 255 registers it may use.
tiles = GemvTiles(32, 128, 1)
config = SmallBatchMoeConfig(tiles, tiles, down_splits=1)
with recording() as launches:
    fused_moe.fused_moe_triton(_empty(1, 2048), _empty(128, 1536, 2048), _empty(128, 2048, 768),
                               _empty(1, 128, dtype=torch.float32), 8, True, config)
(down,) = [launch for launch in launches if launch.kernel.__name__ == "token_down_kernel"]
print(sm90_resources(down).spill_store_bytes)
"""


@pytest.mark.slow
def test_the_report_sees_a_spill() -> None:
    """The check can fail: a down-pass tile too large for one warp's registers is reported as spilling."""
    result = _run("-c", SPILLING_DOWN_PASS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert int(result.stdout.split()[-1]) > 0


SWAPPED_OPERANDS = """
import re
import sys
import torch
import triton
sys.path.insert(0, "benchmarks/kernels")
from register_report import SM90, ASTSource, _empty, bind_sm90, recording
import tidal.kernels.fused_moe as fused_moe
from tidal.kernels._moe_config import GemmTiles, MoeConfig
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.kernels.moe_expert_scales import ExpertScales

# Qwen3-30B-A3B's e4m3 experts at 256 tokens: the gate/up pass with 16-row blocks, plain and swapped.
w13, w2 = _empty(128, 1536, 2048, dtype=FP8_E4M3), _empty(128, 2048, 768, dtype=FP8_E4M3)
scales = ExpertScales(_empty(128, 1536, dtype=torch.float32), _empty(128, 2048, dtype=torch.float32))
for swap in (False, True):
    tiles = GemmTiles(64, 128, 4, 3, swap_ab=swap)
    with recording() as launches:
        fused_moe.fused_moe_experts_triton(_empty(256, 2048), w13, w2, _empty(256, 8, dtype=torch.float32),
                                           _empty(256, 8, dtype=torch.int32), MoeConfig(16, tiles, tiles),
                                           allow_small_batch=False, scales=scales)
    gate_up = bind_sm90([l for l in launches if l.kernel.__name__ == "grouped_gemm_kernel"][0])
    source = ASTSource(fn=gate_up.kernel, signature=gate_up.signature, constexprs=gate_up.constexprs,
                       attrs=gate_up.attrs)
    compiled = triton.compile(source, target=SM90, options=gate_up.options.__dict__)
    dots = [line for line in compiled.asm["ttgir"].splitlines() if "ttng.warp_group_dot " in line]
    # The first operand (%w..., the weight tile) typed as a register tensor in wgmma's operand layout.
    register_weights = any(re.search(r"warp_group_dot %w\\w*, .*\\} : tensor<\\w+, #ttg.dot_op<\\{opIdx = 0", d)
                           for d in dots)
    print(swap, len(re.findall(r"wgmma\\.mma_async", compiled.asm["ptx"])), register_weights)
"""


@pytest.mark.slow
def test_swapped_fp8_tiles_put_the_widened_weights_in_wgmma_registers() -> None:
    """Why `GemmTiles.swap_ab` pays for e4m3 experts: unswapped, 16-row blocks compile to mma.sync; swapped, the
    widened weight tile is wgmma's register operand (a Triton upgrade that changes this should be seen)."""
    result = _run("-c", SWAPPED_OPERANDS)
    assert result.returncode == 0, result.stdout + result.stderr
    plain, swapped = (line.split() for line in result.stdout.strip().splitlines()[-2:])
    assert plain == ["False", "0", "False"], result.stdout
    assert swapped[0] == "True" and int(swapped[1]) > 0 and swapped[2] == "True", result.stdout


WEIGHTS_FIRST_ORDER = """
import sys
import triton
sys.path.insert(0, "benchmarks/kernels")
from register_report import SM90, ASTSource, _empty, bind_sm90, recording, weights_first_launches
import tidal.kernels.small_batch_linear as small_batch_linear
from tidal.kernels.kv_cache_dtype import FP8_E4M3

def weight_loads_around_the_wait(launch):
    bound = bind_sm90(launch)
    source = ASTSource(fn=bound.kernel, signature=bound.signature, constexprs=bound.constexprs, attrs=bound.attrs)
    ptx = triton.compile(source, target=SM90, options=bound.options.__dict__).asm["ptx"].splitlines()
    (wait,) = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    # The weight loads are the only ones marked evict-first.
    loads = [i for i, line in enumerate(ptx) if "ld.global" in line and "evict_first" in line]
    return sum(i < wait for i in loads), sum(i > wait for i in loads)

for launch in weights_first_launches():
    print(launch.kernel.__name__, *weight_loads_around_the_wait(launch))
with recording() as launches:  # the same o projection streamed: every weight load after the wait
    small_batch_linear.linear_rows_into_residual_triton(
        _empty(1, 4096), _empty(2048, 4096, dtype=FP8_E4M3), _empty(1, 2048), _empty(2048),
        config=small_batch_linear.OneRowConfig(8, 2048, 8), weight_scale=_empty(2048, dtype=torch.float32))
print("streamed", *weight_loads_around_the_wait(launches[0]))
"""


@pytest.mark.slow
def test_weights_first_programs_issue_their_weight_loads_before_the_wait() -> None:
    """`OneRowConfig.weights_first` pays only if the compiler keeps the whole rows' loads ahead of
    griddepcontrol.wait; a compiler that sank them to their use would silently make it a plain launch."""
    result = _run("-c", "import torch\n" + WEIGHTS_FIRST_ORDER)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [(kernel, int(before), int(after))
            for kernel, before, after in (line.split() for line in result.stdout.strip().splitlines())]  # fmt: skip
    # The o projection and the router, then the qkv: all their weight loads ahead of the wait.
    assert [kernel for kernel, _, _ in rows[:-1]] == ["one_row_linear_kernel"] * 2 + ["one_row_qkv_kernel"]
    assert all(before > 0 and after == 0 for _, before, after in rows[:-1]), result.stdout
    assert rows[-1][0] == "streamed" and rows[-1][1] == 0 and rows[-1][2] > 0, result.stdout


EARLY_TILE_ORDER = """
import sys
import triton
sys.path.insert(0, "benchmarks/kernels")
from register_report import SM90, ASTSource, bind_sm90, decode_attention_launches

for launch in decode_attention_launches():
    bound = bind_sm90(launch)
    source = ASTSource(fn=bound.kernel, signature=bound.signature, constexprs=bound.constexprs, attrs=bound.attrs)
    ptx = triton.compile(source, target=SM90, options=bound.options.__dict__).asm["ptx"].splitlines()
    (wait,) = [i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line]
    loads = [i for i, line in enumerate(ptx) if "ld.global" in line]
    print(int(bound.constants["EARLY_FIRST_TILE"]), sum(i < wait for i in loads), sum(i > wait for i in loads))
"""


@pytest.mark.slow
def test_decode_attention_reads_its_first_tile_before_the_wait_only_where_asked() -> None:
    """EARLY_FIRST_TILE pays only if the compiler keeps the first tile's loads ahead of griddepcontrol.wait. A tile
    of 64 tokens x 128 dims on 4 warps is 64 bytes of K and 64 of V a thread: at least 8 loads of 16 bytes, beside
    the table's; the plain launch reads nothing before the wait."""
    result = _run("-c", EARLY_TILE_ORDER)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [tuple(map(int, line.split())) for line in result.stdout.strip().splitlines()]
    # Qwen3's FP8 cache at one sequence (early, plain), at 256 (plain); the 8B's bf16 cache at one sequence (early).
    assert [early for early, _, _ in rows] == [1, 0, 0, 1], result.stdout
    assert all(before >= 8 and after > 0 for early, before, after in rows if early), result.stdout
    assert [before for early, before, _ in rows if not early] == [0, 0], result.stdout
