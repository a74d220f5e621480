"""transformers' `generate()` on the same weights and workload (the baseline of the ratios).

transformers loads our model's checkpoint tensors as its state dict (the names of a checkpoint on disk, through
its own loading path) into a copy on the CPU, which then moves to the device. EOS is switched off in its
generation config, so like the engine's `ignore_eos` every row generates exactly N tokens and greedy picks are
never masked; `min_new_tokens=N` is passed as the issue asks and changes nothing then. Decode is timed from a
streamer: generate() hands it each step's tokens after copying them to the host, which waits for the step, so
its timestamps are step ends.
"""

from __future__ import annotations

import time

import torch
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from perf.timing import DecodeRun, OfflineRun, now, steady_ms_per_step
from tidal.worker.loader.model_loader import LoadedModel


def load_transformers_model(loaded: LoadedModel, device: torch.device) -> PreTrainedModel:
    """transformers' class for the config, filled from (a copy of) our model's tensors; refuses a partial load."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(loaded.hf_config)]
    model, info = model_class.from_pretrained(
        None,
        config=loaded.hf_config,
        state_dict=loaded.model.checkpoint_weights(),
        dtype=loaded.dtype,
        output_loading_info=True,
    )  # on the CPU: a device_map would need `accelerate`, which the GPU machine may lack
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise ValueError(f"transformers did not take all of the model's weights: {problems}")
    model.generation_config.eos_token_id = None  # no stopping and no EOS masking: exactly N tokens per row
    model.generation_config.pad_token_id = loaded.hf_config.pad_token_id
    return model.to(device).eval()


class _StepClock(BaseStreamer):
    """Timestamps of generate()'s streamer calls: the prompt first, then one per generated token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def _generate(
    model: PreTrainedModel, prompts: list[list[int]], new_tokens: int, clock: _StepClock | None = None
) -> list[list[int]]:
    """Equal-length prompts, so no padding and no attention mask. -> generated ids per row."""
    input_ids = torch.tensor(prompts, device=model.device)  # [B, P]
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        streamer=clock,
    )  # [B, P + new_tokens]
    return out[:, input_ids.shape[1] :].tolist()


def measure_decode(model: PreTrainedModel, prompts: list[list[int]], new_tokens: int, warmup: int) -> DecodeRun:
    _generate(model, prompts, min(4, new_tokens))  # untimed: kernels' first calls, allocator growth
    clock = _StepClock()
    outputs = _generate(model, prompts, new_tokens, clock)
    marks = clock.stamps[1:]  # [new_tokens]: after each generated token
    if len(marks) != new_tokens or any(len(o) != new_tokens for o in outputs):
        raise RuntimeError(f"transformers generated {len(marks)} steps, expected {new_tokens}")
    return DecodeRun(
        batch=len(prompts),
        prompt_len=len(prompts[0]),
        new_tokens=new_tokens,
        timed_steps=new_tokens - warmup,
        ms_per_step=steady_ms_per_step(marks, warmup),
        outputs=outputs,
    )


def measure_ttft(model: PreTrainedModel, prompt: list[int], repeats: int) -> list[float]:
    """ms of generate(max_new_tokens=1) on one prompt, `repeats` times after one untimed run."""
    times = []
    for _ in range(repeats + 1):
        start = now(model.device)
        _generate(model, [prompt], 1)
        times.append((now(model.device) - start) * 1000.0)
    return times[1:]


def measure_offline(model: PreTrainedModel, prompts: list[list[int]], output_len: int) -> OfflineRun:
    """All prompts as one batch through generate() (equal lengths: no padding)."""
    _generate(model, prompts[:2], 2)
    start = now(model.device)
    outputs = _generate(model, prompts, output_len)
    seconds = now(model.device) - start
    return OfflineRun(
        requests=len(prompts),
        input_len=len(prompts[0]),
        output_len=output_len,
        seconds=seconds,
        output_tokens=sum(len(o) for o in outputs),
    )
