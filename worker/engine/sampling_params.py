"""Per-request sampling and stopping parameters, validated with messages a client can act on."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

GREEDY_BELOW_TEMPERATURE = 1e-5


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, ge=0.0, description="0 (or below 1e-5) means greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass kept (1 = off).")
    # The upper bounds are what torch takes (an int64 tensor, a uint64 seed): a value past them would fail the
    # step of the whole batch rather than this one request.
    top_k: int = Field(default=-1, le=2**63 - 1, description="Most likely tokens kept; -1 = off.")
    max_tokens: int | None = Field(default=16, ge=1, description="Most tokens generated; None = up to max_model_len.")
    seed: int | None = Field(default=None, le=2**64 - 1, description="Makes this request's sampling reproducible.")
    stop: list[str] = Field(default_factory=list, description="Generation ends when the text contains one of these.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Generation ends on one of these tokens.")
    ignore_eos: bool = Field(default=False, description="Keep generating past the model's end-of-sequence tokens.")
    include_stop_str_in_output: bool = Field(default=False)
    skip_special_tokens: bool = Field(default=True, description="Leave special tokens out of the text.")

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
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be >= 0")
        return value

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        return self

    @property
    def is_greedy(self) -> bool:
        # Below this, dividing fp32 logits by the temperature overflows (inf, then NaN probabilities), and the
        # distribution is the argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE
