"""The decoder's fused small-batch forward (`DecoderLayer.forward_small_batch` in worker/models/decoder.py) against
its unfused layers, on tiny models, and the small-batch kernels it launches per layer.

On CPU the kernels run under the Triton interpreter in fp16 (the interpreter's bf16 tl.dot is wrong, see
tolerances.py), with the fused path switched on by hand since it normally takes CUDA tensors only; on a GPU the same
test runs the compiled kernels in bf16.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tidal.kernels.fused_moe_small_batch as fused_moe_small_batch
import tidal.kernels.small_batch_linear as small_batch_linear
import tidal.kernels.small_batch_qkv as small_batch_qkv
import tidal.worker.layers.rotary as rotary_layer
import tidal.worker.models.decoder as decoder_module
from tidal.kernels.rotary_store_kv import rotary_store_kv_reference, rotary_store_kv_triton
from tidal.kernels.small_batch_linear import MAX_ROWS
from tidal.worker.engine.model_runner import ModelRunner
from tidal.worker.engine.step_plan import StepPlan
from tidal.worker.loader.model_loader import load_model
from tidal.worker.testing.tiny_models import write_tiny_model

BLOCK_SIZE = 4


def _prefill_then_decode_plans(prompt_len: int, num_decodes: int) -> tuple[StepPlan, StepPlan]:
    """A prefill of one prompt of whole blocks into blocks 0.., then a decode step of `num_decodes` sequences that
    share those blocks read-only and each write one token into a block of its own."""
    if prompt_len % BLOCK_SIZE:
        raise ValueError("the prompt must fill whole blocks")
    blocks = prompt_len // BLOCK_SIZE
    prefill = StepPlan(
        seq_ids=[0],
        input_ids=[(7 * i + 3) % 50 for i in range(prompt_len)],
        positions=list(range(prompt_len)),
        slot_mapping=list(range(prompt_len)),
        cu_seqlens_q=[0, prompt_len],
        seq_lens=[prompt_len],
        block_tables=[list(range(blocks))],
        sample_indices=[prompt_len - 1],
        sample_seq_ids=[0],
    )
    tables = [[*range(blocks), blocks + i] for i in range(num_decodes)]
    decode = StepPlan(
        seq_ids=list(range(num_decodes)),
        input_ids=[11 + i for i in range(num_decodes)],
        positions=[prompt_len] * num_decodes,
        slot_mapping=[t[-1] * BLOCK_SIZE for t in tables],  # the first slot of each sequence's own block
        cu_seqlens_q=list(range(num_decodes + 1)),
        seq_lens=[prompt_len + 1] * num_decodes,
        block_tables=tables,
        sample_indices=list(range(num_decodes)),
        sample_seq_ids=list(range(num_decodes)),
    )
    return prefill, decode


def _runner(
    model_dir: Path, device: torch.device, dtype: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> ModelRunner:
    def choose(hidden: torch.Tensor) -> bool:
        return fused and hidden.shape[0] <= MAX_ROWS

    monkeypatch.setattr(decoder_module, "uses_small_batch_kernels", choose)
    loaded = load_model(model_dir, dtype, device)
    runner = ModelRunner(loaded, device, BLOCK_SIZE)
    runner.allocate_kv_cache(32)
    return runner


def _run(
    model_dir: Path, device: torch.device, dtype: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> list[torch.Tensor]:
    runner = _runner(model_dir, device, dtype, fused, monkeypatch)
    prefill, decode = _prefill_then_decode_plans(prompt_len=12, num_decodes=3)
    return [runner.execute(prefill), runner.execute(decode)]  # logits [1, V] and [3, V], fp32


# plain, biased q/k/v, q/k norm; experts (Mixtral), experts beside a dense layer (Qwen3-MoE)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_fused_small_batch_forward_matches_the_unfused_layers(
    arch: str, tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = write_tiny_model(arch, tmp_path / arch)
    dev = torch.device(device)
    dtype = "bfloat16" if dev.type == "cuda" else "float16"
    want = _run(model_dir, dev, dtype, fused=False, monkeypatch=monkeypatch)
    got = _run(model_dir, dev, dtype, fused=True, monkeypatch=monkeypatch)
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item()
        torch.testing.assert_close(g, w, atol=0.03 * scale, rtol=0.03)
        assert (g.argmax(dim=-1) == w.argmax(dim=-1)).float().mean() >= 0.5


def test_qwen3_fused_qkv_with_k_split_matches_the_unfused_layers(
    tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny Qwen3's K is one step, too short for the default to split it; forced to two splits, every layer's qkv
    launch reduces through the shared arrival counters (each launch must leave them at zero for the next layer's)."""
    model_dir = write_tiny_model("qwen3", tmp_path / "qwen3")
    dev = torch.device(device)
    dtype = "bfloat16" if dev.type == "cuda" else "float16"
    want = _run(model_dir, dev, dtype, fused=False, monkeypatch=monkeypatch)
    monkeypatch.setattr(small_batch_qkv, "default_split_k", lambda *_: 2)
    got = _run(model_dir, dev, dtype, fused=True, monkeypatch=monkeypatch)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0.03 * w.abs().max().item(), rtol=0.03)


class _RecordLaunches:
    """Stands in for a Triton kernel object: `kernel[grid](...)` launches it and appends a name for the launch."""

    def __init__(self, kernel: Any, name_launch: Callable[[dict[str, Any]], str], launches: list[str]) -> None:
        self.kernel, self.name_launch, self.launches = kernel, name_launch, launches

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.launches.append(self.name_launch(kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def _projection(flags: dict[str, Any]) -> str:
    """Which of a layer's projections a `linear_rows_kernel` launch is, from its compile-time flags."""
    if flags["GATED"]:
        return "gate_up"
    if flags["INTO_RESIDUAL"]:
        return "into_residual"  # o and down
    return "normed" if flags["ROW_SCALE"] else "plain"  # normed: qkv or a router; plain: the LM head


def _qkv_projection(flags: dict[str, Any]) -> str:
    """A `qkv_rope_kernel` launch: with the input norm folded in (or not), and Qwen3's per-head q/k norm (or not)."""
    return ("qkv_rope_store" if flags["ROW_SCALE"] else "unnormed") + (" (qk norm)" if flags["QK_NORM"] else "")


_MOE_KERNELS: dict[str, Callable[[dict[str, Any]], str]] = {
    "pair_gate_up_kernel": lambda f: "moe_gate_up" + (" (routed, normed)" if f["ROUTE"] and f["ROW_SCALE"] else ""),
    "token_down_kernel": lambda f: "moe_down" + ("" if f["INTO_RESIDUAL"] else " (output only)"),
}


@pytest.mark.parametrize(
    ("arch", "per_layer"),
    [
        ("llama", ["qkv_rope_store", "into_residual", "gate_up", "into_residual"]),
        ("qwen3", ["qkv_rope_store (qk norm)", "into_residual", "gate_up", "into_residual"]),  # q/k norm folded in
        # An expert layer: the router's projection, routing + gate/up scaled by 1/rms, down into the residual stream.
        ("mixtral", ["qkv_rope_store", "into_residual", "normed", "moe_gate_up (routed, normed)", "moe_down"]),
    ],
)
def test_fused_small_batch_forward_launches_one_kernel_per_projection(
    arch: str, per_layer: list[str], tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch plan the path is tuned to (on a GPU, with the decode attention, five launches a dense layer and six
    an expert layer): another small-batch launch, or an RMSNorm or SiLU-and-mul no longer folded into a projection,
    changes this sequence."""
    dev = torch.device(device)
    dtype = "bfloat16" if dev.type == "cuda" else "float16"
    runner = _runner(write_tiny_model(arch, tmp_path / arch), dev, dtype, fused=True, monkeypatch=monkeypatch)
    prefill, decode = _prefill_then_decode_plans(prompt_len=12, num_decodes=3)
    runner.execute(prefill)
    launches: list[str] = []
    linear = _RecordLaunches(small_batch_linear.linear_rows_kernel, _projection, launches)
    qkv = _RecordLaunches(small_batch_qkv.qkv_rope_kernel, _qkv_projection, launches)
    monkeypatch.setattr(small_batch_linear, "linear_rows_kernel", linear)
    monkeypatch.setattr(small_batch_qkv, "qkv_rope_kernel", qkv)
    for name, label in _MOE_KERNELS.items():
        kernel = getattr(fused_moe_small_batch, name)
        monkeypatch.setattr(fused_moe_small_batch, name, _RecordLaunches(kernel, label, launches))
    runner.execute(decode)
    lm_head = ["plain"] if dev.type == "cuda" else []  # the LM head takes linear_rows on CUDA tensors only
    assert launches == per_layer * runner.model.kv_cache_spec.num_layers + lm_head


def test_qwen3_qk_norm_in_the_rotary_store_kernel_matches_its_reference(
    tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Qwen3 layer of the unfused forward hands its per-head q/k norms to the rotary+store kernel (no norm launches
    of their own): the kernel, fed the strided q/k/v views of the projection, gives the logits of the reference (on
    CPU the layer would call the reference, so the kernel is patched in by hand). The small-batch forward folds the
    norms into its qkv launch instead (the tests above)."""
    model_dir = write_tiny_model("qwen3", tmp_path / "qwen3")
    dev = torch.device(device)
    dtype = "bfloat16" if dev.type == "cuda" else "float16"
    results = {}
    for name, fn in (("reference", rotary_store_kv_reference), ("triton", rotary_store_kv_triton)):
        monkeypatch.setattr(rotary_layer, "rotary_store_kv", fn)
        results[name] = _run(model_dir, dev, dtype, fused=False, monkeypatch=monkeypatch)
    for g, w in zip(results["triton"], results["reference"], strict=True):
        torch.testing.assert_close(g, w, atol=0.01 * w.abs().max().item(), rtol=0.01)
        assert torch.equal(g.argmax(dim=-1), w.argmax(dim=-1))
