"""Sleep and wake on a CUDA device: memory really goes back to the device, addresses stay (CUDA graphs captured
before a sleep replay correctly after it, without recapture). Skipped without CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tidal.contract.control_api import SleepRequest, WakeUpRequest
from tidal.worker.lifecycle.device_memory import VmmRegion, allocate_region
from tidal.worker.testing.hf_reference import prompt_ids
from tidal.worker.testing.in_process import greedy, running_manager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_vmm_region_gives_memory_back_and_keeps_its_address():
    device = torch.device("cuda", torch.cuda.current_device())
    region = allocate_region(2 * 2**30, device)
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
    from tidal.worker.lifecycle import resident

    monkeypatch.setattr(resident, "KV_FIRST_SHARE_BYTES", 1)  # one granule per plane: the rest is most of it
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
