"""`/tokenize` and `/detokenize`, in vLLM's shapes: the served model's tokenizer, for clients that count or build
prompts in token ids (RL trainers, evaluation harnesses). The work runs on the prompt builder's threads, like every
other tokenization, never on the event loop.

`/tokenize` takes a `prompt` (text) or chat `messages` (rendered through the chat template, as
`/v1/chat/completions` would); `/detokenize` takes token ids of the tokenizer's vocabulary. A text that cannot fit
a prompt here whatever it encodes to is refused (400 context_length_exceeded) before it is tokenized, as the
generation routes refuse it: counting it would hold a tokenizer thread for seconds and serve no prompt.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tidal.worker.server.errors import ApiError, ErrorResponse
from tidal.worker.server.prompt_limit import PromptLimit
from tidal.worker.server.prompts import PromptBuilder
from tidal.worker.server.protocol import ChatMessage
from tidal.worker.server.runtime import WorkerRuntime

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 503)}


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="the served model's name; optional")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = Field(
        default=None, description="add the tokenizer's special tokens; default: yes for a prompt, no for messages"
    )
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(default=None, description="the served model's name; optional")
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_router(runtime: WorkerRuntime, prompt_builder: PromptBuilder, max_prompt_tokens: int | None) -> APIRouter:
    router = APIRouter(responses=_ERRORS)  # type: ignore[arg-type]

    def check_model(model: str | None) -> None:
        if model is not None and model != runtime.served_model_name:
            raise ApiError(
                404, f"model {model!r} is not served here; this server serves {runtime.served_model_name!r}",
                param="model", code="model_not_found",
            )  # fmt: skip

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        engine = runtime.require_engine()
        check_model(body.model)
        limit = PromptLimit.of(engine.max_model_len, max_prompt_tokens)
        if body.messages is not None:
            tokens = await prompt_builder.chat_ids(
                engine.tokenizer, body.messages, body.add_generation_prompt, body.chat_template_kwargs,
                add_special_tokens=bool(body.add_special_tokens), limit=limit,
            )  # fmt: skip
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await prompt_builder.text_ids(engine.tokenizer, body.prompt or "", add_special, limit)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.max_model_len)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        engine = runtime.require_engine()
        check_model(body.model)
        vocab_size = len(engine.tokenizer)
        outside = next((t for t in body.tokens if t >= vocab_size), None)
        if outside is not None:
            raise ApiError(
                400, f"token id {outside} is outside the tokenizer's vocabulary [0, {vocab_size})", param="tokens",
                code="invalid_token",
            )  # fmt: skip
        return DetokenizeResponse(prompt=await prompt_builder.text_of(engine.tokenizer, body.tokens))

    return router
