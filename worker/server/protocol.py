"""Request bodies of the OpenAI-compatible API, validated at the boundary.

A field this server cannot honour (logprobs, tools, penalties...) is rejected with a message naming it rather
than silently ignored: a caller who asked for it should learn that it did not happen. Unknown fields are rejected too,
as OpenAI does. A few widely used non-OpenAI extensions are accepted: `top_k`, `stop_token_ids`, `ignore_eos` and,
for chat, `add_generation_prompt` and `chat_template_kwargs`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tidal.worker.server.prompt_batch import MAX_N, Prompt, as_prompt_list, check_num_choices

# OpenAI's own cap on stop sequences; more would mostly slow down the detokenizer's stop check.
MAX_STOP_SEQUENCES = 4


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints, with OpenAI's ranges."""

    model: str = Field(min_length=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="non-OpenAI extension; -1 or 0 disables it")
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, description="a string or a list of strings")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N, description="samples of each prompt, sharing its prefill")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: object) -> object:
        # OpenAI accepts a single string, a list, or null.
        return [stop] if isinstance(stop, str) else ([] if stop is None else stop)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stops: list[str]) -> list[str]:
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty strings")
        return stops

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("presence and frequency penalties are not supported by this server; leave them at 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported by this server")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`. A prompt (text or token ids) or a batch of them: a choice per prompt, times n."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # The legacy completions endpoint's default, as in OpenAI's API.
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: str | list[int] | list[str] | list[list[int]]) -> object:
        as_prompt_list(prompt)
        return prompt

    @model_validator(mode="after")
    def _check_num_choices(self) -> CompletionRequest:
        check_num_choices(len(self.prompts), self.n)
        return self

    @property
    def prompts(self) -> list[Prompt]:
        """The prompts, each a string or token ids, in order (choice i * n + j is prompt i's sample j)."""
        return as_prompt_list(self.prompt)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported by this server")
        return echo

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: int | None) -> int | None:
        if logprobs is not None:
            raise ValueError("logprobs are not supported by this server")
        return logprobs

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError("best_of > 1 is not supported by this server")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix (insertion) is not supported by this server")
        return suffix


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Assistant turns replayed by clients may carry extra keys (tool_calls: null, refusal: null...); ignore those.
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[dict[str, Any]] | None) -> str | None:
        if content is None or isinstance(content, str):
            return content
        texts = []
        for part in content:
            if part.get("type") != "text":
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            texts.append(TextPart.model_validate(part).text)
        return "".join(texts)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else ""


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    # None: up to the model's context length.
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool) -> bool:
        if logprobs:
            raise ValueError("logprobs are not supported by this server")
        return logprobs

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("top_logprobs is not supported by this server")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if tools:
            raise ValueError("tool calling is not supported by this server")
        return tools

    @model_validator(mode="after")
    def _one_token_limit(self) -> ChatCompletionRequest:
        limits = {self.max_tokens, self.max_completion_tokens} - {None}
        if len(limits) > 1:
            raise ValueError("max_tokens and max_completion_tokens disagree; send only max_completion_tokens")
        if isinstance(self.tool_choice, dict):
            raise ValueError("tool calling is not supported by this server")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
