"""One request's run through the engine, timed for the metrics and always accounted for exactly once.

The serving routes never talk to `engine.generate` directly: they make a `Generation`, pull its first output (which
is where the engine refuses a prompt it cannot take, before anything is sent to the client), then either stream or
collect the rest. `close()` is synchronous and idempotent so that it can run from any `finally`, including one reached
by cancellation when a client disconnects; it aborts the engine's request if it has not finished, which returns its
KV-cache blocks, and calls `on_close` (the request's admission slot goes back there).

A generation of n samples (one engine request, one prefill) yields the outputs of all n interleaved, each carrying its
`sample_index`, and is finished once each sample is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from tidal.worker.engine.async_engine import EngineNotRunningError, RequestEndedError, RequestInterruptedError
from tidal.worker.engine.errors import InvalidGrammarError, PromptTooLongError
from tidal.worker.metrics import WorkerMetrics
from tidal.worker.server.errors import ApiError

if TYPE_CHECKING:
    from tidal.worker.engine.async_engine import AsyncEngine
    from tidal.worker.engine.outputs import RequestOutput, TokenLogprob
    from tidal.worker.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Generation:
    def __init__(
        self,
        engine: AsyncEngine,
        metrics: WorkerMetrics,
        endpoint: str,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_close: Callable[[], None] = lambda: None,
        n: int = 1,
        grammar_param: str | None = None,
    ) -> None:
        """`grammar_param`: the request field the structured output came from (sampling.structured_output_param), named
        by the 400 for a grammar that does not compile."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        # The prompt's logprobs, once the engine hands them out (with sample 0's first output), if asked for.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.num_output_tokens = 0  # all samples together
        self.finish_reasons: list[str | None] = [None] * n  # by sample index
        self._num_running = n
        self._engine = engine
        self._metrics = metrics
        self._on_close = on_close
        self._endpoint = endpoint
        self._arrival = time.perf_counter()
        self._first_token_at: float | None = None
        self._last_token_at: list[float | None] = [None] * n  # by sample: the gaps are each sample's own
        self._stream = engine.generate(request_id, prompt_token_ids, params, n)
        self._grammar_param = grammar_param
        self._first: RequestOutput | None = None
        self._outcome: str | None = None
        # True once the engine holds nothing for this request: finished, refused, or aborted by us.
        self._engine_done = False

    async def start(self) -> None:
        """Wait for the engine's first output. A prompt the engine refuses becomes a 400 here."""
        try:
            self._first = await anext(self._stream)
        except StopAsyncIteration:
            self._account("error")
            raise ApiError(500, "the engine ended the request without any output") from None
        except EngineNotRunningError as exc:  # shutting down or asleep: the caller may retry (here or elsewhere)
            self._engine_done = True
            self._account("rejected")
            retry = {"Retry-After": str(round(exc.retry_after_s))} if exc.retry_after_s is not None else None
            raise ApiError(503, str(exc), code=exc.code, headers=retry) from exc
        except RequestEndedError as exc:  # its grammar's masks are too slow: the request's own doing, not to retry
            self._engine_done = True
            self._account("interrupted")
            raise self._ended(exc) from exc
        except RequestInterruptedError as exc:  # ended before its first token (sleep or weight update, mode abort)
            self._engine_done = True
            self._account("interrupted")
            raise ApiError(503, str(exc), code="interrupted") from exc
        except InvalidGrammarError as exc:  # compiled before the request is queued
            self._engine_done = True
            self._account("rejected")
            raise ApiError(400, str(exc), param=self._grammar_param, code="invalid_grammar") from exc
        except ValueError as exc:
            # The engine validates a prompt (length, token ids) before queuing it and says why in the message.
            self._engine_done = True
            self._account("rejected")
            code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else "invalid_prompt"
            raise ApiError(400, str(exc), param="prompt", code=code) from exc
        except BaseException:
            self.close()
            raise
        self._metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self._observe(self._first)

    def _ended(self, exc: RequestEndedError) -> ApiError:
        """The engine ended the request for its structured output's cost (a 4xx: sent again, it would end again)."""
        return ApiError(400, str(exc), param=self._grammar_param, code="grammar_too_slow")

    @property
    def finish_reason(self) -> str | None:
        """The first sample's finish reason (the only one when n = 1)."""
        return self.finish_reasons[0]

    @property
    def is_finished(self) -> bool:
        return self._num_running == 0

    @property
    def has_ready_output(self) -> bool:
        """The next output is already here (the stream fell behind the engine): a writer may wait for it and send
        both in one write."""
        return self._engine.has_ready_output(self.request_id)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Every output, the first one included; each sample's last carries its finish reason."""
        if self._first is None:
            raise RuntimeError("Generation.start() must be awaited before outputs()")
        try:
            yield self._first
            while self._num_running:
                output = await anext(self._stream)
                self._observe(output)
                yield output
        except StopAsyncIteration:
            self._account("error")
            raise ApiError(500, "the engine ended the request without a finish reason") from None
        except RequestEndedError as exc:  # its grammar's masks are too slow: the request's own doing, not to retry
            self._engine_done = True
            self._account("interrupted")
            raise self._ended(exc) from exc
        except RequestInterruptedError as exc:  # ended on purpose (sleep or weight update, mode abort): say why
            self._engine_done = True
            self._account("interrupted")
            raise ApiError(503, str(exc), code="interrupted") from exc
        except Exception:
            log.exception("request %s failed in the engine", self.request_id)
            self._account("error")
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Abort the engine's request if it may still be running, and account for it. Safe to call repeatedly."""
        self._on_close()
        if not self._engine_done:
            self._engine_done = True
            self._engine.abort(self.request_id)
        self._account("cancelled")

    def _observe(self, output: RequestOutput) -> None:
        now = time.perf_counter()
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        num_new = len(output.new_token_ids)
        index = output.sample_index
        if num_new:
            last = self._last_token_at[index]
            if self._first_token_at is None:
                self._first_token_at = now
                self._metrics.time_to_first_token.observe(now - self._arrival)
            elif last is not None:
                # Several tokens in one delta share the gap evenly (e.g. a detokenizer that held text back).
                gap = (now - last) / num_new
                for _ in range(num_new):
                    self._metrics.inter_token_latency.observe(gap)
            self._last_token_at[index] = now
            self.num_output_tokens += num_new
            self._metrics.generation_tokens.inc(num_new)
        if output.finish_reason is not None:
            self.finish_reasons[index] = output.finish_reason
            self._num_running -= 1
            if self._num_running == 0:
                self._engine_done = True
                self._metrics.e2e_latency.observe(now - self._arrival)
                self._account(output.finish_reason)

    def _account(self, outcome: str) -> None:
        if self._outcome is None:
            self._outcome = outcome
            self._metrics.record_finished(self._endpoint, outcome)
