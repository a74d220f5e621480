"""Turning logits into next tokens: greedy, temperature, top-k, top-p, with per-request seeds.

Random rows use the "exponential race" (argmax of probs / Exp(1) noise, which draws from `probs`) so each
seeded request draws its noise from its own generator: its tokens don't depend on what else is in the batch.

`sample_on_device` never waits for the device: every small host list goes over as one pinned, asynchronous copy,
and rows are picked and replaced with index_select/index_copy_. The engine launches the next step before it reads
this one's tokens, so a wait here would also wait for the forward just queued.
"""

from __future__ import annotations

import torch

from tidal.worker.engine.host_tensors import float32_tensor, int64_tensor, to_device
from tidal.worker.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self._shared = torch.Generator(device=device).manual_seed(seed)  # requests without a seed
        self._per_request: dict[int, torch.Generator] = {}  # seq_id -> generator of a seeded request

    def forget(self, seq_id: int) -> None:
        self._per_request.pop(seq_id, None)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> list[int]:
        """logits [S, V] fp32 -> S token ids (waits for them)."""
        return self.sample_on_device(logits, params, seq_ids).tolist()

    def sample_on_device(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int]) -> torch.Tensor:
        """logits [S, V] fp32 -> token ids [S] int64 on logits' device, queued without waiting for the device."""
        greedy = logits.argmax(dim=-1)  # [S]
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return greedy
        device = logits.device
        rows = to_device(int64_tensor(random_rows), device)  # [R]
        sub = [params[i] for i in random_rows]
        temperature = to_device(float32_tensor([p.temperature for p in sub]), device)  # [R]
        scaled = logits.index_select(0, rows) / temperature[:, None]  # [R, V]
        if any(p.top_k != -1 or p.top_p < 1.0 for p in sub):
            scaled = _mask_top_k_top_p(scaled, sub)
        probs = scaled.softmax(dim=-1)  # [R, V]
        noise = torch.empty_like(probs)
        shared_rows = []
        for r, i in enumerate(random_rows):
            p = params[i]
            if p.seed is None:
                shared_rows.append(r)
                continue
            gen = self._per_request.get(seq_ids[i])
            if gen is None:
                gen = self._per_request[seq_ids[i]] = torch.Generator(device=self.device).manual_seed(p.seed)
            noise[r].exponential_(generator=gen)
        if shared_rows:
            shared = torch.empty((len(shared_rows), probs.shape[1]), device=device).exponential_(
                generator=self._shared
            )  # [R_shared, V]
            noise.index_copy_(0, to_device(int64_tensor(shared_rows), device), shared)
        sampled = (probs / noise).argmax(dim=-1)  # [R]
        return greedy.index_copy_(0, rows, sampled)


def _mask_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [R, V]: tokens outside each row's top-k, or outside the smallest set holding top_p of the
    probability mass, become -inf. The most likely token always stays."""
    vocab = logits.shape[1]
    device = logits.device
    top_k = to_device(int64_tensor([p.top_k if p.top_k != -1 else vocab for p in params]), device)  # [R]
    top_p = to_device(float32_tensor([p.top_p for p in params]), device)  # [R]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(vocab, device=device)[None, :]  # [1, V]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [R, V] mass of strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p[:, None]) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
