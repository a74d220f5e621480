"""What the engine hands back: per-step deltas, whole results for batch use, and load statistics."""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from tidal.worker.layers.expert_exchange import ExchangeSnapshot

FinishReason = Literal["stop", "length", "abort"]


class TokenLogprob(NamedTuple):
    """One position: the chosen (sampled, or the prompt's) token's logprob and rank, and the top k of its row."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


class RequestOutput(NamedTuple):
    """The new part of one request's output since the previous RequestOutput for it.

    Immutable like the rest, but a NamedTuple rather than a pydantic model or a frozen dataclass: the engine makes
    one per request per step, only our own code builds them (nothing to validate), and a tuple is the cheapest
    immutable record to build (a frozen dataclass's __init__ costs twice as much)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    sample_index: int = 0  # which of the request's n samples this is
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for logprobs
    # Once, on the first output of sample 0 of a request that asked: one per prompt token, the first None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Set on a final output (finish_reason "abort") when the engine ended the request for a cause of its own that
    # the client must be told of (its grammar's masks too slow); the async engine delivers it as an error.
    error: str | None = None


class GenerationResult(BaseModel):
    """A finished request as a whole (LLMEngine.generate)."""

    model_config = ConfigDict(frozen=True)

    request_id: str
    sample_index: int = 0
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason


class EngineStats(BaseModel):
    model_config = ConfigDict(frozen=True)

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # share of KV blocks in use, 0..1
    num_kv_blocks: int
    num_preemptions: int  # since start
    num_prompt_tokens: int  # since start, prompt tokens of admitted requests
    num_generated_tokens: int  # since start
    num_prefix_cache_hit_tokens: int  # since start
    num_grammar_mask_timeouts: int = 0  # since start, requests ended because a mask took longer than the limit
    expert_exchanges: ExchangeSnapshot | None = None  # expert parallelism's traffic since the load; else None
