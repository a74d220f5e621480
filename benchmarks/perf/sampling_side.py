"""What benchmarks/sampling_perf.py runs: its workloads and the requests' sampling parameters, plain and featured.

Decode is timed as gpu_perf.py times it (engine_side.measure_decode: every row generates exactly N tokens, the
first few untimed) on three mixes of one batch: all greedy (gpu_perf's own run, set against its recorded figure),
plain (rows alternately greedy and sampled), and featured (the plain rows, half of them also asking for top-5
logprobs, presence/frequency/repetition penalties and a logit bias). Offline throughput is gpu_perf's batch, all
greedy, once plain and once with every request under a JSON schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from perf.presets import Workload, check_decode_timing
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.structured_output import StructuredOutput

SAMPLED_TEMPERATURE = 0.8
FEATURES: dict[str, Any] = {
    "logprobs": 5,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.1,
    "logit_bias": {10: -100.0, 11: -100.0, 12: 2.0, 13: 2.0},  # ids every preset's vocabulary has
}


class SamplingWorkload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    decode_batch: int = Field(ge=2, description="rows of each decode mix (half of them featured)")
    decode_prompt_len: int = Field(ge=1)
    decode_new_tokens: int = Field(ge=2)
    decode_warmup_tokens: int = Field(ge=1, description="first tokens of a decode run not timed")
    decode_repeats: int = Field(ge=1, description="runs of each mix, interleaved; the median is reported")
    offline_requests: int = Field(ge=1)
    offline_input_len: int = Field(ge=1)
    offline_output_len: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> Self:
        check_decode_timing(self.decode_warmup_tokens, self.decode_new_tokens)
        return self

    def engine_workload(self) -> Workload:
        """The gpu_perf workload that sizes the engine alike (batch, token budget, max_num_seqs)."""
        return Workload(
            decode_batches=[self.decode_batch],
            transformers_decode_batches=[],
            decode_prompt_len=self.decode_prompt_len,
            decode_new_tokens=self.decode_new_tokens,
            decode_warmup_tokens=self.decode_warmup_tokens,
            ttft_prompt_len=1,
            ttft_repeats=1,
            offline_requests=self.offline_requests,
            offline_input_len=self.offline_input_len,
            offline_output_len=self.offline_output_len,
        )


# gpu_perf's batch-64 decode and offline batch (perf/presets.py GPU_WORKLOAD), so plain figures compare with its.
WORKLOADS: Mapping[str, SamplingWorkload] = MappingProxyType(
    {
        "cuda": SamplingWorkload(
            decode_batch=64,
            decode_prompt_len=128,
            decode_new_tokens=64,
            decode_warmup_tokens=16,
            decode_repeats=3,
            offline_requests=256,
            offline_input_len=256,
            offline_output_len=256,
        ),
        "cpu": SamplingWorkload(
            decode_batch=8,
            decode_prompt_len=32,
            decode_new_tokens=24,
            decode_warmup_tokens=8,
            decode_repeats=2,
            offline_requests=16,
            offline_input_len=32,
            offline_output_len=32,
        ),
        "smoke": SamplingWorkload(
            decode_batch=4,
            decode_prompt_len=8,
            decode_new_tokens=6,
            decode_warmup_tokens=2,
            decode_repeats=1,
            offline_requests=4,
            offline_input_len=12,
            offline_output_len=8,
        ),
    }
)


def workload_for(device_type: str, smoke: bool) -> SamplingWorkload:
    return WORKLOADS["smoke" if smoke else device_type]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True)


def plain_row(index: int) -> SamplingParams:
    """Even rows greedy, odd rows sampled; exactly max_tokens each (ignore_eos)."""
    temperature = 0.0 if index % 2 == 0 else SAMPLED_TEMPERATURE
    return SamplingParams(temperature=temperature, ignore_eos=True)


def is_featured(index: int) -> bool:
    """Half the rows, greedy and sampled alike (0, 1, 4, 5, ...)."""
    return index % 4 < 2


def decode_mixes(batch: int) -> dict[str, list[SamplingParams]]:
    plain = [plain_row(i) for i in range(batch)]
    featured = [p.model_copy(update=FEATURES) if is_featured(i) else p for i, p in enumerate(plain)]
    return {"greedy": [greedy()] * batch, "plain": plain, "featured": featured}


def long_json_schema(max_tokens: int) -> dict[str, Any]:
    """An object whose array must hold at least 2 x `max_tokens` strings. A token ends at most two items: the tiny
    tokenizer's hold one quote at most, grammar_vocab's runs of punctuation are 4 characters at most. So the
    grammar cannot complete within max_tokens, whatever a random model picks: every request runs its full length,
    as plain ones do (the report counts the tokens to show it)."""
    min_items = 2 * max_tokens
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "lines": {"type": "array", "items": {"type": "string"}, "minItems": min_items},
        },
        "required": ["title", "lines"],
        "additionalProperties": False,
    }


def structured(spec: StructuredOutput) -> SamplingParams:
    """Greedy under `spec`; ignore_eos as the plain run has it (EOS ends such a request only where its grammar is
    complete anyway)."""
    return SamplingParams(temperature=0.0, ignore_eos=True, structured=spec)
