"""A launched step's sampled token ids on their way to the host, read without waiting for later steps.

On a GPU the ids are copied into pinned host memory by an asynchronous copy queued right behind the sampling, and
an event is recorded behind the copy. Reading them waits on that event alone: `.tolist()` on the device tensor or
a device synchronize would also wait for the next step, which the engine launches before it reads this one.
The event also marks the whole step done on the device, so it is recorded when no row samples too. The logprobs of
the rows that asked (and of prompt positions that asked) travel the same way, behind the same event.
"""

from __future__ import annotations

import torch

from tidal.worker.engine.logprobs import DeviceLogprobs
from tidal.worker.engine.outputs import TokenLogprob


class SampledTokens:
    def __init__(
        self,
        tokens: torch.Tensor | None,
        device: torch.device,
        logprobs: DeviceLogprobs | None = None,
        prompt_logprobs: DeviceLogprobs | None = None,
    ) -> None:
        """`tokens`: [S] int64 on `device`, just queued (None: the step samples nothing). `logprobs`: those of the
        batch's logprob rows; `prompt_logprobs`: those of the plan's prompt positions."""
        self.on_device = tokens  # read by the next step's inputs, on the device
        self._event: torch.cuda.Event | None = None
        self._host: torch.Tensor | None = tokens
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            if tokens is not None:
                self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
                self._host.copy_(tokens, non_blocking=True)
            for extra in (logprobs, prompt_logprobs):
                if extra is not None:
                    extra.copy_to_host()
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def wait(self) -> list[int]:
        """-> the token ids, once the step is done on the device (at once on a CPU, where it already is)."""
        if self._event is not None:
            self._event.synchronize()
        return [] if self._host is None else self._host.tolist()

    def logprobs(self) -> list[TokenLogprob]:
        """The logprob rows' records, in their order (after `wait`)."""
        return [] if self._logprobs is None else self._logprobs.read()

    def prompt_logprobs(self) -> list[TokenLogprob]:
        """The prompt positions' records, in the plan's order (after `wait`)."""
        return [] if self._prompt_logprobs is None else self._prompt_logprobs.read()
