"""From a validated request to the engine's SamplingParams."""

from __future__ import annotations

import json
from typing import Any, TypeGuard

from pydantic import ValidationError

from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.structured_output import StructuredOutput
from tidal.worker.server.errors import ApiError, describe_validation_errors
from tidal.worker.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    StructuredOutputs,
)
from tidal.worker.server.tool_calls.format import ToolCallFormat


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    max_model_len: int,
    vocab_size: int,
    tool_format: ToolCallFormat | None = None,
) -> SamplingParams:
    """The request's sampling settings; the token budget is capped by what is left of the context. `tool_format`:
    the model's tool-call format, which a required or named tool_choice forces.

    Capping rather than refusing keeps a request whose limit was only a default (16 for completions) or an
    over-generous guess working: it ends with finish_reason "length" where the context ends, as OpenAI's does.
    min_tokens is capped with it, since the context's end stops the request whatever it asked for.
    """
    # At least 1, so that an oversized prompt reaches the engine, whose refusal names the real problem.
    room = max(1, max_model_len - num_prompt_tokens)
    requested = request.token_limit
    # max_tokens 0 (echo, scoring the prompt): the engine generates one token, which the response leaves out.
    max_tokens = room if requested is None else max(1, min(requested, room))
    logit_bias = request.logit_bias_ids
    for token in logit_bias:
        if token >= vocab_size:
            message = f"logit_bias key '{token}' is not a token id of this model (its ids are 0..{vocab_size - 1})"
            raise ApiError(400, message, param="logit_bias")
    fields: dict[str, Any] = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        # OpenAI has no top_k; the common extension spells "off" as -1 or 0, the engine as -1.
        "top_k": -1 if request.top_k in (None, 0) else request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "logit_bias": logit_bias,
        "min_tokens": min(request.min_tokens, max_tokens),
        "seed": request.seed,
        "max_tokens": max_tokens,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "ignore_eos": request.ignore_eos,
        "logprobs_mode": request.logprobs_mode,
        **_logprobs_fields(request),
        "structured": structured_output(request, tool_format),
    }
    try:
        # Unset optional knobs keep the engine's defaults.
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # the engine's own limits, stricter than the request model's
        message, param = describe_validation_errors([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()])
        raise ApiError(400, message, param=param) from exc


def _logprobs_fields(request: CompletionRequest | ChatCompletionRequest) -> dict[str, int | None]:
    """The engine's logprobs (generated tokens) and prompt_logprobs: k alternatives each, None = not wanted."""
    if isinstance(request, ChatCompletionRequest):
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        return {"logprobs": logprobs, "prompt_logprobs": request.prompt_logprobs}
    prompt_k = request.prompt_logprobs
    if request.echo and request.logprobs is not None:  # the echoed prompt's logprobs, with the same k
        prompt_k = max(request.logprobs, prompt_k or 0)
    return {"logprobs": request.logprobs, "prompt_logprobs": prompt_k}


def structured_output(
    request: CompletionRequest | ChatCompletionRequest, tool_format: ToolCallFormat | None = None
) -> StructuredOutput | None:
    """What the request's output must conform to: forced tool calls, `response_format`, or the
    `structured_outputs` extension (the request model lets at most one of them through)."""
    response_format = request.response_format
    try:
        if _forces_tool_calls(request):
            return forced_tool_calls(request, tool_format)
        if isinstance(response_format, JsonObjectFormat):
            return StructuredOutput(kind="json_object")
        if isinstance(response_format, JsonSchemaFormat):
            spec = response_format.json_schema
            # Unset strict is strict, as vLLM and SGLang compile it: a schema that admits unlisted properties costs
            # xgrammar a rule per prefix of its property names (schema_cost.py), 30 names took 6.7 s.
            return StructuredOutput.json_schema(spec.schema_, strict=spec.strict is not False)
        if request.structured_outputs is not None:
            return _extension(request.structured_outputs)
    except ValidationError as exc:  # past the bounds of structured_output.py
        message = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        raise ApiError(400, message, param=structured_output_param(request)) from exc
    except RecursionError as exc:  # json.dumps recurses per level: a schema of ~1000 levels gets past the parser
        param = structured_output_param(request)
        raise ApiError(400, f"the schema in {param} is nested too deeply", param=param) from exc
    return None


def structured_output_param(request: CompletionRequest | ChatCompletionRequest) -> str:
    """The request field `structured_output` took the constraint from, for a 400 about it (a grammar that does not
    compile is found later, by the engine): a client that sent `structured_outputs` is told of that field."""
    if _forces_tool_calls(request):
        return "tools"
    if isinstance(request.response_format, JsonObjectFormat | JsonSchemaFormat):
        return "response_format"
    return "structured_outputs" if request.structured_outputs is not None else "response_format"


def _forces_tool_calls(request: CompletionRequest | ChatCompletionRequest) -> TypeGuard[ChatCompletionRequest]:
    return isinstance(request, ChatCompletionRequest) and request.tool_mode in ("required", "named")


def _extension(fields: StructuredOutputs) -> StructuredOutput:
    if fields.json_ is not None:
        schema = fields.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ApiError(400, f"structured_outputs.json is not JSON: {exc}", param="structured_outputs") from exc
            except RecursionError as exc:  # Python's parser recurses per level: "[[[[...]]]]" exhausts the stack
                raise ApiError(400, "structured_outputs.json is nested too deeply", param="structured_outputs") from exc
            if not isinstance(schema, dict):
                raise ApiError(400, "structured_outputs.json must be a JSON schema object", param="structured_outputs")
        return StructuredOutput.json_schema(schema)
    if fields.regex is not None:
        return StructuredOutput(kind="regex", text=fields.regex)
    if fields.choice is not None:
        return StructuredOutput.choice(fields.choice)
    if fields.grammar is not None:
        return StructuredOutput(kind="grammar", text=fields.grammar)
    return StructuredOutput(kind="json_object")


def forced_tool_calls(request: ChatCompletionRequest, tool_format: ToolCallFormat | None) -> StructuredOutput:
    """A structural tag that admits only calls, in the model's format, of the tools the request allows, each with
    arguments that match its parameters' schema: one call, or several when parallel calls are allowed."""
    if tool_format is None:
        raise ApiError(400, "this model has no known tool-call format (see tool_call_parser)", param="tool_choice")
    tools = [(function.name, function.parameters_schema) for function in request.forced_tools]
    parallel = request.allows_parallel_calls and request.tool_mode == "required"
    return StructuredOutput.structural_tag({"type": "structural_tag", "format": tool_format.forced(tools, parallel)})
