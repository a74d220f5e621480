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
    """Each new token is the argmax of transformers' plain causal forward over the whole sequence so far, until
    `max_new_tokens` or an end-of-sequence id of the checkpoint's generation config; one prompt at a time, fp32 on
    the CPU.

    Not `model.generate`: given no attention mask, it infers one that masks every prompt position holding the pad
    id (taken for left padding), so a prompt that holds it (the tiny models' pad, 4, is an ordinary id to the
    engine, and random prompts hit it) got tokens the forward does not pick; and it applies whatever a checkpoint's
    generation_config.json sets (repetition_penalty, no_repeat_ngram_size, suppress_tokens, ...). No KV cache
    either: a forward over the full sequence is the reference least dependent on transformers' machinery."""
    model = load_reference_model(model_dir)
    eos_token_ids = _ids(model.generation_config.eos_token_id)
    outputs = []
    for prompt in prompts:
        tokens = list(prompt)
        while len(tokens) < len(prompt) + max_new_tokens:
            logits = model(torch.tensor([tokens])).logits  # [1, len(tokens), vocab_size]
            tokens.append(int(logits[0, -1].argmax()))
            if tokens[-1] in eos_token_ids:
                break
        outputs.append(tokens[len(prompt) :])
    return outputs


def _ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)
