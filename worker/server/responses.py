"""Response bodies of the OpenAI-compatible API (whole responses and streamed chunks)."""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

# The engine's "abort" (shutdown, client gone) has no OpenAI name; it is passed through so a caller can tell.
# "tool_calls": chat only, the model stopped after calling tools.
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class _WithExtensions(BaseModel):
    """A response whose non-OpenAI fields (`_EXTENSIONS`) are left out unless set: a client that did not ask for
    them sees OpenAI's shape exactly."""

    _EXTENSIONS: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_unset_extensions(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]  # noqa: ANN202
        # No return annotation: with one (even Any) pydantic documents the response as {} in the OpenAPI document.
        data = handler(self)
        for key in self._EXTENSIONS:
            if data.get(key, 0) is None:
                del data[key]
        return data


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: one entry per token of the choice's text (the echoed prompt's first, if echoed)."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: the prompt's first token (nothing scores it)
    top_logprobs: list[dict[str, float] | None]  # the k most likely, and the token itself
    text_offset: list[int]  # where each token's text starts in the choice's text


class PromptLogprob(BaseModel):
    logprob: float
    rank: int  # 1 = the most likely
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token (the first None) {token id: ...} of it and its top ones.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_WithExtensions):
    _EXTENSIONS = frozenset({"prompt_logprobs", "prompt_token_ids", "token_ids"})

    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's extensions: the prompt's logprobs, the prompt's and the choice's token ids.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None  # streamed: the chunk's new ones


class CompletionResponse(BaseModel):
    """A whole completion, and (with `object` unchanged, as OpenAI does) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CalledFunction(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(_WithExtensions):
    # Left out when there are none, as OpenAI does (not an extension, but dropped the same way).
    _EXTENSIONS = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the message is only tool calls
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatChoice(_WithExtensions):
    _EXTENSIONS = frozenset({"token_ids"})

    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None  # vLLM's extension (return_token_ids)


class ChatCompletionResponse(_WithExtensions):
    _EXTENSIONS = frozenset({"prompt_token_ids", "prompt_logprobs"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # vLLM's extension (return_token_ids)
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, as on a completion's choice


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="plain")
    def _only_set_keys(self) -> dict[str, Any]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class ToolCallDelta(BaseModel):
    """A streamed call: its first delta has the id, type and name (and empty arguments), later ones argument text."""

    index: int  # the call's place in the message
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer(mode="wrap")
    def _only_set_keys(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]  # noqa: ANN202
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _only_set_keys(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]  # noqa: ANN202
        # A delta carries just what changed: {"role": ...} first, then {"content": ...} or {"tool_calls": ...}, and
        # {} with the finish.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_WithExtensions):
    _EXTENSIONS = frozenset({"token_ids"})

    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None  # the chunk's new ones


class ChatCompletionChunk(_WithExtensions):
    _EXTENSIONS = frozenset({"prompt_token_ids", "prompt_logprobs"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    # On each choice's first chunk (the role's), when asked.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "tidal"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
