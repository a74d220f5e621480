"""Does the weights' layout change the time to first token? The 8B-shaped model's 1024-token TTFT with its weights
in one region (as the engine allocates them since the structural change) against a tensor each (as before), built
and measured alternately, twice each, on one device.

    python3 benchmarks/ttft_weights_layout.py   # ~1 min on an H200; results in perf-*-structural-ab.md
"""

import gc
import statistics
import tempfile
from pathlib import Path

import torch
from perf import engine_side
from perf.presets import PRESETS, default_workload, random_prompts, write_model_dir
from perf.random_model import build_random_model, fill_random_

from tidal.worker.checkpoint.reader import LoadReport
from tidal.worker.loader.hf_config import load_hf_config
from tidal.worker.loader.model_loader import LoadedModel
from tidal.worker.memory.provider import TorchMemory
from tidal.worker.memory.regions import TorchRegion
from tidal.worker.models.registry import resolve_model_class

device = torch.device("cuda")
dtype = torch.bfloat16


def separate(model_dir: Path) -> LoadedModel:
    """The model built straight on the device, each parameter its own allocation (the region passed is a stand-in:
    the runner only reads its address)."""
    hf = load_hf_config(model_dir)
    model = resolve_model_class(hf.architectures).from_hf_config(hf, dtype, device)
    fill_random_(model.checkpoint_weights(), 0)
    torch.cuda.synchronize()
    return LoadedModel(model.eval(), hf, dtype, LoadReport(0, 0, 0.0), TorchRegion(256, device), TorchMemory())


with tempfile.TemporaryDirectory() as tmp:
    preset = PRESETS["llama3-8b"]
    workload = default_workload(preset, "cuda", False)
    model_dir = write_model_dir(preset, Path(tmp) / "m")
    results = {"region": [], "separate": []}
    for rnd in range(2):
        for name in ("region", "separate"):
            loaded = build_random_model(model_dir, dtype, device, 0) if name == "region" else separate(model_dir)
            config = engine_side.engine_config(model_dir, loaded, device, workload, 0.9)
            engine, facts = engine_side.build_engine(config, loaded)
            prompt = random_prompts(1, workload.ttft_prompt_len, loaded.model.vocab_size, seed=7)[0]
            times = engine_side.measure_ttft(engine, prompt, 10)
            fwd = engine_side.forward_ms(engine, 1, 1024)
            results[name] += times
            runs = [round(t, 1) for t in times]
            print(f"round {rnd} {name}: TTFT median {statistics.median(times):.2f} ms, runs {runs}; b1 forward {fwd}")
            del engine, loaded
            gc.collect()
            torch.cuda.empty_cache()
    for name, ts in results.items():
        print(f"{name}: median {statistics.median(ts):.2f} ms over {len(ts)}")
