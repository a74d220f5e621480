"""The engine for an asyncio server: LLMEngine's step loop on a background thread, outputs as async streams.

Only the loop thread touches the LLMEngine. Other threads hand it new requests and aborts through an inbox
under a lock, and the loop hands outputs back to each request's asyncio queue on the event loop.

A request id names a stream only while that stream is open: once closed (or aborted), the same id may be submitted
again at once. So the loop routes every output to the stream of the request that produced it (the pairing made when
the engine took the request), never by looking the id up when it delivers, and it applies a turn's aborts before
its admissions (see `_take_inbox`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Self

from transformers import PreTrainedTokenizerBase

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.errors import DuplicateRequestError
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.outputs import EngineStats, RequestOutput
from tidal.worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tidal.worker.models.base import CausalLM

log = logging.getLogger(__name__)

_Item = RequestOutput | BaseException
_Stream = asyncio.Queue[_Item]
# (request id, the stream it is for, the item): delivered only while that stream still holds the id.
_Delivery = tuple[str, _Stream, _Item]


class EngineNotRunningError(RuntimeError):
    """The engine takes no requests now. `retry_after_s`, when set, says when trying again may succeed."""

    def __init__(
        self, message: str = "the engine is not running", code: str = "not_ready", retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class RequestInterruptedError(RuntimeError):
    """A running request was ended on purpose (the worker goes to sleep or changes its weights); says why."""


class RequestEndedError(RequestInterruptedError):
    """The engine ended a running request for a cause of its own (its grammar's token masks took longer than the
    limit: RequestOutput.error); says why. A RequestInterruptedError, so the server sends the message as an error
    body, or as an SSE error event once the stream has started."""


# Awaited before a request is queued: returns to admit it, or raises (e.g. EngineNotRunningError while asleep).
AdmissionGate = Callable[[], Awaitable[None]]


class _NewRequest(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int
    stream: _Stream  # where its outputs go
    grammar: Any = None  # its structured output, compiled before it is queued (engine/grammars.py)


@dataclass
class _Admitted:
    """A request the LLMEngine has taken: its stream, and how many of its samples have not finished."""

    stream: _Stream
    num_running: int


@dataclass
class _Inbox:
    new: list[_NewRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


def _never_admitted(request: _NewRequest) -> list[RequestOutput]:
    """The final outputs (one per sample) of a request aborted before the engine took it."""
    num_prompt_tokens = len(request.prompt_token_ids)
    return [
        RequestOutput(request.request_id, [], "", "abort", num_prompt_tokens, 0, sample_index)
        for sample_index in range(request.n)
    ]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox = _Inbox()
        self._streams: dict[str, _Stream] = {}  # request id -> the open stream that holds it
        self._admitted: dict[str, _Admitted] = {}  # request id -> its request in the LLMEngine (under _step_lock)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = engine.stats()
        # Holding (sleep, weight updates): new requests wait in the inbox; see hold().
        self._holding = False
        self._interrupt: str | None = None  # reason to end every running request at the next turn of the loop
        self._is_idle = False  # the loop waits with nothing to do
        self._idle = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # held by the loop while it touches the LLMEngine
        self._admission: AdmissionGate | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> Self:
        """Load the model and tokenizer and allocate the KV cache (slow: call it off the event loop)."""
        return cls(LLMEngine.from_config(config))

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._engine.tokenizer

    @property
    def model_name(self) -> str:
        return self._engine.model_name

    @property
    def model_class(self) -> type[CausalLM]:
        """The implementation serving the model, which names its architecture (models/registry.py)."""
        return type(self._engine.runner.model)

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine was already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tidal-engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop; requests still running end with finish_reason "abort", those still waiting for admission
        with EngineNotRunningError."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._engine.close()  # the loop has stopped: the engine's compile and mask fill threads go too

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, n: int = 1
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's deltas (with n > 1, those of its n samples interleaved, told apart by
        `sample_index`; the stream ends once each has finished). A prompt the engine refuses raises a ValueError at
        the first `anext`, before anything is queued. Closing the stream early (client gone) aborts the request and
        frees all its samples."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return self._stream(_NewRequest(request_id, list(prompt_token_ids), params, n, asyncio.Queue()))

    async def _stream(self, request: _NewRequest) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        self._engine.validate_prompt(request.prompt_token_ids)
        structured = request.params.structured
        if structured is not None:
            # Compiled on the grammar pool, never on the step loop; a bad grammar, or one not compiled in time,
            # raises InvalidGrammarError here.
            grammar = await self._engine.grammars.wait(structured)
            request = request._replace(grammar=grammar)
        if self._admission is not None:
            await self._admission()
        queue = request.stream
        with self._wake:
            if not self.is_running or self._stopping:
                raise EngineNotRunningError("the engine is not running")
            if request_id in self._streams:
                raise DuplicateRequestError(request_id)
            self._streams[request_id] = queue
            self._inbox.new.append(request)
            self._wake.notify()
        num_running = request.n  # samples not finished yet
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    num_running -= 1
                    finished = num_running == 0
                yield item
        finally:
            with self._lock:
                if self._streams.get(request_id) is queue:
                    del self._streams[request_id]
            if not finished:
                self.abort(request_id)

    def has_ready_output(self, request_id: str) -> bool:
        """Whether the request's stream holds an output (or its error) that its next `anext` returns without
        waiting. On the event loop only: the loop thread alone fills the queues, so the answer holds until it awaits."""
        queue = self._streams.get(request_id)
        return queue is not None and not queue.empty()

    def abort(self, request_id: str) -> None:
        """Stop a request and free its cache blocks (no-op for an unknown or finished request). Thread-safe."""
        with self._wake:
            # One still waiting for admission (held) ends here: the loop must never admit it later.
            queued = [item for item in self._inbox.new if item.request_id == request_id]
            if not queued:
                self._inbox.aborts.append(request_id)
                self._wake.notify()
                return
            self._inbox.new = [item for item in self._inbox.new if item.request_id != request_id]
        self._deliver_all([(request_id, queued[0].stream, output) for output in _never_admitted(queued[0])])

    def serving_problem(self) -> str | None:
        """Why requests would wait here now although the loop runs (None: they would not); see LockstepAsyncEngine."""
        return None

    def stats(self) -> EngineStats:
        with self._lock:
            num_queued = len(self._inbox.new)
        return self._stats.model_copy(update={"num_waiting": self._stats.num_waiting + num_queued})

    # ----- pausing between steps (sleep, weight updates) -----
    def set_admission_gate(self, gate: AdmissionGate | None) -> None:
        """Every new request awaits `gate` before it is queued (after its prompt was validated)."""
        self._admission = gate

    def hold(self, timeout_s: float, interrupt_reason: str | None = None) -> bool:
        """Stop admitting new requests (they stay queued) and wait until none runs: running ones finish, or with
        `interrupt_reason` end at once with a RequestInterruptedError carrying it. -> True once the loop is idle;
        False if requests still ran after `timeout_s` (admission then resumes). Blocks: call it off the event loop."""
        with self._wake:
            if not self.is_running or self._stopping:
                raise EngineNotRunningError()
            self._holding = True
            if interrupt_reason is not None:
                self._interrupt = interrupt_reason
            self._is_idle = False  # the loop re-checks under `holding` before it counts as idle
            self._wake.notify()
            if self._idle.wait_for(lambda: self._is_idle or self._stopping, timeout_s) and not self._stopping:
                return True
            self._holding = False
            self._wake.notify()
            return False

    def release(self) -> None:
        """Admit requests again (the queued ones first)."""
        with self._wake:
            self._holding = False
            self._wake.notify()

    def fail_queued(self, error: BaseException) -> int:
        """End every request still waiting for admission with `error` (e.g. the worker fell asleep while they
        waited). -> how many."""
        with self._lock:
            queued, self._inbox.new = self._inbox.new, []
        self._deliver_all([(request.request_id, request.stream, error) for request in queued])
        return len(queued)

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[LLMEngine]:
        """Exclusive use of the LLMEngine while held (see hold()): the loop touches it only between such uses.
        No step is in flight and the device is idle inside."""
        if not self._holding:
            raise RuntimeError("quiesced() needs the engine held first")
        with self._step_lock:
            self._drain()  # hold() waits for an idle loop, which has read its last step: normally a no-op
            yield self._engine

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[LLMEngine]:
        """The LLMEngine between two steps, without holding requests: for a short change that running requests
        need not wait out (the KV cache's rest joining the block pool after a wake). The step in flight, if any,
        is read first (its outputs delivered), so none is in flight inside."""
        with self._step_lock:
            self._drain()
            yield self._engine

    def _drain(self) -> None:
        """Read the LLMEngine's step in flight and deliver its outputs (with the step lock held, so they go out in
        order with the loop's)."""
        outputs = self._engine.drain()
        if outputs:
            self._stats = self._engine.stats()
            self._deliver_all(self._route(outputs))

    # ----- the loop thread -----
    def _has_work(self) -> bool:
        if self._stopping or self._inbox.aborts or self._interrupt is not None:
            return True
        return bool(self._inbox.new and not self._holding) or self._engine.has_unfinished_requests()

    def _run(self) -> None:
        try:
            self._loop_until_stopped()
        except Exception as err:  # a bug outside a step's own recovery: nobody may be left waiting on a dead loop
            log.exception("the engine loop failed; ending every request")
            self._fail_everything(EngineNotRunningError(f"the engine loop failed: {err}"))

    def _fail_everything(self, error: EngineNotRunningError) -> None:
        with self._wake:
            self._stopping = True  # refuses new requests and holds
            self._inbox = _Inbox()
            streams = list(self._streams.items())
            self._idle.notify_all()
        self._deliver_all([(request_id, stream, error) for request_id, stream in streams])

    def _loop_until_stopped(self) -> None:
        while True:
            with self._wake:
                while not self._has_work():
                    self._is_idle = True
                    self._idle.notify_all()
                    self._wake.wait()
                self._is_idle = False
                if self._holding and not self._stopping:  # queued requests stay queued; aborts still apply
                    inbox, self._inbox.aborts = _Inbox(aborts=self._inbox.aborts), []
                else:
                    inbox, self._inbox = self._inbox, _Inbox()
                stopping = self._stopping
                interrupt, self._interrupt = self._interrupt, None
            with self._step_lock:
                if not self._turn(inbox, stopping, interrupt):
                    return

    def _turn(self, inbox: _Inbox, stopping: bool, interrupt: str | None) -> bool:
        """One turn of the loop: admit, abort, step, deliver. -> False when the loop must end. With async
        scheduling a step is left in flight between turns; abort_all ends it (and waits for the device)."""
        engine = self._engine
        # Stats are refreshed before outputs go out, so a client that sees its output sees the stats after it.
        deliveries: list[_Delivery] = []
        if stopping:
            deliveries += self._route(engine.abort_all())
            # Never admitted (e.g. held by a sleep): they would otherwise wait for an output that never comes.
            refused = EngineNotRunningError("the engine shut down before this request started")
            deliveries += [(request.request_id, request.stream, refused) for request in inbox.new]
            self._stats = engine.stats()
            self._deliver_all(deliveries)
            return False
        deliveries += self._take_inbox(inbox, interrupt)
        try:
            deliveries += self._route(engine.step())
        except Exception as err:  # a failed step must not leave clients waiting forever
            log.exception("engine step failed; failing the requests in flight")
            deliveries += self._route(engine.abort_all(), err)
        self._stats = engine.stats()
        self._deliver_all(deliveries)
        return True

    def _take_inbox(self, inbox: _Inbox, interrupt: str | None) -> list[_Delivery]:
        """Interrupt, abort and admit (with the step lock held); -> what to deliver.

        Aborts go before admissions, which is their order of arrival for any one id: abort() takes a request of
        that id still in the inbox back itself, so an abort here was asked before every request of its id here.
        An id aborted and then submitted again thus ends its old request before the new one is taken, instead of
        the new one being refused as a duplicate (or ended by an abort meant for the old one)."""
        engine = self._engine
        deliveries: list[_Delivery] = []
        if interrupt is not None:
            deliveries += self._route(engine.abort_all(), RequestInterruptedError(interrupt))
        for request_id in inbox.aborts:
            deliveries += self._route(engine.abort_request(request_id))
        for request in inbox.new:
            request_id = request.request_id
            try:
                engine.add_request(request_id, request.prompt_token_ids, request.params, request.n, request.grammar)
            except Exception as err:  # refused (ValueError) or broken: either way this request alone ends
                deliveries.append((request_id, request.stream, err))
                continue
            self._admitted[request_id] = _Admitted(request.stream, request.n)
        return deliveries

    def _route(self, outputs: list[RequestOutput], error: BaseException | None = None) -> list[_Delivery]:
        """The LLMEngine's outputs (with the step lock held), each to the stream of the request it came from (or
        `error` in its place); a request is forgotten once each of its samples has finished."""
        deliveries: list[_Delivery] = []
        for out in outputs:
            admitted = self._admitted.get(out.request_id)
            if admitted is None:  # the LLMEngine's own use (`generate`), never through a stream: nobody to tell
                log.warning("an output of request %r, which no stream submitted, was dropped", out.request_id)
                continue
            if out.finish_reason is not None:
                admitted.num_running -= 1
                if admitted.num_running == 0:
                    del self._admitted[out.request_id]
            item: _Item = out
            if error is not None:
                item = error
            elif out.error is not None:
                item = RequestEndedError(out.error)
            deliveries.append((out.request_id, admitted.stream, item))
        return deliveries

    def _deliver_all(self, deliveries: list[_Delivery]) -> None:
        """A step's outputs go to the event loop in one call: one wake-up of the loop (a write to its self-pipe) per
        step instead of one per running request, which at 64 streams cost the step thread 64 system calls under
        the GIL and the loop as many wake-ups."""
        if not deliveries or self._loop is None:
            return
        with self._lock:
            # A stream that no longer holds its id was closed: the client already left.
            batch = [
                (stream, item) for request_id, stream, item in deliveries if self._streams.get(request_id) is stream
            ]
        if batch:
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
                self._loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[_Stream, _Item]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
