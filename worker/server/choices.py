"""The choices of one HTTP request: a generation per prompt (batched `/v1/completions`), each with n samples, seen as
one stream of (choice index, output) and collected into whole texts.

Choice `i * n + j` is prompt i's sample j, as OpenAI numbers them. All prompts are submitted together (the engine
batches their prefills); their outputs are merged in the order they arrive. The request holds one admission slot,
given back once every generation is closed. Usage counts each prompt's tokens once, however many samples it has.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tidal.worker.server.generation import Generation

if TYPE_CHECKING:
    from tidal.worker.engine.outputs import RequestOutput, TokenLogprob

ChoiceOutput = tuple[int, "RequestOutput"]  # (choice index, the output of that choice's sample)


class Choices:
    def __init__(self, generations: list[Generation], n: int, on_close: Callable[[], None] = lambda: None) -> None:
        self.generations = generations
        self.n = n
        self._on_close = on_close
        self._closed = False

    @property
    def num_choices(self) -> int:
        return len(self.generations) * self.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(g.num_prompt_tokens for g in self.generations)

    @property
    def num_output_tokens(self) -> int:
        return sum(g.num_output_tokens for g in self.generations)

    def generation_of(self, index: int) -> Generation:
        """The generation (prompt) choice `index` samples."""
        return self.generations[index // self.n]

    def finish_reason(self, index: int) -> str | None:
        return self.generations[index // self.n].finish_reasons[index % self.n]

    @property
    def is_finished(self) -> bool:
        """Every choice has its finish reason: `outputs()` ends without waiting."""
        return all(g.is_finished for g in self.generations)

    @property
    def has_ready_output(self) -> bool:
        """The next item of `outputs()` is already here. Always False for several prompts (their merged order is the
        pump tasks' to decide): the caller then just writes sooner."""
        return len(self.generations) == 1 and self.generations[0].has_ready_output

    async def start(self) -> None:
        """Submit every prompt at once and wait for each one's first output; the first refusal (a 400 or 503) is
        raised once all have started or failed, with every generation closed."""
        results = await asyncio.gather(*(g.start() for g in self.generations), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            self.close()
            raise failure

    async def outputs(self) -> AsyncIterator[ChoiceOutput]:
        """Every output of every choice, each with its choice index."""
        n = self.n
        try:
            if len(self.generations) == 1:  # the usual request: no tasks, no queue
                async for output in self.generations[0].outputs():
                    yield output.sample_index, output
                return
            merged: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

            async def pump(prompt_index: int, generation: Generation) -> None:
                try:
                    async for output in generation.outputs():
                        merged.put_nowait((prompt_index * n + output.sample_index, output))
                except Exception as exc:  # goes to the reader, which stops every other generation
                    merged.put_nowait(exc)
                merged.put_nowait(None)

            tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.generations)]
            try:
                num_running = len(tasks)
                while num_running:
                    item = await merged.get()
                    if item is None:
                        num_running -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield item
            finally:
                for task in tasks:
                    task.cancel()
        finally:
            self.close()

    def close(self) -> None:
        """Close every generation (aborting those still running) and give the slot back. Idempotent, synchronous."""
        for generation in self.generations:
            generation.close()
        if not self._closed:
            self._closed = True
            self._on_close()


@dataclass
class Collected:
    """One choice as a whole: its text, token ids and (when asked for) their logprobs."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def collect(choices: Choices, is_disconnected: Callable[[], Awaitable[bool]]) -> list[Collected]:
    """Each choice as a whole, by index; a client that has gone away stops them all early. `is_disconnected`:
    Starlette's `Request.is_disconnected` (awaited)."""
    collected = [Collected() for _ in range(choices.num_choices)]
    try:
        async for index, output in choices.outputs():
            choice = collected[index]
            choice.parts.append(output.new_text)
            choice.token_ids.extend(output.new_token_ids)
            if output.logprobs:
                choice.logprobs.extend(output.logprobs)
            if output.finish_reason is None and await is_disconnected():
                break
    finally:
        choices.close()
    return collected
