"""Device memory without a GPU: parameters and the KV cache placed once in regions, region packing, and the VMM
region's bookkeeping over a fake driver."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tidal.kernels.kv_layout import is_tokens_innermost
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.loader.hf_config import load_hf_config
from tidal.worker.loader.model_loader import build_model, load_model
from tidal.worker.memory import cuda_vmm
from tidal.worker.memory.kv_region import KVCacheRegion
from tidal.worker.memory.layout import ALIGNMENT, check_tiling, pack
from tidal.worker.memory.parameters import place_parameters
from tidal.worker.memory.provider import TorchMemory
from tidal.worker.memory.regions import VmmRegion
from tidal.worker.models.base import CausalLM
from tidal.worker.testing.hf_reference import prompt_ids

CPU = torch.device("cpu")


def test_pack_aligns_and_tiling_is_checked():
    offsets, total = pack([10, 300, 1])
    assert offsets == [0, ALIGNMENT, 3 * ALIGNMENT] and total == 4 * ALIGNMENT
    covered = list(zip(offsets, [10, 300, 1], strict=True))
    assert check_tiling([("x", 0, 10), ("y", 256, 300), ("z", 768, 1)], covered) == []
    assert check_tiling([("x", 0, 10), ("y", 5, 300)], covered)[0] == "x and y overlap"
    assert "cover" in check_tiling([("x", 0, 10)], covered)[0]


def _inside(tensor: torch.Tensor, region: object) -> bool:
    return 0 <= tensor.data_ptr() - region.data_ptr() < region.nbytes  # type: ignore[attr-defined]


def test_a_model_built_on_meta_gets_its_parameters_in_one_region_and_its_buffers_on_the_device(tiny_model):
    hf_config = load_hf_config(tiny_model("qwen2", tie_embeddings=True))
    model, region = build_model(hf_config, torch.float32, CPU, TorchMemory())
    params = list(model.parameters())
    assert all(p.device == CPU and _inside(p, region) for p in params)
    assert region.nbytes == pack([p.numel() * p.element_size() for p in params])[1]
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: still one Parameter
    assert all(not p.requires_grad for p in params)
    rotary = model.model.layers[0].self_attn.rotary_emb
    built_here = type(rotary)(*rotary._cache_args[:4], True, torch.float32, CPU)
    assert torch.equal(rotary.cos_sin_cache, built_here.cos_sin_cache)  # computed, not left empty


def test_only_a_module_built_on_meta_is_placed_and_every_buffer_must_be_built():
    with pytest.raises(ValueError, match="meta device"):
        place_parameters(nn.Linear(2, 2), TorchMemory(), CPU)

    class Opaque(nn.Module):  # a derived buffer that nothing knows how to compute
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.empty(4, device="meta"))

    holder = nn.Module()  # the method needs nothing of a CausalLM but its modules
    holder.inner = Opaque()
    with pytest.raises(RuntimeError, match="table"):
        CausalLM.materialize_buffers(holder, CPU)  # type: ignore[arg-type]


def test_the_kv_cache_is_views_into_one_zeroed_region_that_survives_a_release():
    kv = KVCacheRegion(TorchMemory(), num_layers=3, block_shape=(4, 2, 8), num_blocks=5, dtype=torch.float16,
                       device=CPU)  # fmt: skip
    assert len(kv.caches) == 3 and all(k.shape == (5, 4, 2, 8) for pair in kv.caches for k in pair)
    assert all(_inside(t, kv.region) and not t.any() for pair in kv.caches for t in pair)
    assert kv.usable_blocks == 5 and kv.nbytes == kv.placement.total
    k0 = kv.caches[0][0]
    kv.release()
    assert not kv.is_resident and kv.usable_blocks == 0
    kv.restore()
    k0.fill_(1)  # the same view object, over the restored storage
    assert kv.usable_blocks == 5 and bool((kv.caches[0][0] == 1).all())


def test_an_fp8_cache_keeps_v_tokens_innermost_inside_its_planes():
    """K dense; V of an FP8 cache a tokens-innermost view (kernels/kv_layout.py) over exactly its own plane, so a
    block is still one run of bytes and a wake's first share is still a prefix of blocks."""
    kv = KVCacheRegion(TorchMemory(), num_layers=2, block_shape=(4, 2, 8), num_blocks=5, dtype=torch.float8_e4m3fn,
                       device=CPU)  # fmt: skip
    base, offsets = kv.region.tensor.data_ptr(), kv.placement.plane_offsets
    for layer, (k, v) in enumerate(kv.caches):
        assert k.is_contiguous() and not v.is_contiguous() and is_tokens_innermost(v)
        assert v.shape == k.shape == (5, 4, 2, 8) and v.stride() == (64, 1, 32, 4)
        assert (k.data_ptr(), v.data_ptr()) == (base + offsets[2 * layer], base + offsets[2 * layer + 1])
    dense = KVCacheRegion(TorchMemory(), num_layers=1, block_shape=(4, 2, 8), num_blocks=5, dtype=torch.bfloat16,
                          device=CPU)  # fmt: skip
    assert all(t.is_contiguous() for t in dense.caches[0])


def test_an_engine_serves_the_same_after_its_regions_were_released_and_restored(tiny_model):
    model_dir = tiny_model("llama")
    engine = LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", num_kv_blocks=64))
    prompts = prompt_ids(model_dir)[:3]
    params = SamplingParams(temperature=0, max_tokens=6)
    before = [r.output_token_ids for r in engine.generate(prompts, params)]
    host = engine.runner.weights_region.tensor.clone()
    for region in (engine.runner.weights_region, engine.runner.kv_cache_region):
        region.release()
        region.restore()
    engine.runner.weights_region.tensor.copy_(host)
    engine.reset_prefix_cache()
    assert engine.runner.recapture_graphs_if_moved() is False  # no graphs on a CPU
    assert [r.output_token_ids for r in engine.generate(prompts, params)] == before


def test_load_model_reads_the_checkpoint_into_the_region(tiny_model):
    loaded = load_model(tiny_model("llama"), "float32", CPU)
    assert all(_inside(t, loaded.weights) for t in loaded.model.checkpoint_weights().values())
    assert isinstance(loaded.memory_provider, TorchMemory)


class _FakePhysicalMemory:
    """The driver's physical-memory calls as bookkeeping (no GPU needed): what is created, mapped, released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.live: set[int] = set()  # created, not released
        self.mapped: dict[int, int] = {}  # address -> handle
        self.fail_map_at: int | None = None  # fail the map call that would make this many mappings
        self._next = 1
        monkeypatch.setattr(cuda_vmm, "create", self.create)
        monkeypatch.setattr(cuda_vmm, "release", self.live.remove)
        monkeypatch.setattr(cuda_vmm, "map_created", self.map_created)
        monkeypatch.setattr(cuda_vmm, "unmap_and_release", self.unmap_and_release)
        monkeypatch.setattr(cuda_vmm, "make_current", lambda index: None)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def create(self, size: int, device_index: int) -> int:
        self._next += 1
        self.live.add(self._next)
        return self._next

    def map_created(self, base: int, size: int, handle: int, device_index: int) -> None:
        if base in self.mapped:
            raise cuda_vmm.CudaDriverError("cuMemMap: already mapped")
        if self.fail_map_at is not None and len(self.mapped) + 1 == self.fail_map_at:
            raise cuda_vmm.CudaDriverError("cuMemMap: out of memory")
        self.mapped[base] = handle

    def unmap_and_release(self, base: int, size: int, handle: int) -> None:
        assert self.mapped.pop(base) == handle
        self.live.remove(handle)


def _released_vmm_region() -> object:
    region = object.__new__(VmmRegion)  # as after a release: reserved, nothing mapped
    region.nbytes, region.device, region.is_resident = 4096, torch.device("cuda", 0), False
    region._index, region._base, region._size = 0, 1 << 40, 4096
    region._pieces = [(region._base + offset, 1024) for offset in range(0, 4096, 1024)]
    region._handles, region._prepared = [], {}
    return region


@pytest.mark.parametrize("prepared_ahead", [False, True])
def test_a_vmm_restore_that_fails_half_way_unmaps_what_it_mapped(monkeypatch, prepared_ahead):
    memory = _FakePhysicalMemory(monkeypatch)
    memory.fail_map_at = 3
    region = _released_vmm_region()
    if prepared_ahead:
        region.prepare_restore()
        assert len(memory.live) == 4 and memory.mapped == {}
    with pytest.raises(cuda_vmm.CudaDriverError, match="out of memory"):
        region.restore()
    assert memory.mapped == {} and memory.live == set() and not region.is_resident  # nothing held: wake can retry
    memory.fail_map_at = None
    region.restore()
    assert region.is_resident and len(memory.mapped) == 4 and len(region._handles) == 4
    assert memory.live == set(memory.mapped.values())


def test_memory_prepared_for_a_restore_that_never_comes_is_given_back(monkeypatch):
    memory = _FakePhysicalMemory(monkeypatch)
    region = _released_vmm_region()
    region.prepare_restore()
    region.prepare_restore()  # a second call takes no more
    assert len(memory.live) == 4
    region.release()  # still asleep: drops what was prepared
    assert memory.live == set() and not region.is_resident
    region.prepare_restore()
    region.restore()  # maps the prepared pieces, creates none
    assert len(memory.live) == 4 and set(memory.mapped.values()) == memory.live


def test_a_partial_restore_maps_the_first_pieces_and_the_rest_comes_later(monkeypatch):
    memory = _FakePhysicalMemory(monkeypatch)
    region = _released_vmm_region()
    region.restore(num_pieces=1)
    assert region.is_resident and not region.is_complete
    assert sorted(memory.mapped) == [1 << 40]
    memory.fail_map_at = 3  # the rest fails half-way (out of memory): the first piece keeps serving
    with pytest.raises(cuda_vmm.CudaDriverError):
        region.restore_rest()
    assert sorted(memory.mapped) == [1 << 40] and memory.live == set(memory.mapped.values())
    memory.fail_map_at = None
    region.restore_rest()  # a retry maps the rest
    assert region.is_complete and len(memory.mapped) == 4
    region.release()
    assert memory.mapped == {} and memory.live == set() and not region.is_complete


def test_physical_memory_is_given_back_when_mapping_it_fails_half_way(monkeypatch):
    # A fake driver (no GPU needed): the access grant after a successful map fails.
    calls: list[str] = []

    class FakeDriver:
        def __getattr__(self, name: str):
            def call(*_args: object) -> int:
                calls.append(name)
                return 1 if name == "cuMemSetAccess" else 0

            return call

    monkeypatch.setattr(cuda_vmm, "_driver", FakeDriver)
    with pytest.raises(cuda_vmm.CudaDriverError, match="cuMemSetAccess"):
        cuda_vmm.create_and_map(1 << 40, 1 << 21, 0)
    assert calls[-2:] == ["cuMemUnmap", "cuMemRelease"]
