"""Sleep and wake on a CUDA device: memory really goes back to the device, addresses stay (CUDA graphs captured
before a sleep replay correctly after it, without recapture); the weights and the KV cache are allocated once, in
their regions, and the graphs captured once. Skipped without CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tidal.contract.control_api import SleepRequest, WakeUpRequest
from tidal.worker.engine import cuda_graphs
from tidal.worker.lifecycle import residency as residency_module
from tidal.worker.loader.model_loader import load_model
from tidal.worker.memory.provider import TorchMemory, VmmMemory
from tidal.worker.memory.regions import TorchRegion, VmmRegion
from tidal.worker.testing.hf_reference import prompt_ids
from tidal.worker.testing.in_process import greedy, running_manager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_vmm_region_gives_memory_back_and_keeps_its_address():
    device = torch.device("cuda", torch.cuda.current_device())
    region = VmmMemory().region(2 * 2**30, device)
    assert isinstance(region, VmmRegion)
    region.tensor.fill_(7)
    address = region.data_ptr()
    free_before, _ = torch.cuda.mem_get_info(device)
    region.release()
    free_asleep, _ = torch.cuda.mem_get_info(device)
    assert free_asleep - free_before >= 2 * 2**30
    region.restore()
    assert region.data_ptr() == address
    region.tensor.fill_(3)
    assert int(region.tensor[-1]) == 3


def test_outputs_identical_after_wake_and_graphs_not_recaptured(tiny_model):
    model_dir = tiny_model("llama3")
    prompts = prompt_ids(model_dir)

    async def scenario() -> None:
        engine = {"device": "cuda", "num_kv_blocks": 256, "max_num_seqs": 8, "max_model_len": 512}
        async with running_manager(model_dir, engine=engine) as manager:
            residency = manager.residency
            assert residency is not None
            graphs = residency.llm.runner.decode_graphs
            assert graphs is not None and isinstance(residency.weights.region, VmmRegion)
            before = await greedy(manager, prompts, 16)
            for level in (1, 2):
                free_awake, _ = torch.cuda.mem_get_info()
                await manager.sleep(SleepRequest(level=level))
                free_asleep, _ = torch.cuda.mem_get_info()
                assert free_asleep - free_awake >= residency.kv.nbytes
                await manager.wake_up(WakeUpRequest())
                assert residency.llm.runner.decode_graphs is graphs  # same graphs, same addresses
                assert await greedy(manager, prompts, 16) == before

    asyncio.run(scenario())


def test_wake_serves_on_the_first_share_of_the_kv_cache_then_gets_the_rest(tiny_model, monkeypatch):
    from tidal.worker.memory import kv_region

    monkeypatch.setattr(kv_region, "KV_FIRST_SHARE_BYTES", 1)  # one granule per plane: the rest is most of it
    model_dir = tiny_model("llama3")
    prompts = prompt_ids(model_dir)

    async def scenario() -> None:
        engine = {"device": "cuda", "num_kv_blocks": 32768, "max_num_seqs": 8, "max_model_len": 512}
        async with running_manager(model_dir, engine=engine) as manager:
            residency = manager.residency
            assert residency is not None
            kv, blocks = residency.kv, residency.llm.block_manager
            assert kv.placement.rest and kv.placement.first_blocks < kv.num_blocks
            before = await greedy(manager, prompts, 16)
            await manager.sleep(SleepRequest(level=1))
            await manager.wake_up(WakeUpRequest())
            assert blocks.num_usable in (kv.placement.first_blocks, kv.num_blocks)  # the rest may be there already
            assert await greedy(manager, prompts, 16) == before
            residency.kv_fill.join()
            assert residency.kv_fill.last_error is None and blocks.num_usable == kv.num_blocks
            assert kv.region.is_complete
            await manager.sleep(SleepRequest(level=1))  # and again: a sleep right after a wake joins the fill
            await manager.wake_up(WakeUpRequest())
            assert await greedy(manager, prompts, 16) == before

    asyncio.run(scenario())


def _inside(tensor: torch.Tensor, region: object) -> bool:
    return 0 <= tensor.data_ptr() - region.data_ptr() < region.nbytes  # type: ignore[attr-defined]


@pytest.mark.parametrize("memory", [VmmMemory(), TorchMemory()], ids=["vmm", "torch"])
def test_the_weights_are_allocated_once_in_their_region(tiny_model, memory):
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    loaded = load_model(tiny_model("llama3"), "float32", device, memory)
    torch.cuda.synchronize()
    assert isinstance(loaded.weights, VmmRegion if isinstance(memory, VmmMemory) else TorchRegion)
    assert all(_inside(p, loaded.weights) for p in loaded.model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in loaded.model.buffers())
    assert all(b.device.type == "cuda" for b in loaded.model.buffers())
    torch_weights = loaded.weights.nbytes if isinstance(memory, TorchMemory) else 0  # VMM is not torch's
    # No second copy of the weights at any time (a checkpoint tensor in transit may add its own size).
    largest = max(t.numel() * t.element_size() for t in loaded.model.checkpoint_weights().values())
    peak = torch.cuda.max_memory_allocated(device) - before
    assert peak <= torch_weights + buffers + largest + 2**20


def test_the_engine_captures_graphs_once_and_the_lifecycle_keeps_them(tiny_model, monkeypatch):
    captures = []
    capture = cuda_graphs.DecodeGraphs.capture
    monkeypatch.setattr(
        cuda_graphs.DecodeGraphs, "capture", lambda self, pool: captures.append(self) or capture(self, pool)
    )
    model_dir = tiny_model("llama3")

    async def scenario() -> None:
        engine = {"device": "cuda", "num_kv_blocks": 256, "max_num_seqs": 8, "max_model_len": 512}
        async with running_manager(model_dir, engine=engine) as manager:
            assert manager.residency is not None
            runner = manager.residency.llm.runner
            assert captures == [runner.decode_graphs]
            assert manager.residency.kv is runner.kv_cache_region
            assert isinstance(runner.kv_cache_region.region, VmmRegion)
            assert all(_inside(k, runner.kv_cache_region.region) for k, _ in runner.kv_caches)
        async with running_manager(model_dir, engine={**engine, "enforce_eager": True}) as manager:
            assert manager.residency is not None and manager.residency.llm.runner.decode_graphs is None

    asyncio.run(scenario())


def test_torch_storage_on_cuda_serves_the_same_after_a_wake_that_moved_it(tiny_model, monkeypatch):
    """Without virtual memory a region may come back elsewhere; the views follow their storage, and the runner
    recaptures the graphs when an address changed (the prompt steps' graphs too: the prompts run through them)."""
    model_dir = tiny_model("llama3")
    prompts = prompt_ids(model_dir)
    # A sleep's freed blocks then stay in torch's cache instead of going back to the driver, where tensors of the
    # region's exact size can take the weights' old block, so that their restore must land elsewhere.
    monkeypatch.setattr(residency_module, "free_cached_device_memory", lambda device: None)

    async def scenario() -> None:
        engine = {
            "device": "cuda", "num_kv_blocks": 256, "max_num_seqs": 8, "max_model_len": 512,
            "max_num_batched_tokens": 256, "cuda_graph_prefill_tokens": 256,
        }  # fmt: skip
        async with running_manager(model_dir, engine=engine, stable_device_memory=False) as manager:
            residency = manager.residency
            assert residency is not None and isinstance(residency.weights.region, TorchRegion)
            runner = residency.llm.runner
            before = await greedy(manager, prompts, 16)
            for level in (1, 2):
                address = residency.weights.region.data_ptr()
                graphs = (runner.decode_graphs, runner.prefill_graphs)
                await manager.sleep(SleepRequest(level=level))
                blockers = _fill_fitting_free_blocks(residency.weights.region.nbytes)
                await manager.wake_up(WakeUpRequest())
                del blockers
                assert residency.weights.region.data_ptr() != address
                # Both graph sets captured again, at the regions' new addresses (the old bytes may still sit at
                # the old ones, so equal outputs alone would not show it).
                assert runner.decode_graphs is not None and runner.decode_graphs is not graphs[0]
                assert runner.prefill_graphs is not None and runner.prefill_graphs is not graphs[1]
                assert runner._graph_addresses == runner._memory_addresses()
                assert await greedy(manager, prompts, 16) == before

    asyncio.run(scenario())


def _fill_fitting_free_blocks(nbytes: int) -> list[torch.Tensor]:
    """Allocate blocks of `nbytes` until torch's cache has no free block that fits one (it then reserves more from
    the driver); -> them all. The weights' old block is free in that cache, so a restore of `nbytes` can no longer
    land on it. Hunting for the old address itself fails: the freed block merges with free neighbours, and best-fit
    splits the merged block from its start, so no allocation need begin at the old address. Each allocation takes
    at least `nbytes` of the pool's free memory (torch keeps blocks of up to 1 MiB apart from larger ones), so the
    pool grows within its reserved bytes // nbytes + 1 allocations."""
    pool = "small_pool" if nbytes <= 2**20 else "large_pool"

    def reserved() -> int:
        return torch.cuda.memory_stats()[f"reserved_bytes.{pool}.current"]

    reserved_before = reserved()
    taken: list[torch.Tensor] = []
    for _ in range(reserved_before // nbytes + 1):
        taken.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
        if reserved() > reserved_before:
            return taken
    pytest.fail(f"torch's {pool} never grew in {len(taken)} allocations of {nbytes} B")
