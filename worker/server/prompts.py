"""Turning a request into prompt token ids: plain text, given token ids, or chat messages through the chat template.

The length check here mirrors the engine's so that the common refusal (prompt longer than the context) gets a
message written for API users; the engine still checks on its own, and its refusal is a 400 too.
"""

from __future__ import annotations

from typing import Any, Protocol

from tidal.worker.server.errors import ApiError
from tidal.worker.server.protocol import ChatMessage


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the server uses."""

    chat_template: str | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...

    def __len__(self) -> int: ...


def completion_prompt_ids(tokenizer: Tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    vocab = len(tokenizer)
    bad = [t for t in prompt if t >= vocab]
    if bad:
        raise ApiError(400, f"prompt token ids out of the vocabulary (size {vocab}): {bad[:5]}", param="prompt")
    return list(prompt)


def chat_prompt_ids(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
) -> list[int]:
    """Render the conversation with the model's chat template, then tokenize the text.

    Rendering to text first (rather than `tokenize=True`) keeps one code path across tokenizer versions, whose
    return type for tokenized templates has changed; the template already writes the special tokens it wants, so
    none are added on top.
    """
    if not tokenizer.chat_template:
        raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
    conversation = [_as_template_message(m) for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # a Jinja template raises whatever it likes (e.g. "roles must alternate")
        raise ApiError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
    if not isinstance(text, str):
        raise ApiError(500, f"the chat template returned {type(text).__name__}, expected text")
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens == 0:
        raise ApiError(400, "the prompt is empty after tokenization", param="prompt", code="invalid_prompt")
    if num_prompt_tokens >= max_model_len:
        raise ApiError(
            400,
            f"the prompt has {num_prompt_tokens} tokens but this model's context is {max_model_len} tokens, "
            "which must also leave room for at least one generated token",
            param="prompt",
            code="context_length_exceeded",
        )


def _as_template_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.name is not None:
        out["name"] = message.name
    return out
