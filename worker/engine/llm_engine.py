"""The synchronous engine: requests in, one step at a time, text deltas out (tests and benchmarks use it
directly; AsyncEngine runs it on a background thread)."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Self

from transformers import PreTrainedTokenizerBase

from tidal.worker.engine.block_manager import BlockManager
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.detokenizer import IncrementalDetokenizer, WindowDecoder, push_each
from tidal.worker.engine.engine_setup import (
    EngineConfigError,
    decide_num_kv_blocks,
    fit_max_model_len,
    resolve_device,
    resolve_max_model_len,
)
from tidal.worker.engine.errors import DuplicateRequestError, EmptyPromptError, InvalidTokenError, PromptTooLongError
from tidal.worker.engine.model_runner import ModelRunner
from tidal.worker.engine.outputs import EngineStats, FinishReason, GenerationResult, RequestOutput
from tidal.worker.engine.sampler import Sampler
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.scheduler import Scheduler, SchedulerLimits
from tidal.worker.engine.sequence import Sequence
from tidal.worker.engine.step_plan import build_step_plan
from tidal.worker.engine.stop_checker import token_stop_reason
from tidal.worker.engine.text_stream import TextStream
from tidal.worker.loader.hf_config import eos_token_ids, model_max_len
from tidal.worker.loader.model_loader import LoadedModel, load_model, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: TextStream


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        eos_token_ids: set[int],
    ) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.vocab_size = runner.model.vocab_size
        self.block_manager = BlockManager(runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        limits = SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens)
        self.scheduler = Scheduler(limits, self.block_manager)
        self.sampler = Sampler(runner.device, config.seed)
        self._window_decoder = WindowDecoder(tokenizer)
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> Self:
        device = resolve_device(config.device)
        return cls.from_loaded_model(config, load_model(config.model_path, config.dtype, device))

    @classmethod
    def from_loaded_model(cls, config: EngineConfig, loaded: LoadedModel) -> Self:
        """An engine around a model whose weights are already on `config.device` (benchmarks fill random weights
        in memory); the tokenizer and EOS ids still come from `config.model_path`."""
        device = resolve_device(config.device)
        weights_device = next(loaded.model.parameters()).device
        if weights_device.type != device.type:
            raise EngineConfigError(f"the model's weights are on {weights_device}, the engine runs on {device}")
        tokenizer = load_tokenizer(config.model_path)
        max_model_len = resolve_max_model_len(config, model_max_len(loaded.hf_config))
        runner = ModelRunner(loaded.model, loaded.dtype, device, config.block_size)
        runner.allocate_kv_cache(decide_num_kv_blocks(config, runner, max_model_len))
        max_model_len = fit_max_model_len(config, max_model_len, runner.num_kv_blocks)
        if device.type == "cuda" and not config.enforce_eager:
            runner.capture_cuda_graphs(config.max_num_seqs, max_model_len)
        return cls(config, runner, tokenizer, max_model_len, eos_token_ids(config.model_path, loaded.hf_config))

    @property
    def model_name(self) -> str:
        return self.config.model_name

    # ----- requests -----
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise a RequestRejectedError (a ValueError) for a prompt that must not be queued. Reads only
        immutable engine facts, so any thread may call it."""
        if not prompt_token_ids:
            raise EmptyPromptError()
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(prompt_token_ids), self.max_model_len)
        for token in prompt_token_ids:
            if not 0 <= token < self.vocab_size:
                raise InvalidTokenError(token, self.vocab_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise DuplicateRequestError(request_id)
        self.validate_prompt(prompt_token_ids)
        seq = Sequence(next(self._seq_ids), request_id, list(prompt_token_ids), params)
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
        self._requests[request_id] = _Request(seq, detokenizer, TextStream(detokenizer, params))
        self.scheduler.add(seq)
        self._num_prompt_tokens += seq.num_prompt_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its blocks; -> its final output, or None if it is not (or no longer) here."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        return self._finish(request, "abort", new_token_ids=[], new_text="")

    def abort_all(self) -> list[RequestOutput]:
        """Drop every request (shutdown, or recovery after a failed step)."""
        outputs = (self.abort_request(request_id) for request_id in list(self._requests))
        return [out for out in outputs if out is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache (after new weights, or a KV cache that was freed); -> blocks forgotten."""
        return self.block_manager.reset_prefix_cache()

    # ----- the step -----
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; -> a delta for every request that got a token (or finished)."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        plan = build_step_plan(scheduled, self.config.block_size)
        logits = self.runner.execute(plan)
        if logits is None:
            self.scheduler.on_step_done(scheduled, {})
            return []
        # The sequences that sample, in batch order: the plan's sample_seq_ids.
        seqs = [item.seq for item in scheduled.scheduled if item.will_sample]
        tokens = self.sampler.sample(logits, [seq.params for seq in seqs], plan.sample_seq_ids)
        self.scheduler.on_step_done(scheduled, dict(zip(plan.sample_seq_ids, tokens, strict=True)))
        requests = [self._requests[seq.request_id] for seq in seqs]
        texts = push_each(self._window_decoder, [r.detokenizer for r in requests], tokens)
        self._num_generated_tokens += len(tokens)
        outputs = []
        for request, token, text in zip(requests, tokens, texts, strict=True):
            seq = request.seq
            new_text = request.text.add_text(text) if text else ""
            if request.text.stopped:
                reason: FinishReason | None = "stop"
            else:
                reason = token_stop_reason(seq, self.eos_token_ids, self.max_model_len)
            if reason is None:
                outputs.append(
                    RequestOutput(seq.request_id, [token], new_text, None, len(seq.prompt_token_ids),
                                  len(seq.token_ids) - len(seq.prompt_token_ids))
                )  # fmt: skip
            else:
                outputs.append(self._finish(request, reason, [token], new_text + request.text.flush()))
        return outputs

    def _finish(
        self, request: _Request, reason: FinishReason, new_token_ids: list[int], new_text: str
    ) -> RequestOutput:
        seq = request.seq
        self.scheduler.finish(seq, reason)
        self.sampler.forget(seq.seq_id)
        del self._requests[seq.request_id]
        return self._output(seq, new_token_ids, new_text, reason)

    @staticmethod
    def _output(seq: Sequence, token_ids: list[int], text: str, reason: FinishReason | None) -> RequestOutput:
        return RequestOutput(seq.request_id, token_ids, text, reason, seq.num_prompt_tokens, seq.num_output_tokens)

    # ----- batch use and stats -----
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Run `prompts` to completion together (continuous batching); results in prompt order."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._seq_ids)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, all_params, strict=True):
            self.add_request(request_id, prompt, p)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        reasons: dict[str, FinishReason] = {}
        while len(reasons) < len(ids):
            for out in self.step():
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.new_text)
                if out.finish_reason is not None:
                    reasons[out.request_id] = out.finish_reason
        return [
            GenerationResult(
                request_id=i,
                prompt_token_ids=list(p),
                output_token_ids=tokens[i],
                text="".join(texts[i]),
                finish_reason=reasons[i],
            )
            for i, p in zip(ids, prompts, strict=True)
        ]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.block_manager.usage,
            num_kv_blocks=self.block_manager.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generated_tokens=self._num_generated_tokens,
            num_prefix_cache_hit_tokens=self.block_manager.num_prefix_hit_tokens,
        )
