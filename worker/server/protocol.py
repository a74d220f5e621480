"""Request bodies of the OpenAI-compatible API, validated at the boundary.

A field this server cannot honour (suffix, best_of > 1...) is rejected with a message naming it rather than silently
ignored: a caller who asked for it should learn that it did not happen. Unknown fields are rejected too, as OpenAI
does. The widely used non-OpenAI sampling extensions (vLLM's names) are accepted: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output`, `ignore_eos` and, for chat,
`add_generation_prompt` and `chat_template_kwargs`; for logprobs `prompt_logprobs`, `logprobs_mode` and
`return_token_ids`; and vLLM's `structured_outputs` (regex, choice, grammar, json). docs/OPENAI.md lists every field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tidal.worker.engine.sampling_params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from tidal.worker.engine.structured_output import MAX_CHOICES, MAX_GRAMMAR_CHARS
from tidal.worker.server.prompt_batch import MAX_N, MAX_PROMPTS, Prompt, as_prompt_list, check_num_choices
from tidal.worker.server.tool_calls.request import (
    MAX_TOOLS,
    ChatTool,
    FunctionDefinition,
    MessageToolCall,
    NamedToolChoice,
    ToolMode,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _documented(accepted: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """Make a field's OpenAPI schema say what this server accepts (`accepted`), while its Python type stays as wide as
    OpenAI's so that the validator can say in words why the rest is refused. A client generated from the document,
    or a contract test (tests/worker/test_api_fuzz.py), then knows what a 400 will meet."""

    def apply(schema: dict[str, Any]) -> None:
        for key in ("type", "anyOf", "items", "enum", "const", "maximum", "minimum", "additionalProperties"):
            schema.pop(key, None)
        schema.update(accepted)

    return apply


_NOT_SUPPORTED = "not supported by this server: only the default is accepted"
# More significant digits than any vocabulary's ids (or int64's 19) have: no token id of any model. Checked before
# int(), which refuses over 4300 digits (leading zeros too) with a ValueError that reached the client as a 500.
_MAX_TOKEN_ID_DIGITS = 18
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


def _batch(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_PROMPTS}


class StreamOptions(_Strict):
    include_usage: bool = False


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="a JSON schema (an object, or its JSON text) the output must validate against"
    )
    json_object: bool | None = Field(None, description="true: the output is any JSON object")
    regex: str | None = Field(None, min_length=1, max_length=MAX_GRAMMAR_CHARS)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(
        None, min_length=1, max_length=MAX_GRAMMAR_CHARS, description="an EBNF grammar (xgrammar's dialect)"
    )

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar")
        return self


class _SamplingFields(_Strict):
    """Fields shared by both endpoints, with OpenAI's ranges."""

    model: str = Field(min_length=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, description="non-OpenAI extension; -1 or 0 disables it")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="non-OpenAI extension; 0 disables it")
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, description="a string or a list of strings")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N, description="samples of each prompt, sharing its prefill")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    # Keys are token ids written as strings (JSON object keys), as OpenAI's; checked against the vocabulary later.
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="non-OpenAI extension (vLLM's)")
    user: str | None = None  # accepted and ignored
    logprobs_mode: Literal["raw", "processed"] = Field(
        "raw",
        description="non-OpenAI extension: raw = the model's own distribution (before logit_bias, penalties and "
        "temperature); processed = the distribution each token was drawn from (after them, and after top-k/top-p/"
        "min-p, whose dropped tokens read -9999)",
    )
    return_token_ids: bool = Field(False, description="non-OpenAI extension: the prompt's and completion's token ids")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="non-OpenAI extension: each prompt token's logprob and top ones"
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, stop: object) -> object:
        # OpenAI accepts a single string, a list, or null.
        return [stop] if isinstance(stop, str) else ([] if stop is None else stop)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stops: list[str]) -> list[str]:
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty strings")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop sequences may be at most {MAX_STOP_STRING_CHARS} characters long, got {longest}")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(ids)}")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if not bias:
            return bias
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}")
        for key, value in bias.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias key {key!r} is not a token id (a non-negative integer)")
            if len(key.lstrip("0")) > _MAX_TOKEN_ID_DIGITS:
                shown = f"{key[:20]}...' ({len(key)} digits)" if len(key) > 20 else f"{key}'"
                raise ValueError(f"logit_bias key '{shown} is not a token id of this model")
            if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:  # NaN fails too
                raise ValueError(f"logit_bias of {key!r} must be within -100..100, got {value}")
        return bias

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        # Without the zeros a key may lead with: int() counts them against its limit of digits.
        return {int(k.lstrip("0") or "0"): v for k, v in (self.logit_bias or {}).items()}

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def _check_min_tokens(self, limit: int | None) -> None:
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed the token limit ({limit})")

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`. A prompt (text or token ids) or a batch of them: a choice per prompt, times n."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description=f"a string, token ids, or a batch of up to {MAX_PROMPTS} of either (one choice each, times n)",
        json_schema_extra=_documented(
            {"anyOf": [{"type": "string"}, _TOKEN_IDS, _batch({"type": "string"}), _batch(_TOKEN_IDS)]}
        ),
    )
    # The legacy completions endpoint's default, as in OpenAI's API.
    max_tokens: int | None = Field(default=16, ge=0, description="0 only with echo: score the prompt, generate none")
    echo: bool = Field(False, description="the prompt's text before the completion's (and its logprobs, if asked)")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description=f"each token's logprob and its top 0..{MAX_LOGPROBS} alternatives"
    )
    best_of: int | None = Field(
        None,
        description="not supported beyond 1",
        json_schema_extra=_documented({"anyOf": [{"const": 1}, {"type": "null"}]}),
    )
    suffix: str | None = Field(None, description=_NOT_SUPPORTED, json_schema_extra=_documented({"type": "null"}))
    # As chat's (vLLM accepts it here too). ResponseFormat is defined below with chat's models; pydantic resolves
    # the name once the module is loaded.
    response_format: ResponseFormat | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @model_validator(mode="after")
    def _min_tokens_within_limit(self) -> CompletionRequest:
        self._check_min_tokens(self.max_tokens)
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it is only allowed with echo")
        if self.structured_outputs is not None and not isinstance(self.response_format, TextFormat | None):
            raise ValueError("response_format and structured_outputs both constrain the output: send one")
        return self

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


_TEXT_PARTS = {"type": "array", "items": TextPart.model_json_schema()}


class ChatMessage(BaseModel):
    # Assistant turns replayed by clients may carry extra keys (refusal: null, audio: null...); ignore those.
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = Field(
        None,
        description="text, or a list of text parts",
        json_schema_extra=_documented({"anyOf": [{"type": "string"}, _TEXT_PARTS, {"type": "null"}]}),
    )
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, description="an assistant turn's calls")
    tool_call_id: str | None = Field(None, description="a tool turn: the call it answers")

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


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema", description="a JSON schema")
    strict: bool | None = Field(
        None, description="true or unset: no properties beyond the schema's; false: unlisted ones allowed"
    )

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class ChatCompletionRequest(_SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    # None: up to the model's context length.
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = Field(False, description="each content token's logprob")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description=f"with logprobs: 0..{MAX_LOGPROBS} alternatives per token"
    )
    tools: list[ChatTool] | None = Field(
        None, max_length=MAX_TOOLS, description="functions the model may call; they go into the chat template"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none: no calls (the tools are left out of the prompt); auto (the default with tools): the model "
        "decides; required or a named function: a call is forced by a grammar",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (default: several allowed)")
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        names = [tool.function.name for tool in tools or []]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"tool names must be unique; repeated: {', '.join(repeated)}")
        return tools

    @model_validator(mode="after")
    def _tool_choice_fits_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice is None or choice == "none":
            return self
        if not self.tools:
            shown = choice if isinstance(choice, str) else f"function {choice.function.name!r}"
            raise ValueError(f"tool_choice {shown} needs tools: the request lists none")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not among the tools")
        if choice != "auto" and (
            self.structured_outputs is not None or not isinstance(self.response_format, TextFormat | None)
        ):
            raise ValueError(
                "a required or named tool_choice constrains the output to tool calls; it cannot be combined with "
                "response_format or structured_outputs"
            )
        return self

    @model_validator(mode="after")
    def _one_token_limit(self) -> ChatCompletionRequest:
        limits = {self.max_tokens, self.max_completion_tokens} - {None}
        if len(limits) > 1:
            raise ValueError("max_tokens and max_completion_tokens disagree; send only max_completion_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.structured_outputs is not None and not isinstance(self.response_format, TextFormat | None):
            raise ValueError("response_format and structured_outputs both constrain the output: send one")
        self._check_min_tokens(self.token_limit)
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_mode(self) -> ToolMode:
        """What the tools ask of this request: nothing (no tools, or none), parsing (auto), or forced calls."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def forced_tools(self) -> list[FunctionDefinition]:
        """The tools a forced call may use: the named one, or all of them (`required`)."""
        tools = [tool.function for tool in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [f for f in tools if f.name == self.tool_choice.function.name]
        return tools

    @property
    def allows_parallel_calls(self) -> bool:
        return self.parallel_tool_calls is not False and self.tool_mode != "named"
