"""The engine: requests in, steps, text deltas out (tests and benchmarks use it directly; AsyncEngine runs it on a
background thread).

With `async_scheduling` (the default) a step is launched before the previous step's sampled tokens are read:
its sequences' unknown last tokens come from the device, and the host reads, detokenizes and stop-checks the
previous step while the device computes this one. `step()` then returns the previous step's outputs. A sequence
that must end by length once its pending token is read leaves the batch before the next step is scheduled, so
the schedule is the one a step-at-a-time engine makes; one that ends on a token (EOS, stop id, stop string) is
found a step late and its row in the step already launched is wasted and dropped. While a request with a structured
output is live, a step's sampling waits for the read: its grammar's mask for the next token depends on the token
sampled in the step before. So the step's forward is launched first, the previous step read while the device runs
it (advancing the matchers), and the sampling queued last with masks that know those tokens: the device stays busy
as in plain async scheduling, and only the mask's bytes go over between the read and the sampling.

A request asking for n samples is n sequences sharing one prefill (engine/fork.py); each sample's outputs carry its
`sample_index`, and the request ends when all n have.

Logprobs travel with the sampled tokens (`SampledTokens`): the sampler computes them for the rows that ask, and a
prefill chunk of a sequence asking for prompt logprobs also keeps its positions' logits (`StepPlan.prompt_logit_rows`);
the host reads them with the tokens, a step later.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, NamedTuple, Self

import torch
from transformers import PreTrainedTokenizerBase

from tidal.kernels.fp8_linear import check_fp8_weights_fit
from tidal.kernels.kv_cache_dtype import check_device_holds, kv_cache_dtype
from tidal.worker.engine.block_manager import BlockManager
from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.detokenizer import IncrementalDetokenizer, WindowDecoder, push_each
from tidal.worker.engine.engine_setup import (
    EngineConfigError,
    decide_num_kv_blocks,
    expert_parallel_config,
    fit_max_model_len,
    resolve_device,
    resolve_max_model_len,
    warm_up_expert_parallel,
)
from tidal.worker.engine.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidLogitBiasError,
    InvalidTokenError,
    PromptTooLongError,
)
from tidal.worker.engine.fork import Forks, sample_params
from tidal.worker.engine.grammars import GrammarCompiler, new_matcher
from tidal.worker.engine.host_tensors import int64_tensor, to_device
from tidal.worker.engine.in_flight import EngineRequest, InFlightStep, PendingToken
from tidal.worker.engine.logprobs import DeviceLogprobs
from tidal.worker.engine.model_runner import ModelRunner
from tidal.worker.engine.outputs import EngineStats, FinishReason, GenerationResult, RequestOutput, TokenLogprob
from tidal.worker.engine.sample_batch import SampleBatch
from tidal.worker.engine.sampled_tokens import SampledTokens
from tidal.worker.engine.sampler import Sampler
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from tidal.worker.engine.sequence import Sequence, SequenceStatus
from tidal.worker.engine.step_plan import StepPlan, build_step_plan
from tidal.worker.engine.stop_checker import token_stop_reason
from tidal.worker.engine.text_stream import TextStream
from tidal.worker.layers.expert_parallel import ExpertParallelSettings
from tidal.worker.loader.hf_config import eos_token_ids, model_max_len
from tidal.worker.loader.model_loader import LoadedModel, load_model, load_tokenizer
from tidal.worker.memory.provider import MemoryProvider

log = logging.getLogger(__name__)


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
        self.sampler = Sampler(
            runner.device, config.seed, frozenset(eos_token_ids), config.grammar_mask_limit_ms / 1000
        )
        self._window_decoder = WindowDecoder(tokenizer)
        self._requests: dict[int, EngineRequest] = {}  # seq_id -> the sample it runs
        self._samples: dict[str, list[EngineRequest]] = {}  # request id -> its samples not finished yet
        self._forks = Forks(self.block_manager, self.scheduler)
        self._in_flight: InFlightStep | None = None  # launched, its tokens not read yet (async scheduling)
        self._seq_ids = itertools.count()
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_controlled = 0  # live requests with logit edits or penalties (see _sample_batch)
        self._num_logprobs = 0  # live requests asking for logprobs (see _sample_batch)
        self._num_structured = 0  # live samples with a grammar matcher (see step)
        self._num_grammar_mask_timeouts = 0
        # Final outputs of requests ended while a step's sampling was queued (a grammar's mask past its limit),
        # handed out with that step() call's outputs.
        self._ended_early: list[RequestOutput] = []
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, eos_token_ids)

    @classmethod
    def from_config(cls, config: EngineConfig, memory: MemoryProvider | None = None) -> Self:
        """`memory`: where the weights and the KV cache are allocated (default: plain torch storage; the lifecycle
        passes CUDA virtual memory so that they can be released and restored at the same addresses)."""
        device = resolve_device(config.device)
        group = ExpertParallelSettings(
            config.rank,
            config.world_size,
            config.redundant_experts_per_rank,
            config.expert_slots_per_rank,
            config.time_expert_exchanges,
        )
        if config.weight_dtype == "fp8":
            try:
                check_fp8_weights_fit(device)
            except ValueError as error:
                raise EngineConfigError(str(error)) from None
        loaded = load_model(config.model_path, config.dtype, device, memory, group, config.weight_dtype)
        return cls.from_loaded_model(config, loaded)

    @classmethod
    def from_loaded_model(cls, config: EngineConfig, loaded: LoadedModel) -> Self:
        """An engine around a model whose weights are already on `config.device` (benchmarks fill random weights
        in memory); its KV cache comes from the provider that placed the weights. The tokenizer and EOS ids still
        come from `config.model_path`."""
        device = resolve_device(config.device)
        if loaded.weights.device.type != device.type:
            raise EngineConfigError(f"the model's weights are on {loaded.weights.device}, the engine runs on {device}")
        tokenizer = load_tokenizer(config.model_path)
        if loaded.model.expert_parallel is not None:
            config = expert_parallel_config(config, device)
        max_model_len = resolve_max_model_len(config, model_max_len(loaded.hf_config))
        cache_dtype = kv_cache_dtype(config.kv_cache_dtype, loaded.dtype)
        try:
            check_device_holds(cache_dtype, device)
        except ValueError as error:
            raise EngineConfigError(str(error)) from None
        runner = ModelRunner(loaded, device, config.block_size, cache_dtype)
        runner.allocate_kv_cache(decide_num_kv_blocks(config, runner, max_model_len))
        max_model_len = fit_max_model_len(config, max_model_len, runner.num_kv_blocks)
        warm_up_expert_parallel(runner, config, max_model_len)
        if device.type == "cuda" and not config.enforce_eager:
            try:
                runner.capture_cuda_graphs(config.max_num_seqs, max_model_len, config.prefill_graph_tokens)
            except torch.OutOfMemoryError as error:
                raise EngineConfigError(
                    f"the CUDA graphs did not fit beside the KV cache ({error}); lower gpu_memory_fraction (now "
                    f"{config.gpu_memory_fraction}), max_num_seqs or cuda_graph_prefill_tokens, or set enforce_eager"
                ) from None
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

    def validate_params(self, params: SamplingParams) -> None:
        """Raise a RequestRejectedError for parameters that only this model can judge: a logit_bias key outside
        its vocabulary would index past the batch's logits on the device and fail every request of the step."""
        for token in params.logit_bias:
            if token >= self.vocab_size:
                raise InvalidLogitBiasError(token, self.vocab_size)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, n: int = 1, grammar: Any = None
    ) -> None:
        """Queue a request for `n` samples of the prompt (n > 1: one prefill, then n sequences; see engine/fork.py).
        `grammar`: its structured output compiled (`self.grammars.submit`); without it, one is compiled here and
        now, which only offline use may afford (the async engine compiles off the step loop first)."""
        if request_id in self._samples:
            raise DuplicateRequestError(request_id)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.validate_prompt(prompt_token_ids)
        self.validate_params(params)
        if params.structured is not None and grammar is None:
            grammar = self.grammars.compile(params.structured)  # raises InvalidGrammarError before anything is queued
        samples = [self._new_sample(request_id, prompt_token_ids, sample_params(params, i), i) for i in range(n)]
        self._samples[request_id] = samples
        for sample in samples:
            self._requests[sample.seq.seq_id] = sample
            self._num_controlled += sample.seq.params.has_controls
            self._num_logprobs += sample.seq.params.logprobs is not None
            if params.structured is not None:
                sample.matcher = new_matcher(grammar)
                self._num_structured += 1
        self.scheduler.add(samples[0].seq)
        if n > 1:
            self._forks.add(samples[0], samples[1:])
        self._num_prompt_tokens += len(prompt_token_ids)

    def _new_sample(self, request_id: str, prompt: list[int], params: SamplingParams, index: int) -> EngineRequest:
        seq = Sequence(next(self._seq_ids), request_id, list(prompt), params, sample_index=index)
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
        limit = self.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + params.max_tokens)
        request = EngineRequest(seq, detokenizer, TextStream(detokenizer, params), limit)
        request.prompt_logprobs_due = params.prompt_logprobs is not None and index == 0
        return request

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Drop a request (all its samples) and free its blocks; -> the final output of each sample still running
        (none if the request is not, or no longer, here). A token of it still being sampled is dropped (never handed
        out). Its blocks may go to another sequence at once, while a step in flight still reads and writes them: the
        device runs steps in launch order."""
        samples = self._samples.get(request_id)
        if samples is None:
            return []
        finals = []
        for request in list(samples):
            self._forks.drop(request.seq.seq_id)
            request.seq.drop_unknown_tokens()
            finals.append(self._finish(request, "abort", new_token_ids=[], new_text=""))
        return finals

    def abort_all(self) -> list[RequestOutput]:
        """Drop every request (shutdown, or recovery after a failed step) and the step in flight; -> their final
        outputs. The device is idle when it returns."""
        finals = [out for request_id in list(self._samples) for out in self.abort_request(request_id)]
        finals += self._ended_early
        self._ended_early = []
        self._in_flight = None
        self.sampler.discard_prepared_masks()  # prepared for a sampling that will not happen now
        self.sampler.take_slow_masks()  # their requests are ended above
        self.runner.synchronize()  # nothing may still write the cache (a sleep may release it next)
        return finals

    @property
    def has_step_in_flight(self) -> bool:
        """Whether a launched step's tokens are still to be read (async scheduling, between two `step()`s)."""
        return self._in_flight is not None

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work: a request to run, or a step in flight to read."""
        return bool(self._requests) or self._in_flight is not None

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache (after new weights, or a KV cache that was freed); -> blocks forgotten."""
        return self.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """End the engine's threads once no step runs: compiles still queued are dropped (their requests will not
        run now) and the grammar masks' fill thread ends."""
        self.grammars.shutdown()
        self.sampler.close()

    # ----- the step -----
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; -> a delta for every request that got a token (or finished). With
        async_scheduling the deltas are those of the step launched by the previous call, read while the step
        launched by this one runs on the device."""
        return self._with_ended_early(self._step())

    def _with_ended_early(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` and the final outputs of requests ended while the step's sampling was queued."""
        ended, self._ended_early = self._ended_early, []
        return outputs + ended if ended else outputs

    def _step(self) -> list[RequestOutput]:
        if not self.config.async_scheduling:
            outputs = self.drain()
            launched = self._launch(None)
            if launched is None:
                return outputs
            self.scheduler.commit(launched.scheduled)
            return outputs + self._read(launched)
        previous = self._in_flight
        if self._num_structured:
            # A structured row's next mask needs the token of the step before: launch the forward, read the step
            # before while it runs (advancing the matchers), then queue the sampling.
            forward = self._launch_forward(previous)
            outputs = self._read(previous, forward) if previous is not None else []
            launched = self._sample(forward) if forward is not None else None
        else:
            launched = self._launch(previous)
            outputs = self._read(previous) if previous is not None else []
        if launched is not None:
            # Its input tokens are all known now (the previous step's were just read): hash its full blocks.
            self.scheduler.commit(launched.scheduled)
        self._in_flight = launched
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Read the step in flight without launching another; -> its outputs. The device is idle afterwards (for
        whatever must not overlap a step: sleep, weight updates, changes to the block pool)."""
        if self._in_flight is None:
            return []
        outputs = self._read(self._in_flight)
        self._in_flight = None
        return outputs

    def _launch(self, previous: InFlightStep | None) -> InFlightStep | None:
        """Schedule and launch a step (`previous`: the step in flight, not read yet); None if nothing runs."""
        forward = self._launch_forward(previous)
        return self._sample(forward) if forward is not None else None

    def _launch_forward(self, previous: InFlightStep | None) -> LaunchedForward | None:
        """Schedule a step and queue its forward (up to the logits), not its sampling; None if nothing runs."""
        if previous is not None:
            self._retire_length_stops(previous)
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return None
        sample_rows = previous.sample_rows() if previous is not None else None
        plan = build_step_plan(scheduled, self.config.block_size, sample_rows)
        pending = self._pending_tokens(scheduled)
        previous_tokens = previous.samples.on_device if previous is not None else None
        logits = self.runner.execute(plan, previous_tokens)
        return self._launched_forward(scheduled, plan, pending, logits)

    def _pending_tokens(self, scheduled: SchedulerOutput) -> list[PendingToken]:
        """The sequences that sample, in batch order (the plan's sample_seq_ids), and where their tokens will go."""
        requests = self._requests
        return [
            PendingToken(requests[item.seq.seq_id], len(item.seq.token_ids))
            for item in scheduled.scheduled
            if item.will_sample
        ]

    def _launched_forward(
        self, scheduled: SchedulerOutput, plan: StepPlan, pending: list[PendingToken], logits: torch.Tensor | None
    ) -> LaunchedForward:
        """The step counts as launched (its sequences advance); its prompt logprobs and n > 1 forks are queued."""
        self.scheduler.on_step_launched(scheduled)
        seq_ids = plan.sample_seq_ids
        prompt_logprobs = None
        if plan.prompt_logit_rows and logits is not None:  # the rows after the sampled ones (see ModelRunner)
            num_sampled = len(plan.sample_indices)
            prompt_logprobs = self._prompt_logprobs(logits[num_sampled:], plan)
            logits = logits[:num_sampled] if num_sampled else None
        if self._forks and logits is not None:  # n > 1 requests wait for their first token
            logits, pending, seq_ids = self._fork_samples(logits, pending, seq_ids)
        return LaunchedForward(scheduled, pending, seq_ids, logits, prompt_logprobs, plan.prompt_logit_positions)

    def _sample(self, forward: LaunchedForward) -> InFlightStep:
        """Queue the sampling of a launched forward's logits."""
        tokens = logprobs = logprob_rows = None
        if forward.logits is not None:
            batch = self._sample_batch(forward.pending, forward.seq_ids)
            tokens, logprobs = self.sampler.sample_with_logprobs(forward.logits, batch)
            logprob_rows = batch.logprob_rows
            if self._num_structured:
                self._end_slow_grammars()
        samples = SampledTokens(tokens, self.runner.device, logprobs, forward.prompt_logprobs)
        return InFlightStep(forward.scheduled, forward.pending, samples, forward.prompt_positions, logprob_rows)

    def _prompt_logprobs(self, logits: torch.Tensor, plan: StepPlan) -> DeviceLogprobs:
        """logits [P, V] of the plan's prompt positions -> their logprobs (raw: a prompt is not sampled)."""
        with torch.inference_mode():
            targets = to_device(int64_tensor(plan.prompt_logit_targets), logits.device)
            ks = [self._requests[seq_id].seq.params.prompt_logprobs or 0 for seq_id, _ in plan.prompt_logit_positions]
            return DeviceLogprobs(logits.float().log_softmax(dim=-1), targets, ks)

    def _sample_batch(self, pending: list[PendingToken], seq_ids: list[int]) -> SampleBatch:
        params = [_row_params(p.request.seq) for p in pending]  # the rows of `seq_ids`, in the same order
        logprob_rows = None
        if self._num_logprobs:  # some live request asks: which rows of this step
            logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None] or None
        matchers = [p.request.matcher for p in pending] if self._num_structured else None
        if not self._num_controlled:  # the usual case: plain requests only, no per-row columns to build
            return SampleBatch(params, seq_ids, logprob_rows=logprob_rows, matchers=matchers)
        num_tokens = [p.token_index for p in pending]
        prompts = [p.request.seq.prompt_token_ids for p in pending]
        return SampleBatch(params, seq_ids, num_tokens, prompts, logprob_rows, matchers)

    def _fork_samples(
        self, logits: torch.Tensor, pending: list[PendingToken], seq_ids: list[int]
    ) -> tuple[torch.Tensor, list[PendingToken], list[int]]:
        """Fork the followers of the leaders sampling their first token in this step (after its forward is queued,
        so the partly filled blocks they copy hold the prompt's last K/V); each gets a row of its own: a copy of its
        leader's logits row (logits [S, V] -> [S + F, V])."""
        forked = self._forks.join(pending)
        if forked is None or not forked.pending:  # none, or each follower waits for blocks to prefill on its own
            return logits, pending, seq_ids
        self.runner.copy_blocks(forked.copies)
        rows = to_device(int64_tensor(forked.rows), logits.device)  # [F]
        logits = torch.cat((logits, logits.index_select(0, rows)))
        return logits, pending + forked.pending, seq_ids + [p.request.seq.seq_id for p in forked.pending]

    # ----- lockstep steps (expert parallelism) -----
    def group_step(self) -> list[RequestOutput]:
        """One step of a lockstep group (async scheduling is off with expert parallelism): this rank's own batch,
        or, with nothing of its own to run, an empty step that only serves its peers' tokens for the experts it
        holds. When the group breaks during the forward (GroupBrokenError), nothing of the step was sampled or
        committed: the sequences are where they were, so the next call, once the next epoch is installed, schedules
        the same tokens again and rewrites their KV cache slots with the same values (a preemption the failed
        schedule made stands, as any preemption does)."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            self.runner.execute_empty()
            return []
        plan = build_step_plan(scheduled, self.config.block_size, None)
        pending = self._pending_tokens(scheduled)
        logits = self.runner.execute(plan, None)
        launched = self._sample(self._launched_forward(scheduled, plan, pending, logits))
        self.scheduler.commit(launched.scheduled)
        return self._with_ended_early(self._read(launched))

    def _retire_length_stops(self, previous: InFlightStep) -> None:
        """Sequences that end by length once `previous` is read (whatever token it sampled) are known now: they
        leave the batch before the next step is scheduled, as they would have if `previous` had been read."""
        ending = [
            request.seq
            for request, index in previous.pending
            if index + 1 >= request.length_limit and not request.seq.is_finished
        ]
        if ending:
            self.scheduler.retire(ending)

    def _read(self, step: InFlightStep, next_forward: LaunchedForward | None = None) -> list[RequestOutput]:
        """Wait for a launched step's tokens, put them in their sequences, and detokenize and stop-check them.
        `next_forward`: the step launched after it, whose sampling waits for this read (structured outputs): the
        grammar matchers are advanced first, and the masks of that sampling filled on a thread meanwhile."""
        tokens = step.samples.wait()
        grammar_ends = self._advance_matchers(step, tokens) if self._num_structured else {}
        if next_forward is not None and next_forward.logits is not None and self._num_structured:
            self.sampler.prepare_masks([p.request.matcher for p in next_forward.pending], self.vocab_size)
        if step.prompt_positions:
            self._store_prompt_logprobs(step)
        row_logprobs: dict[int, TokenLogprob] = {}  # row -> its logprobs, for the rows that asked
        if step.logprob_rows:
            row_logprobs = dict(zip(step.logprob_rows, step.samples.logprobs(), strict=True))
        live: list[PendingToken] = []
        live_rows: list[int] = []
        live_tokens: list[int] = []
        live_logprobs: list[TokenLogprob | None] = []
        detokenizers: list[IncrementalDetokenizer] = []
        outputs = []
        for row, (p, token) in enumerate(zip(step.pending, tokens, strict=True)):
            request = p.request
            seq = request.seq
            if seq.status is SequenceStatus.FINISHED:  # aborted, or ended by the step before (a wasted row)
                continue
            if grammar_ends.get(row) == "abort":
                outputs.append(self._end_at_dead_end(p))
                continue
            seq.token_ids[p.token_index] = token
            live.append(p)
            live_rows.append(row)
            live_tokens.append(token)
            live_logprobs.append(row_logprobs.get(row))
            detokenizers.append(request.detokenizer)
        if not live:
            return outputs
        texts = push_each(self._window_decoder, detokenizers, live_tokens)
        self._num_generated_tokens += len(live)
        for (request, index), row, token, text, logprob in zip(
            live, live_rows, live_tokens, texts, live_logprobs, strict=True
        ):
            seq = request.seq
            num_tokens = index + 1  # the sequence as of this step (the next step's token may follow)
            # min_tokens: a stop string that ends before enough tokens were generated does not count.
            may_stop = num_tokens - len(seq.prompt_token_ids) >= seq.params.min_tokens
            new_text = request.text.add_text(text, may_stop) if text else ""
            if request.text.stopped:
                reason: FinishReason | None = "stop"
            else:
                reason = token_stop_reason(seq, self.eos_token_ids, self.max_model_len, num_tokens)
            if reason is None:
                reason = grammar_ends.get(row)  # "stop" if any: dead ends ended above
            if reason is None:
                output = RequestOutput(seq.request_id, [token], new_text, None, len(seq.prompt_token_ids),
                                       num_tokens - len(seq.prompt_token_ids), seq.sample_index)  # fmt: skip
            else:
                # A step already launched may sample past the end (a wasted row, never read): forget that token.
                # The blocks freed here may be reused while that step still writes them: safe, the device runs
                # steps in launch order.
                del seq.token_ids[num_tokens:]
                output = self._finish(request, reason, [token], new_text + request.text.flush())
            if logprob is not None:
                output = output._replace(logprobs=[logprob])
            if request.prompt_logprobs_due:  # a one-token prompt has no positions to file: just its None
                request.prompt_logprobs_due = False
                output = output._replace(prompt_logprobs=request.prompt_logprobs or [None])
            outputs.append(output)
        return outputs

    def _advance_matchers(self, step: InFlightStep, tokens: list[int]) -> dict[int, FinishReason]:
        """Advance each live structured row's grammar matcher by its new token; -> the rows whose grammar ends
        there and how (see `_grammar_end`): "stop" when complete with it, whether or not the token was one of the
        engine's EOS ids; "abort" at a dead end."""
        ended = {}
        for row, (p, token) in enumerate(zip(step.pending, tokens, strict=True)):
            matcher = p.request.matcher
            if matcher is None or p.request.seq.status is SequenceStatus.FINISHED:
                continue
            reason = _grammar_end(matcher, token)
            if reason is not None:
                ended[row] = reason
        return ended

    def _end_at_dead_end(self, p: PendingToken) -> RequestOutput:
        """End a sample whose grammar allowed no token at all (see `_grammar_end`): the token sampled from an
        all -inf row is dropped, the text held back so far is handed out."""
        request, seq = p.request, p.request.seq
        del seq.token_ids[p.token_index :]
        log.warning(
            "request %s sample %d: its grammar allows no token after %d output tokens (a rule that never ends?); "
            "the sample is aborted",
            seq.request_id,
            seq.sample_index,
            seq.num_output_tokens,
        )
        output = self._finish(request, "abort", [], request.text.flush())
        if request.prompt_logprobs_due:
            request.prompt_logprobs_due = False
            output = output._replace(prompt_logprobs=request.prompt_logprobs or [None])
        return output

    def _end_slow_grammars(self) -> None:
        """End the requests whose grammar's mask took longer than the limit in the sampling just queued (all their
        samples: they share the grammar). Their rows in it are dropped when read, as an abort's are; the final
        outputs carry the cause, which the async engine delivers to the client as an error."""
        slow = self.sampler.take_slow_masks()
        if not slow:
            return
        by_matcher = {id(r.matcher): r for r in self._requests.values() if r.matcher is not None}
        limit_ms = self.config.grammar_mask_limit_ms
        for matcher, seconds in slow:
            request = by_matcher.get(id(matcher))
            if request is None or request.seq.request_id not in self._samples:  # ended already
                continue
            seq = request.seq
            seq.drop_unknown_tokens()  # the token being sampled now is not handed out (nor counted below)
            spec = seq.params.structured
            kind = spec.kind.replace("_", " ") if spec is not None else "grammar"
            message = (
                f"the request was ended: its {kind}'s token mask took {seconds * 1000:.0f} ms (limit {limit_ms:g} "
                f"ms) after {seq.num_output_tokens} output tokens, and every step of the batch waits for it; "
                "simplify the grammar: a repetition whose copies can split the same text in many ways (e.g. "
                '(w " "?){1,16} with w ::= [a-z]+, or ([a-z] | [a-z] [a-z]){1,100}) makes every mask slow'
            )
            log.warning("request %s: %s", seq.request_id, message)
            self._num_grammar_mask_timeouts += 1
            for sample in list(self._samples[seq.request_id]):
                self._forks.drop(sample.seq.seq_id)
                sample.seq.drop_unknown_tokens()
                final = self._finish(sample, "abort", new_token_ids=[], new_text="")
                self._ended_early.append(final._replace(error=message))

    def _store_prompt_logprobs(self, step: InFlightStep) -> None:
        """File the step's prompt-position logprobs with their requests (a chunk at a time; kept until sent)."""
        requests = self._requests
        for (seq_id, position), entry in zip(step.prompt_positions, step.samples.prompt_logprobs(), strict=True):
            request = requests.get(seq_id)
            if request is None or not request.prompt_logprobs_due:  # gone, or a recompute of what was sent
                continue
            if request.prompt_logprobs is None:
                request.prompt_logprobs = [None] * len(request.seq.prompt_token_ids)
            request.prompt_logprobs[position] = entry

    def _finish(
        self, request: EngineRequest, reason: FinishReason, new_token_ids: list[int], new_text: str
    ) -> RequestOutput:
        seq = request.seq
        self.scheduler.finish(seq, reason)
        self.sampler.forget(seq.seq_id)
        self._num_controlled -= seq.params.has_controls
        self._num_logprobs -= seq.params.logprobs is not None
        if request.matcher is not None:
            request.matcher = None
            self._num_structured -= 1
        del self._requests[seq.seq_id]
        samples = self._samples[seq.request_id]
        if len(samples) == 1:
            del self._samples[seq.request_id]
        else:
            samples[:] = [s for s in samples if s is not request]
        return self._output(seq, new_token_ids, new_text, reason)

    @staticmethod
    def _output(seq: Sequence, token_ids: list[int], text: str, reason: FinishReason | None) -> RequestOutput:
        return RequestOutput(
            seq.request_id, token_ids, text, reason, seq.num_prompt_tokens, seq.num_output_tokens, seq.sample_index
        )

    # ----- batch use and stats -----
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], n: int = 1
    ) -> list[GenerationResult]:
        """Run `prompts` to completion together (continuous batching), `n` samples each; results prompt-major (prompt
        i's sample j at i * n + j)."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._seq_ids)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, all_params, strict=True):
            self.add_request(request_id, prompt, p, n)
        keys = [(i, j) for i in ids for j in range(n)]
        tokens: dict[tuple[str, int], list[int]] = {k: [] for k in keys}
        texts: dict[tuple[str, int], list[str]] = {k: [] for k in keys}
        reasons: dict[tuple[str, int], FinishReason] = {}
        while len(reasons) < len(keys):
            for out in self.step():
                key = (out.request_id, out.sample_index)
                tokens[key].extend(out.new_token_ids)
                texts[key].append(out.new_text)
                if out.finish_reason is not None:
                    reasons[key] = out.finish_reason
        self.drain()  # what is left in flight are rows of requests that already ended: leave the device idle
        prompt_of = dict(zip(ids, prompts, strict=True))
        return [
            GenerationResult(
                request_id=i,
                sample_index=j,
                prompt_token_ids=list(prompt_of[i]),
                output_token_ids=tokens[i, j],
                text="".join(texts[i, j]),
                finish_reason=reasons[i, j],
            )
            for i, j in keys
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
            num_grammar_mask_timeouts=self._num_grammar_mask_timeouts,
            expert_exchanges=self.runner.expert_exchanges(),
        )


class LaunchedForward(NamedTuple):
    """A step whose forward is queued and whose sampling is not (yet)."""

    scheduled: SchedulerOutput
    pending: list[PendingToken]  # [S] one per sampled row (forked followers appended)
    seq_ids: list[int]  # [S]
    logits: torch.Tensor | None  # [S, V] the sampled rows' logits
    prompt_logprobs: DeviceLogprobs | None
    prompt_positions: list[tuple[int, int]]


def _row_params(seq: Sequence) -> SamplingParams:
    """A row's sampling parameters. A sequence that ended after its step's forward was queued (its sampling waited
    for the read that ended it: structured outputs) is sampled without the controls that keep per-sequence state on
    the device (token histories, bias, a seeded generator): `_finish` already forgot that state, and the row is
    dropped when read. Its logprobs stay, so the rows asking for them are the ones the read expects."""
    params = seq.params
    if seq.status is not SequenceStatus.FINISHED or not (params.has_controls or params.seed is not None):
        return params
    return params.model_copy(update=_NO_STATEFUL_CONTROLS)


_NO_STATEFUL_CONTROLS: dict[str, Any] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": {},
    "min_tokens": 0,
    "seed": None,
}


def _grammar_end(matcher: Any, token: int) -> FinishReason | None:
    """Advance a structured sample's matcher by its new token; -> None while its grammar goes on, "stop" once it is
    complete, "abort" at a dead end.

    The mask allows exactly the tokens the matcher accepts, so a refused token was sampled from a row the mask left
    all -inf: the grammar allows no token here. A grammar that can never begin is refused before queuing
    (grammars.py, `can_start`); one that dead-ends later (`root ::= "a" x`, `x ::= x`) is not, as finding it takes the
    whole grammar's analysis. Such a sample ends here with "abort", which the API passes through, and without the
    arbitrary token: not "stop", which would say that the output matches, and not going on unconstrained."""
    if not matcher.accept_token(token):
        return "abort"
    return "stop" if matcher.is_terminated() else None
