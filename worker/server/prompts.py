"""Turning a request into prompt token ids: plain text, given token ids, or chat messages through the chat template.

Whether the ids are acceptable (not empty, within the context, inside the vocabulary) is the engine's call, made
before it queues anything; `Generation.start` turns its refusal into a 400.
"""

from __future__ import annotations

from typing import Any, Protocol

from tidal.worker.server.errors import ApiError
from tidal.worker.server.protocol import ChatMessage


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the server uses."""

    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...


def completion_prompt_ids(tokenizer: Tokenizer, prompt: str | list[int]) -> list[int]:
    return list(tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)


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


def _as_template_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    if message.name is not None:
        out["name"] = message.name
    return out
