"""Loading model directories: sharded and tied checkpoints, the checkpoint-name map, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.loader.errors import CheckpointMismatchError, MissingModelFileError, ModelLoadError
from tidal.worker.loader.model_loader import load_model, load_tokenizer
from tidal.worker.models.registry import UnsupportedArchitectureError
from tidal.worker.testing.hf_reference import prompt_ids, transformers_greedy

CPU = torch.device("cpu")


def greedy(model_dir, prompts, max_tokens=8):
    engine = LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", num_kv_blocks=64))
    return [r.output_token_ids for r in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))]


@pytest.mark.parametrize(
    ("arch", "sharded", "tied"),
    [("llama", True, False), ("qwen3", False, True), ("qwen2", True, True), ("qwen3_moe", True, True)],
)
def test_sharded_and_tied_variants_load_and_match_transformers(tiny_model, arch, sharded, tied):
    model_dir = tiny_model(arch, sharded=sharded, tie_embeddings=tied)
    assert (model_dir / "model.safetensors.index.json").is_file() == sharded
    prompts = prompt_ids(model_dir)[:4]
    assert greedy(model_dir, prompts) == transformers_greedy(model_dir, prompts, 8)


def test_checkpoint_weights_are_live_views_with_checkpoint_names(tiny_model):
    model_dir = tiny_model("qwen2", tie_embeddings=True)
    loaded = load_model(model_dir, "auto", CPU)
    weights = loaded.model.checkpoint_weights()
    on_disk = load_file(model_dir / "model.safetensors")
    assert set(weights) == set(on_disk)
    assert "lm_head.weight" not in weights
    for name, tensor in on_disk.items():
        assert torch.equal(weights[name], tensor), name
    # q_proj is a view into the fused qkv weight: writing it changes what the forward uses.
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    fused = loaded.model.model.layers[0].self_attn.qkv_proj.weight
    assert q.data_ptr() == fused.data_ptr()
    # Tied: the head reads the embedding's own tensor.
    assert loaded.model.lm_head.weight.data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    assert loaded.report.num_tensors == len(on_disk)
    assert loaded.dtype == torch.float32


def test_dtype_override(tiny_model):
    loaded = load_model(tiny_model("llama"), "bfloat16", CPU)
    assert all(t.dtype == torch.bfloat16 for t in loaded.model.checkpoint_weights().values())


@pytest.fixture
def broken(tiny_model, tmp_path):
    """A fresh copy of a tiny llama to break."""
    target = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), target)
    return target


def test_missing_directory(tmp_path):
    with pytest.raises(MissingModelFileError, match="does not exist"):
        load_model(tmp_path / "nope", "auto", CPU)


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(MissingModelFileError, match=r"config\.json"):
        load_model(broken, "auto", CPU)


def test_missing_weights(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(MissingModelFileError, match=r"no \*\.safetensors"):
        load_model(broken, "auto", CPU)


def test_missing_shard(tiny_model, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_model("llama", sharded=True), target)
    next(target.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(MissingModelFileError, match="missing"):
        load_model(target, "auto", CPU)


def test_missing_tokenizer(broken):
    (broken / "tokenizer.json").unlink()
    (broken / "tokenizer_config.json").unlink()
    with pytest.raises(MissingModelFileError, match="tokenizer"):
        load_tokenizer(broken)


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unknown_architecture(broken):
    edit_config(broken, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match=r"GPTNeoXForCausalLM.*supported: LlamaForCausalLM"):
        load_model(broken, "auto", CPU)


def test_unknown_model_type(broken):
    edit_config(broken, model_type="no-such-model")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_model(broken, "auto", CPU)


def rewrite_weights(model_dir, change):
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors")


def test_wrong_tensor_shape(broken):
    name = "model.layers.1.mlp.down_proj.weight"
    rewrite_weights(broken, lambda t: t.__setitem__(name, torch.zeros(64, 100)))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"wrong shapes: model.layers.1.mlp.down_proj.weight: checkpoint \[64, 100\] vs model \[64, 128\]",
    ):
        load_model(broken, "auto", CPU)


def test_missing_tensor(broken):
    rewrite_weights(broken, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointMismatchError, match=r"missing tensors: model\.norm\.weight"):
        load_model(broken, "auto", CPU)


def test_unexpected_tensor(broken):
    rewrite_weights(broken, lambda t: t.__setitem__("model.layers.0.self_attn.q_norm.weight", torch.ones(16)))
    with pytest.raises(CheckpointMismatchError, match=r"unexpected tensors.*q_norm"):
        load_model(broken, "auto", CPU)


def test_non_finite_weights(broken):
    # The model directory is refused at start-up as an update from it would be: serving NaN gives garbage.
    name = "model.layers.1.mlp.down_proj.weight"
    rewrite_weights(broken, lambda t: t[name].view(-1)[:2].fill_(float("nan")))
    with pytest.raises(ModelLoadError, match=rf"holds NaN or Inf: {name}: 2 non-finite values \(NaN or Inf\)"):
        load_model(broken, "auto", CPU)


def test_engine_rejects_a_cache_smaller_than_the_requested_context(tiny_model):
    config = EngineConfig(
        model_path=tiny_model("llama"), device="cpu", num_kv_blocks=2, block_size=16, max_model_len=64
    )
    with pytest.raises(ValueError, match="less than max_model_len 64"):
        LLMEngine.from_config(config)


def test_engine_context_defaults_to_the_model_and_fits_the_cache(tiny_model):
    engine = LLMEngine.from_config(
        EngineConfig(model_path=tiny_model("llama"), device="cpu", num_kv_blocks=8, block_size=16)
    )
    assert engine.max_model_len == 128  # the model allows 1024; the cache holds 128 tokens
    engine = LLMEngine.from_config(EngineConfig(model_path=tiny_model("llama"), device="cpu", kv_cache_bytes=2**22))
    assert engine.max_model_len == 1024
