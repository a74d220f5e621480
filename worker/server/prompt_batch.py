"""How many choices one request may ask for, and `/v1/completions`' batched prompts as a list (pure).

A request's choices are its prompts times `n`; each is a sequence in the engine, so the caps keep one HTTP request,
which takes one admission slot, from filling the batch on its own.
"""

from __future__ import annotations

# Samples of one prompt (`n`); a documented part of the API (docs/ARCHITECTURE.md).
MAX_N = 16
# Prompts of one `/v1/completions` request.
MAX_PROMPTS = 64
# Choices of one request: prompts times n.
MAX_CHOICES = 128

Prompt = str | list[int]


def as_prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """OpenAI's prompt forms as a list of prompts: a string, token ids, a list of strings, or a list of token-id
    lists. ValueError (said for the client) for an empty one, a negative token id, or too many."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("prompt must not be empty")
    if all(isinstance(t, int) for t in prompt):
        return [_token_ids(prompt)]  # type: ignore[arg-type]
    if len(prompt) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(prompt)}")
    prompts: list[Prompt] = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(isinstance(t, int) for t in item):
            prompts.append(_token_ids(item))
        else:
            raise ValueError("each prompt of a list must be a string or a non-empty list of token ids")
    return prompts


def check_num_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise ValueError(
            f"{num_prompts} prompts times n={n} make {num_prompts * n} choices; at most {MAX_CHOICES} are allowed"
        )


def _token_ids(ids: list[int]) -> list[int]:
    if any(t < 0 for t in ids):
        raise ValueError("prompt token ids must be non-negative")
    return ids
