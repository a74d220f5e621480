"""FP8 weights (`weight_dtype` "fp8") on the CPU with the tiny models: which tensors are quantized and to which bits,
logits near the unquantized model's, a checkpoint of the served tensors read back as it is, and weight updates from
disk that quantize as a fresh load does."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidal.contract.control_api import WeightsUpdateRequest
from tidal.kernels.fp8_linear import quantize_rows_reference
from tidal.kernels.kv_cache_dtype import FP8_E4M3
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.model_runner import ModelRunner
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.step_plan import StepPlan, build_step_plan
from tidal.worker.lifecycle.errors import CheckpointRejectedError
from tidal.worker.loader.errors import CheckpointMismatchError
from tidal.worker.loader.model_loader import load_model
from tidal.worker.testing.hf_reference import prompt_ids
from tidal.worker.testing.in_process import greedy, running_manager
from tidal.worker.testing.tiny_models import write_tiny_model

CPU = torch.device("cpu")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _checkpoint(model_dir):
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _served_bytes(model):
    return {name: t.contiguous().view(torch.uint8).clone() for name, t in model.checkpoint_weights().items()}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_projections_hold_the_quantized_checkpoint(tiny_model, arch):
    model_dir = tiny_model(arch)
    stored = _checkpoint(model_dir)
    served = load_model(model_dir, "float32", CPU, weight_dtype="fp8").model.checkpoint_weights()
    quantized = [n for n, t in served.items() if t.dtype == FP8_E4M3]
    assert quantized and all(n.rsplit(".", 2)[-2] in PROJECTIONS for n in quantized)
    for name in quantized:
        q, scale = quantize_rows_reference(stored[name])
        assert torch.equal(served[name].view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(served[name + "_scale"], scale), name
    # Everything else (embeddings, norms, the LM head, a MoE model's router) as the checkpoint has it.
    rest = [n for n in served if n not in quantized and not n.endswith("_scale")]
    assert any("embed_tokens" in n for n in rest) and any("norm" in n for n in rest)
    if arch == "qwen3_moe":  # the routed experts are FP8 too, the router is not
        experts = [n for n in stored if ".experts." in n]
        assert experts and set(experts) <= set(quantized)
        assert any("mlp.gate.weight" in n for n in rest)
    for name in rest:
        assert torch.equal(served[name], stored[name].float()), name


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_logits_stay_near_the_unquantized_models(tiny_model, arch):
    """The fp8 model runs the same step plans as the fp32 one (prefill, then decode steps of a few rows); its logits
    stay within a few percent of the logits' spread, and most greedy choices agree."""
    model_dir = tiny_model(arch)
    limit = 0.15 if arch == "llama" else 0.25
    leader = LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", num_kv_blocks=64, block_size=4))
    fp8 = ModelRunner(load_model(model_dir, "float32", CPU, weight_dtype="fp8"), CPU, block_size=4)
    fp8.allocate_kv_cache(64)
    for i, prompt in enumerate(prompt_ids(model_dir)[:4]):
        leader.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=6))
    agree = total = 0
    worst = 0.0
    while leader.has_unfinished_requests():
        scheduled = leader.scheduler.schedule()
        plan = build_step_plan(scheduled, 4)
        want = leader.runner.execute(plan)
        got = fp8.execute(StepPlan(**json.loads(json.dumps(dataclasses.asdict(plan)))))
        if want is not None:
            assert got is not None and torch.isfinite(got).all()
            # e4m3 keeps 3 mantissa bits: ~4% per operand, through 4 layers. A MoE model's rows may also take
            # another expert where two router logits were near a tie (a whole expert's output of difference).
            error = (got - want).pow(2).mean().sqrt() / want.std()
            assert error < limit, f"FP8 logits off by {error:.3f} of the logits' spread (RMS)"
            worst = max(worst, float(error))
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += want.shape[0]
        tokens = want.argmax(-1).tolist() if want is not None else []
        leader.scheduler.on_step_done(scheduled, dict(zip(plan.sample_seq_ids, tokens, strict=True)))
        for item in scheduled.scheduled:
            if item.seq.num_output_tokens >= 6:
                leader.abort_request(item.seq.request_id)
    assert total >= 20 and agree >= 0.8 * total, (agree, total, worst)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_checkpoint_of_the_served_tensors_reads_back_as_it_is(tiny_model, tmp_path, arch):
    model_dir = tiny_model(arch)
    loaded = load_model(model_dir, "float32", CPU, weight_dtype="fp8")
    served = _served_bytes(loaded.model)
    out = tmp_path / "fp8"
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    save_file({n: t.contiguous() for n, t in loaded.model.checkpoint_weights().items()}, out / "model.safetensors")
    again = load_model(out, "float32", CPU, weight_dtype="fp8")
    assert _served_bytes(again.model).keys() == served.keys()
    assert all(torch.equal(t, served[n]) for n, t in _served_bytes(again.model).items())
    # A model served in 16/32 bits cannot take e4m3 weights and their scales: refused with the names.
    with pytest.raises(
        CheckpointMismatchError, match=r"wrong dtypes: .*float8_e4m3fn.*unexpected tensors.*weight_scale"
    ):
        load_model(out, "float32", CPU)


def test_a_scale_beside_a_float_weight_is_refused(tiny_model, tmp_path):
    model_dir = tiny_model("llama")
    out = tmp_path / "odd"
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = _checkpoint(model_dir)
    tensors["model.layers.0.self_attn.o_proj.weight_scale"] = torch.ones(
        tensors["model.layers.0.self_attn.o_proj.weight"].shape[0]
    )
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"unexpected tensors.*o_proj\.weight_scale"):
        load_model(out, "float32", CPU, weight_dtype="fp8")


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_updates_from_disk_quantize_as_a_fresh_load_does(tiny_model, tmp_path, arch):
    model_dir = tiny_model(arch)
    version_b = write_tiny_model(arch, tmp_path / "b", sharded=True, seed=7)
    prompts = prompt_ids(model_dir)[:3]
    engine = {"weight_dtype": "fp8"}

    async def fresh_b() -> tuple[str, list[list[int]]]:
        async with running_manager(version_b, engine) as manager:
            return (await manager.checksum(recompute=True)).overall, await greedy(manager, prompts)

    async def updated() -> tuple[str, list[list[int]]]:
        async with running_manager(model_dir, engine) as manager:
            before = (await manager.checksum(recompute=True)).overall
            await manager.update_from_disk(WeightsUpdateRequest(source=str(version_b), version="b"))
            after = (await manager.checksum(recompute=True)).overall
            assert after != before
            # A checkpoint that does not fit is refused whole, as for 16-bit weights; B keeps serving.
            bad = tmp_path / "bad"
            shutil.copytree(version_b, bad)
            for path in bad.glob("*.safetensors"):
                tensors = load_file(path)
                name = next((n for n in tensors if n.endswith("down_proj.weight")), None)
                if name is not None:
                    tensors[name] = tensors[name][:, :8].contiguous()
                    save_file(tensors, path)
            with pytest.raises(CheckpointRejectedError, match="wrong shapes"):
                await manager.update_from_disk(WeightsUpdateRequest(source=str(bad), version="bad"))
            assert (await manager.checksum(recompute=True)).overall == after
            return after, await greedy(manager, prompts)

    assert asyncio.run(updated()) == asyncio.run(fresh_b())
