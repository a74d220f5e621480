"""Log-probabilities of chosen tokens and their top alternatives: computed on the device for the rows that ask, read
back with the step's sampled tokens (no wait in the step), and turned into plain host records.

A row's logprobs are a log_softmax over its whole vocabulary; per row the chosen token's logprob, its rank (1 = the
most likely; ties count in its favour) and the row's k most likely tokens travel as two small tensors, [R, 2 + K]
float32 and [R, K] int64, K the largest k of the rows. A token cut away by top-k / top-p / min-p has a logprob of
-inf in the processed distribution; JSON has no infinity, so the host record says `FLOOR_LOGPROB` instead.
"""

from __future__ import annotations

import math

import torch

from tidal.worker.engine.outputs import TokenLogprob

FLOOR_LOGPROB = -9999.0  # stands for -inf (a token the processed distribution can never draw)


class DeviceLogprobs:
    """The rows' values on the device, copied to pinned host memory behind the step on a GPU."""

    def __init__(self, logprobs: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> None:
        """`logprobs` [R, V] fp32 (log_softmax'ed rows), `chosen` [R] int64 token ids, `ks` the rows' k."""
        self.ks = ks
        self.chosen = chosen
        num_top = max(ks, default=0)
        picked = logprobs.gather(1, chosen[:, None])  # [R, 1]
        rank = (logprobs > picked).sum(dim=1, keepdim=True).to(torch.float32) + 1  # [R, 1]
        top = logprobs.topk(num_top, dim=1) if num_top else None
        values = [picked, rank] + ([top.values] if top is not None else [])
        self.values = torch.cat(values, dim=1)  # [R, 2 + K]
        self.top_ids = top.indices if top is not None else torch.empty((len(ks), 0), dtype=torch.long)  # [R, K]
        self._host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def copy_to_host(self) -> None:
        """Queue the copies into pinned memory (GPU); the caller's event marks them done."""
        host = []
        for tensor in (self.values, self.top_ids, self.chosen):
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            pinned.copy_(tensor, non_blocking=True)
            host.append(pinned)
        self._host = (host[0], host[1], host[2])

    def read(self) -> list[TokenLogprob]:
        """-> a record per row (after the step is done on the device)."""
        values, top_ids, chosen = self._host if self._host is not None else (self.values, self.top_ids, self.chosen)
        rows = []
        for k, row, ids, token in zip(self.ks, values.tolist(), top_ids.tolist(), chosen.tolist(), strict=True):
            top = [(t, _finite(v)) for t, v in zip(ids[:k], row[2 : 2 + k], strict=True)]
            rows.append(TokenLogprob(token, _finite(row[0]), int(row[1]), top))
        return rows


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR_LOGPROB
