"""The decoder's fused small-batch forward (worker/models/small_batch.py) against its unfused layers, on tiny
models.

On CPU the kernels run under the Triton interpreter in fp16 (the interpreter's bf16 tl.dot is wrong, see
tolerances.py), with the fused path switched on by hand since it normally takes CUDA tensors only; on a GPU the same
test runs the compiled kernels in bf16.
"""

import pytest
import torch

import tidal.worker.models.decoder as decoder_module
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


def _run(model_dir, device, dtype, fused: bool, monkeypatch) -> list[torch.Tensor]:
    def choose(hidden: torch.Tensor) -> bool:
        return fused and hidden.shape[0] <= MAX_ROWS

    monkeypatch.setattr(decoder_module, "uses_small_batch_kernels", choose)
    loaded = load_model(model_dir, dtype, device)
    runner = ModelRunner(loaded, device, BLOCK_SIZE)
    runner.allocate_kv_cache(32)
    prefill, decode = _prefill_then_decode_plans(prompt_len=12, num_decodes=3)
    return [runner.execute(prefill), runner.execute(decode)]  # logits [1, V] and [3, V], fp32


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, biased q/k/v, q/k norm
def test_fused_small_batch_forward_matches_the_unfused_layers(arch, tmp_path, device, monkeypatch):
    model_dir = write_tiny_model(arch, tmp_path / arch)
    device = torch.device(device)
    dtype = "bfloat16" if device.type == "cuda" else "float16"
    want = _run(model_dir, device, dtype, fused=False, monkeypatch=monkeypatch)
    got = _run(model_dir, device, dtype, fused=True, monkeypatch=monkeypatch)
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item()
        torch.testing.assert_close(g, w, atol=0.03 * scale, rtol=0.03)
        assert (g.argmax(dim=-1) == w.argmax(dim=-1)).float().mean() >= 0.5
