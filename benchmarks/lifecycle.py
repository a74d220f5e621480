"""Sleep, wake and in-place weight updates, measured on one device.

    python benchmarks/lifecycle.py --shape llama3-8b            # an H200: Llama-3-8B-shaped bf16, random weights
    python benchmarks/lifecycle.py --shape tiny --device cpu     # the same steps on a tiny model (minutes -> seconds)

Writes a model directory with random weights (--dir, default a temporary one), builds the engine through the
lifecycle manager (weights and KV cache allocated in releasable memory, CUDA graphs captured there), then prints:
the device memory freed by sleep levels 1 and 2 and what stays held; sleep and wake seconds per level; the
host<->device copy rate of the weights; whether greedy outputs (which replay the CUDA graphs captured before the
first sleep) are unchanged after each wake; the update-from-disk time and rate with the files in the page cache and
evicted from it (posix_fadvise DONTNEED); the checksum time; and what recapturing the CUDA graphs would cost.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from perf.random_model import save_shards

from tidal.contract.control_api import SleepRequest, WakeUpRequest, WeightsUpdateRequest
from tidal.worker.config import WorkerConfig, WorkerEngineConfig
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.lifecycle.config import LifecycleConfig
from tidal.worker.lifecycle.manager import LifecycleManager
from tidal.worker.models.registry import resolve_model_class
from tidal.worker.process import assemble_worker
from tidal.worker.testing.tiny_models import tiny_config
from tidal.worker.testing.tiny_tokenizer import BOS, EOS, IM_END, PAD, save_tokenizer

SHAPES = {
    "llama3-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 8192, "vocab_size": 128256,
    },
    "tiny": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024, "vocab_size": 512,
    },
}  # fmt: skip
GiB = 2**30


def write_model(out: Path, shape: dict, device: torch.device, seed: int = 0) -> Path:
    """config.json + tokenizer + bf16 random weights in shards (made on `device`, which is fast on a GPU)."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(out)
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOS, EOS, IM_END, PAD)}
    overrides = {k: v for k, v in shape.items() if k != "vocab_size"}
    config = tiny_config("llama", shape["vocab_size"], special, False, overrides)
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    with torch.device("meta"):
        model = resolve_model_class(config.architectures).from_hf_config(config, torch.bfloat16, torch.device("meta"))
    gen = torch.Generator(device=device).manual_seed(seed)

    def drawn() -> Iterator[tuple[str, torch.Tensor]]:
        for name, meta in sorted(model.checkpoint_weights().items()):
            t = torch.randn(meta.shape, generator=gen, device=device, dtype=torch.float32)
            t = (1.0 + 0.05 * t) if name.endswith("norm.weight") else t * (0.5 / meta.shape[-1] ** 0.5)
            yield name, t.to(torch.bfloat16).cpu()

    save_shards(drawn(), out)
    return out


def device_used_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / GiB


def evict_page_cache(model_dir: Path) -> None:
    for path in model_dir.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def greedy(manager: LifecycleManager, prompts: list[list[int]], n: int) -> list[list[int]]:
    assert manager.engine is not None
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in manager.engine.generate(f"bench-{time.monotonic_ns()}-{i}", prompt, params):  # type: ignore[union-attr]
            tokens += out.new_token_ids
        return tokens

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def line(label: str, value: str) -> None:
    print(f"{label:<52} {value}", flush=True)


async def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = SHAPES[args.shape]
    root = Path(args.dir or tempfile.mkdtemp(prefix="tidal-lifecycle-bench-"))
    start = time.monotonic()
    model_dir = write_model(root / "model", shape, device)
    line("model written", f"{time.monotonic() - start:.1f}s at {model_dir}")

    kv_size = {"gpu_memory_fraction": args.kv_fraction} if device.type == "cuda" else {"num_kv_blocks": 256}
    engine_config = WorkerEngineConfig(
        model_path=model_dir, dtype="bfloat16", device=str(device), max_num_seqs=8, max_num_batched_tokens=2048,
        max_model_len=1024, **kv_size,
    )  # fmt: skip
    # The worker as the CLI assembles it (its servers are never bound here).
    process = assemble_worker(WorkerConfig(engine=engine_config, lifecycle=LifecycleConfig(weights_version="a")))
    manager = process.lifecycle
    start = time.monotonic()
    await process.runtime.load()
    assert manager.residency is not None
    w, kv, llm = manager.residency.weights, manager.residency.kv, manager.residency.llm
    line("engine loaded, in releasable memory", f"{time.monotonic() - start:.1f}s")
    line("weights / KV cache", f"{w.nbytes / GiB:.2f} GiB / {kv.nbytes / GiB:.2f} GiB ({type(w.region).__name__})")
    line("CUDA graphs captured", str(llm.runner.decode_graphs is not None))

    # The raw copy rates of exactly these bytes (pinned host buffer <-> device).
    t = time.perf_counter()
    w.to_host()
    d2h = time.perf_counter() - t
    t = time.perf_counter()
    w.to_device()
    h2d = time.perf_counter() - t
    line("weights device->host / host->device", f"{d2h:.3f}s ({w.nbytes / d2h / 1e9:.1f} GB/s) / "
         f"{h2d:.3f}s ({w.nbytes / h2d / 1e9:.1f} GB/s)")  # fmt: skip

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, shape["vocab_size"], (n,), generator=gen).tolist() for n in (5, 17, 40, 100)]
    reference = await greedy(manager, prompts, args.new_tokens)
    used_awake = device_used_gib(device)
    if used_awake is not None:
        line("device memory used, awake", f"{used_awake:.2f} GiB")
    addresses = (w.region.data_ptr(), kv.region.data_ptr())

    for level in (1, 2):
        slept = await manager.sleep(SleepRequest(level=level))
        used = device_used_gib(device)
        if used is not None and used_awake is not None:
            line(f"level {level}: freed / still held", f"{used_awake - used:.2f} GiB / {used:.2f} GiB")
        line(f"level {level}: sleep", f"{slept.duration_s:.3f}s")
        if device.type == "cuda":
            allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
            line(f"level {level}: torch allocated / reserved", f"{allocated / GiB:.2f} / {reserved / GiB:.2f} GiB")
        woke = await manager.wake_up(WakeUpRequest())
        note = " (includes re-reading the checkpoint from disk)" if level == 2 else ""
        line(f"level {level}: wake", f"{woke.duration_s:.3f}s{note}")
        if level == 1:
            line("level 1: wake / (weights bytes at measured H2D rate)", f"{woke.duration_s / h2d:.2f}x")
        phases = manager.residency.last_wake_phases
        line(f"level {level}: wake phases", ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in phases.items()))
        fill = manager.residency.kv_fill
        fill.join()
        line(
            f"level {level}: KV blocks at wake / whole again after",
            f"{kv.placement.first_blocks} of {kv.num_blocks} / "
            + (f"{fill.last_seconds:.3f}s more" if fill.last_seconds is not None else f"failed: {fill.last_error}"),
        )
        same = await greedy(manager, prompts, args.new_tokens) == reference
        stable = (w.region.data_ptr(), kv.region.data_ptr()) == addresses
        line(f"level {level}: outputs equal / addresses unchanged", f"{same} / {stable}")
        if level == 1 and device.type == "cuda":
            # In service a model sleeps for minutes. Right after a release the driver is still clearing the freed
            # memory on the device, and the next copy waits for that: measure a wake that comes after it too.
            await manager.sleep(SleepRequest(level=1))
            await asyncio.sleep(args.settle_s)
            woke = await manager.wake_up(WakeUpRequest())
            line(f"level 1: wake {args.settle_s:g}s after the sleep", f"{woke.duration_s:.3f}s = "
                 f"{woke.duration_s / h2d:.2f}x the weights copy; " + ", ".join(
                     f"{k} {v * 1000:.0f} ms" for k, v in manager.residency.last_wake_phases.items()))  # fmt: skip
            manager.residency.kv_fill.join()
            line("level 1: outputs equal after it", str(await greedy(manager, prompts, args.new_tokens) == reference))

    for label, cold in (("update from disk, page cache", False), ("update from disk, evicted (cold)", True)):
        if cold:
            evict_page_cache(model_dir)
        result = await manager.update_from_disk(
            WeightsUpdateRequest(source=str(model_dir), version="cold" if cold else "warm")
        )
        line(label, f"{result.duration_s:.3f}s, {result.bytes_loaded / result.duration_s / 1e9:.1f} GB/s, "
             f"serving held {result.paused_s:.3f}s; checksum {result.checksum_s:.2f}s")  # fmt: skip
    line(
        "outputs equal after updating to the same bytes",
        str(await greedy(manager, prompts, args.new_tokens) == reference),
    )

    if device.type == "cuda":
        t = time.perf_counter()
        await asyncio.to_thread(
            llm.runner.capture_cuda_graphs, llm.config.max_num_seqs, llm.max_model_len, llm.config.prefill_graph_tokens
        )
        line("CUDA graph recapture (not needed: stable addresses)", f"{time.perf_counter() - t:.2f}s")
        await manager.sleep(SleepRequest(level=2))
        line("level 2 again: still held", f"{device_used_gib(device):.2f} GiB")
        llm.runner.decode_graphs = None
        llm.runner.prefill_graphs = None  # the prompt steps' graphs share the decode graphs' pool
        gc.collect()
        torch.cuda.empty_cache()
        line("  ... of which CUDA graphs held", f"{device_used_gib(device):.2f} GiB held without them")
        stats = torch.cuda.memory_stats(device)
        reserved, allocated = torch.cuda.memory_reserved(device) / GiB, torch.cuda.memory_allocated(device) / GiB
        segments = stats.get("segment.all.current")
        line("  torch segments / reserved / allocated", f"{segments} / {reserved:.2f} / {allocated:.2f} GiB")
    await process.runtime.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dir", default=None, help="where to write the model (default: a temporary directory)")
    parser.add_argument("--kv-fraction", type=float, default=0.9, help="share of free GPU memory for the KV cache")
    parser.add_argument("--settle-s", type=float, default=2.0, help="seconds asleep before the second level-1 wake")
    parser.add_argument("--new-tokens", type=int, default=16)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
