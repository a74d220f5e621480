"""The tiny MoE models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE with a dense layer) through the Triton
MoE op: a decode step of a few sequences takes the small-batch path and gives the grouped path's logits.

On CPU the op runs under the Triton interpreter in fp32 (its layers normally reach the torch reference there, so the
op is patched in); on a GPU the models run as they serve, in bf16. The reference run keeps every batch on the
grouped GEMMs (TIDAL_MOE_SMALL_BATCH=0); the models' equality with transformers is tests/worker/test_moe_models.py.
"""

from pathlib import Path

import pytest
import torch

import tidal.kernels.fused_moe as fused_moe_module
import tidal.worker.layers.moe as moe_layer
from tidal.worker.engine.model_runner import ModelRunner
from tidal.worker.engine.step_plan import StepPlan
from tidal.worker.loader.model_loader import load_model
from tidal.worker.testing.tiny_models import write_tiny_model

BLOCK_SIZE = 4
PROMPT_LEN = 8
NUM_DECODES = 3  # 6 (token, k) pairs at top-2: the small-batch path; the 8-token prefill (16 pairs) too


def _plans() -> tuple[StepPlan, StepPlan]:
    blocks = PROMPT_LEN // BLOCK_SIZE
    prefill = StepPlan(
        seq_ids=[0],
        input_ids=[(5 * i + 2) % 50 for i in range(PROMPT_LEN)],
        positions=list(range(PROMPT_LEN)),
        slot_mapping=list(range(PROMPT_LEN)),
        cu_seqlens_q=[0, PROMPT_LEN],
        seq_lens=[PROMPT_LEN],
        block_tables=[list(range(blocks))],
        sample_indices=[PROMPT_LEN - 1],
        sample_seq_ids=[0],
    )
    tables = [[*range(blocks), blocks + i] for i in range(NUM_DECODES)]
    decode = StepPlan(
        seq_ids=list(range(NUM_DECODES)),
        input_ids=[13 + i for i in range(NUM_DECODES)],
        positions=[PROMPT_LEN] * NUM_DECODES,
        slot_mapping=[t[-1] * BLOCK_SIZE for t in tables],
        cu_seqlens_q=list(range(NUM_DECODES + 1)),
        seq_lens=[PROMPT_LEN + 1] * NUM_DECODES,
        block_tables=tables,
        sample_indices=list(range(NUM_DECODES)),
        sample_seq_ids=list(range(NUM_DECODES)),
    )
    return prefill, decode


def _run(model_dir: Path, device: torch.device, dtype: str) -> list[torch.Tensor]:
    runner = ModelRunner(load_model(model_dir, dtype, device), device, BLOCK_SIZE)
    runner.allocate_kv_cache(16)
    prefill, decode = _plans()
    return [runner.execute(prefill), runner.execute(decode)]  # logits [1, V], [NUM_DECODES, V] fp32


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_decode_step_takes_the_small_batch_path_with_the_grouped_paths_logits(
    arch: str, tmp_path: Path, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = torch.device(device)
    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    monkeypatch.setattr(moe_layer, "fused_moe", fused_moe_module.fused_moe_triton)
    model_dir = write_tiny_model(arch, tmp_path / arch)
    monkeypatch.setenv("TIDAL_MOE_SMALL_BATCH", "0")
    want = _run(model_dir, dev, dtype)
    monkeypatch.delenv("TIDAL_MOE_SMALL_BATCH")
    calls: list[int] = []
    # On a GPU the decoder's small-batch path runs the layer's form of it (into the residual stream); on CPU the
    # unfused layers run the op itself.
    for name in ("small_batch_moe_routed", "small_batch_moe_into_residual"):
        kernel = getattr(fused_moe_module, name)
        monkeypatch.setattr(fused_moe_module, name, lambda *a, k=kernel: calls.append(1) or k(*a))
    got = _run(model_dir, dev, dtype)
    assert len(calls) >= 2  # at least one MoE layer in each of the two steps
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item()
        tol = 0.03 if dev.type == "cuda" else 1e-4
        torch.testing.assert_close(g, w, atol=tol * scale, rtol=tol)
        assert torch.equal(g.argmax(dim=-1), w.argmax(dim=-1)) or dev.type == "cuda"
