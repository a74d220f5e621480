"""transformers' own implementation as the reference the engine is compared with (tests and benchmarks only;
the engine never runs transformers' modeling code)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

# Different lengths (1 to ~45 tokens with the tiny tokenizer); two share a long prefix for the prefix cache.
PROMPT_TEXTS = [
    "Hello",
    "The tide comes in twice a day, and the harbour master writes the times on a slate by the door.",
    "one two three",
    "Why do we batch? Because the engine can serve many sequences in the same step",
    "Why do we batch? Because the engine can serve many sequences at once, said she",
    "x",
    "Numbers like 1024, 4096 and 65536 appear in every system that counts memory",
    "The quick brown fox jumps over the lazy dog while the cat watches from the warm window sill. Then",
    "north, south, east and west",
]


def prompt_ids(model_dir: Path, texts: list[str] = PROMPT_TEXTS) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(text)["input_ids"] for text in texts]


def load_reference_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """AutoModelForCausalLM, refusing a checkpoint it would not load completely (it would init at random)."""
    # Any: with output_loading_info the call returns (model, info), not the model its annotation names.
    loaded: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, output_loading_info=True)
    model, info = loaded
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise ValueError(f"transformers did not load {model_dir} cleanly: {problems}")
    reference: PreTrainedModel = model.eval()
    return reference


@torch.no_grad()
def transformers_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """One prompt at a time (no padding), fp32 on the CPU."""
    # Any: GenerationMixin.generate declares a self type (a protocol) that transformers' models do not meet.
    model: Any = load_reference_model(model_dir)
    outputs = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
