"""Per-request sampling and stopping parameters, validated with messages a client can act on.

The limits on stop strings, stop token ids and logit biases bound what one request can add to the shared step:
stop strings are matched on the step loop's thread for every new piece of text (stop_strings.py), and biases and
bans are applied to the batch's logits on the device. Past them a request is refused, so that no request can slow
down its batch mates.
"""

from __future__ import annotations

import math
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tidal.worker.engine.structured_output import StructuredOutput

GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 128
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ABS_LOGIT_BIAS = 100.0
# Most alternatives returned per token: each costs a top-k over the row's vocabulary and host work to name them.
MAX_LOGPROBS = 20


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, description="0 (or below 1e-5) means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass kept (1 = off).")
    # The upper bounds are what torch takes (an int64 tensor, a uint64 seed): a value past them would fail the
    # step of the whole batch rather than this one request.
    top_k: int = Field(default=-1, le=2**63 - 1, description="Most likely tokens kept; -1 = off.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p x the top one.")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="Subtracted once per generated token.")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="Subtracted per generated occurrence.")
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, allow_inf_nan=False, description="Prompt and generated tokens: >1 discourages them."
    )
    logit_bias: dict[int, float] = Field(default_factory=dict, description="Token id -> added to its logit.")
    min_tokens: int = Field(default=0, ge=0, description="No stop (EOS, stop ids or strings) before this many.")
    max_tokens: int | None = Field(default=16, ge=1, description="Most tokens generated; None = up to max_model_len.")
    seed: int | None = Field(default=None, le=2**64 - 1, description="Makes this request's sampling reproducible.")
    stop: list[str] = Field(default_factory=list, description="Generation ends when the text contains one of these.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Generation ends on one of these tokens.")
    ignore_eos: bool = Field(default=False, description="Keep generating past the model's end-of-sequence tokens.")
    include_stop_str_in_output: bool = Field(default=False)
    skip_special_tokens: bool = Field(default=True, description="Leave special tokens out of the text.")
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="Each sampled token's logprob and this many top ones."
    )
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, description="Each prompt token's logprob (the first has none) and top."
    )
    logprobs_mode: Literal["raw", "processed"] = Field(
        default="raw",
        description="raw: the model's distribution; processed: the one sampled from (after edits, penalties, "
        "temperature and truncation).",
    )
    structured: StructuredOutput | None = Field(default=None, description="What the output must conform to.")

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must not be empty")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
        longest = max(map(len, value), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long, got {longest}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be >= 0")
        if len(value) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(value)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[int, float]) -> dict[int, float]:
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}")
        for token, bias in value.items():
            if token < 0:
                raise ValueError(f"logit_bias key {token} is not a token id (must be >= 0)")
            if not (math.isfinite(bias) and abs(bias) <= MAX_ABS_LOGIT_BIAS):
                raise ValueError(f"logit_bias of token {token} must be within -100..100, got {bias}")
        return value

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.structured is not None and self.min_tokens:
            # Its ban on stop tokens would meet a complete grammar that allows nothing else.
            raise ValueError("min_tokens cannot be combined with a structured output")
        return self

    @property
    def is_greedy(self) -> bool:
        # Below this, dividing fp32 logits by the temperature overflows (inf, then NaN probabilities), and the
        # distribution is the argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the sequence's token counts (kept on the device: see penalties.py)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def has_logit_edits(self) -> bool:
        """Whether some logits of this request's rows are biased or banned (see logit_edits.py)."""
        return bool(self.logit_bias) or self.min_tokens > 0

    @property
    def has_controls(self) -> bool:
        """Whether the sampler keeps state for this request or edits its logits (edits or penalties)."""
        return self.has_logit_edits or self.has_penalties

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether every prompt position's logits are kept (prompt logprobs), which rules out prefix-cache hits."""
        return self.prompt_logprobs is not None

    @property
    def truncates(self) -> bool:
        """Whether a random row's distribution is cut down (top-k, top-p, min-p) before it is sampled."""
        return self.top_k != -1 or self.top_p < 1.0 or self.min_p > 0.0
