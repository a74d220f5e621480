"""The OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each handler reads like the request's life: check the engine can serve, take an admission slot (429 when the worker
holds `max_concurrent_requests` already), build the prompt off the event loop, check its length, start the generation
(the engine may still refuse it: 400), then stream it or collect it. The slot goes back when the generation closes.
A request's choices (its prompts times `n`) are one `Choices`: one slot, one prefill per prompt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tidal.worker.metrics import WorkerMetrics
from tidal.worker.models.registry import tool_call_format_of
from tidal.worker.server.admission import RequestSlots, Slot
from tidal.worker.server.choices import Choices, Collected, collect
from tidal.worker.server.config import ServerConfig
from tidal.worker.server.errors import ApiError, ErrorResponse
from tidal.worker.server.generation import Generation
from tidal.worker.server.prompt_limit import PromptLimit
from tidal.worker.server.prompts import PromptBuilder
from tidal.worker.server.protocol import ChatCompletionRequest, CompletionRequest
from tidal.worker.server.responses import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    new_id,
)
from tidal.worker.server.runtime import WorkerRuntime
from tidal.worker.server.sampling import sampling_params, structured_output_param
from tidal.worker.server.shaping import ChatShape, CompletionShape
from tidal.worker.server.streaming import SSEResponse, chat_events, completion_events
from tidal.worker.server.token_info import TokenTexts
from tidal.worker.server.tool_calls.families import choose_format
from tidal.worker.server.tool_calls.format import ToolCallFormat

if TYPE_CHECKING:
    from tidal.worker.engine.async_engine import AsyncEngine

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 408, 413, 429, 503)}


def _answers(whole: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A generation's 200: the whole answer as JSON, or with `stream: true` server-sent events of its chunks."""
    events = {"text/event-stream": {"schema": {"type": "string", "description": "`data: <chunk JSON>` events"}}}
    return {200: {"model": whole, "content": events}}


def openai_router(
    runtime: WorkerRuntime, metrics: WorkerMetrics, config: ServerConfig, prompt_builder: PromptBuilder
) -> APIRouter:
    router = APIRouter(prefix="/v1", responses=_ERRORS)  # type: ignore[arg-type]
    slots = RequestSlots(config.max_concurrent_requests, config.overload_retry_after_s)

    def engine_for(model: str) -> AsyncEngine:
        engine = runtime.require_engine()
        if model != runtime.served_model_name:
            raise ApiError(
                404, f"model {model!r} is not served here; this server serves {runtime.served_model_name!r}",
                param="model", code="model_not_found",
            )  # fmt: skip
        return engine

    async def start(
        engine: AsyncEngine, endpoint: str, request: CompletionRequest | ChatCompletionRequest, request_id: str
    ) -> Choices:
        try:
            slot = slots.acquire()
        except ApiError:
            metrics.record_finished(endpoint, "rejected")
            raise
        try:
            return await start_admitted(slot, engine, endpoint, request, request_id)
        except BaseException:
            slot.release()
            raise

    async def start_admitted(
        slot: Slot,
        engine: AsyncEngine,
        endpoint: str,
        request: CompletionRequest | ChatCompletionRequest,
        request_id: str,
    ) -> Choices:
        try:
            tool_format = tool_format_for(engine, request)
            all_prompt_ids = await prompts_for(engine, request)
            all_params = [
                sampling_params(request, len(ids), engine.max_model_len, engine.vocab_size, tool_format)
                for ids in all_prompt_ids
            ]
        except ApiError:
            metrics.record_finished(endpoint, "rejected")
            raise
        grammar_param = structured_output_param(request)
        ids = [request_id] if len(all_prompt_ids) == 1 else [f"{request_id}-{i}" for i in range(len(all_prompt_ids))]
        generations = [
            Generation(engine, metrics, endpoint, i, prompt_ids, params, n=request.n, grammar_param=grammar_param)
            for i, prompt_ids, params in zip(ids, all_prompt_ids, all_params, strict=True)
        ]
        choices = Choices(generations, request.n, on_close=slot.release)
        await choices.start()  # each generation accounts for its own refusal
        return choices

    def tool_format_for(
        engine: AsyncEngine, request: CompletionRequest | ChatCompletionRequest
    ) -> ToolCallFormat | None:
        """The format the request's tool calls are written in; None when it has none to make."""
        if not isinstance(request, ChatCompletionRequest) or request.tool_mode == "none":
            return None
        tool_format = choose_format(config.tool_call_parser, tool_call_format_of(engine.model_class))
        if tool_format is None:
            raise ApiError(
                400, "tool calls are not supported for this model: its architecture has no known tool-call format "
                "and the worker was not given one (tool_call_parser)", param="tools",
            )  # fmt: skip
        return tool_format

    async def prompts_for(engine: AsyncEngine, request: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
        # A text that cannot fit is refused before it is tokenized, by the same limit the checks below apply.
        prompt_limit = PromptLimit.of(engine.max_model_len, config.max_prompt_tokens)
        if isinstance(request, ChatCompletionRequest):
            # tool_choice none leaves the tools out of the prompt: a model that is not told of them will not call.
            tools = (
                [t.model_dump(exclude_none=True) for t in request.tools or []] if request.tool_mode != "none" else []
            )
            chat_ids = await prompt_builder.chat_ids(
                engine.tokenizer, request.messages, request.add_generation_prompt, request.chat_template_kwargs,
                tools=tools or None, limit=prompt_limit,
            )  # fmt: skip
            all_prompt_ids, param = [chat_ids], "messages"
        else:
            all_prompt_ids = await prompt_builder.completion_ids(engine.tokenizer, request.prompts, prompt_limit)
            param = "prompt"
        limit = config.max_prompt_tokens
        for prompt_ids in all_prompt_ids:
            if limit is not None and len(prompt_ids) > limit:
                raise ApiError(
                    400, f"the prompt has {len(prompt_ids)} tokens but this worker accepts at most {limit} "
                    "(max_prompt_tokens)", param=param, code="context_length_exceeded",
                )  # fmt: skip
        return all_prompt_ids

    def stream(events: Callable[[], AsyncIterator[str]], choices: Choices) -> SSEResponse:
        return SSEResponse(events(), on_close=choices.close, write_timeout_s=config.stream_write_timeout_s)

    @router.get("/models")
    async def list_models() -> ModelList:
        engine = runtime.require_engine()
        return ModelList(data=[ModelCard(id=runtime.served_model_name, max_model_len=engine.max_model_len)])

    @router.post("/completions", response_model=None, responses=_answers(CompletionResponse))
    async def create_completion(body: CompletionRequest, http_request: Request) -> Response | CompletionResponse:
        response_id = new_id("cmpl")
        engine = engine_for(body.model)
        choices = await start(engine, "completions", body, response_id)
        try:
            shape = CompletionShape(body, await echoed_texts(engine, body, choices), TokenTexts(engine.tokenizer))
        except BaseException:
            choices.close()
            raise
        if body.stream:
            include_usage = body.include_usage_in_stream
            return stream(lambda: completion_events(choices, response_id, body.model, include_usage, shape), choices)
        collected = await collect(choices, http_request.is_disconnected)
        usage = Usage.of(choices.num_prompt_tokens, 0 if shape.scores_only else choices.num_output_tokens)
        return CompletionResponse(
            id=response_id, model=body.model, usage=usage,
            choices=[
                shape.whole(i, choices.generation_of(i), c, choices.finish_reason(i)) for i, c in enumerate(collected)
            ],
        )  # fmt: skip

    async def echoed_texts(engine: AsyncEngine, body: CompletionRequest, choices: Choices) -> list[str]:
        """Each prompt's text, for echo: as sent, or decoded from the token ids sent."""
        if not body.echo:
            return []
        texts = []
        for prompt, generation in zip(body.prompts, choices.generations, strict=True):
            if isinstance(prompt, str):
                texts.append(prompt)
            else:
                texts.append(await prompt_builder.text_of(engine.tokenizer, generation.prompt_token_ids))
        return texts

    @router.post("/chat/completions", response_model=None, responses=_answers(ChatCompletionResponse))
    async def create_chat_completion(
        body: ChatCompletionRequest, http_request: Request
    ) -> Response | ChatCompletionResponse:
        response_id = new_id("chatcmpl")
        engine = engine_for(body.model)
        choices = await start(engine, "chat_completions", body, response_id)
        shape = ChatShape(body, TokenTexts(engine.tokenizer), tool_format_for(engine, body))
        if body.stream:
            include_usage = body.include_usage_in_stream
            return stream(lambda: chat_events(choices, response_id, body.model, include_usage, shape), choices)
        collected = await collect(choices, http_request.is_disconnected)
        usage = Usage.of(choices.num_prompt_tokens, choices.num_output_tokens)
        return ChatCompletionResponse(
            id=response_id, model=body.model, usage=usage,
            prompt_token_ids=shape.token_ids(choices.generations[0].prompt_token_ids),
            prompt_logprobs=shape.prompt_logprobs(choices.generations[0]),
            choices=[chat_choice(shape, i, c, choices.finish_reason(i)) for i, c in enumerate(collected)],
        )  # fmt: skip

    return router


def chat_choice(shape: ChatShape, index: int, collected: Collected, finish: str | None) -> ChatChoice:
    message, finish = shape.message(collected.text, finish)
    return ChatChoice(
        index=index, message=message, finish_reason=finish,  # type: ignore[arg-type]
        logprobs=shape.logprobs(collected.logprobs), token_ids=shape.token_ids(collected.token_ids),
    )  # fmt: skip
