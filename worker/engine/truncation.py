"""Cutting a random row's distribution down before it is sampled: top-k, top-p (nucleus) and min-p.

Every row keeps at least its most likely token. Min-p needs no sort: a token's probability is below min_p times the
top one's exactly when its logit is below the top logit plus log(min_p), so it is one comparison per logit.
"""

from __future__ import annotations

import torch


def truncate(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, sort: bool
) -> torch.Tensor:
    """logits [R, V] (temperature applied); top_k [R] int64 (V = off), top_p [R] (1 = off), min_p [R] (0 = off);
    `sort`: whether any row uses top-k or top-p (else only min-p runs). -> logits with dropped tokens at -inf."""
    floor = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # [R, 1]; log(0) = -inf keeps every token
    logits = logits.masked_fill(logits < floor, float("-inf"))
    if not sort:
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [R, V] mass of strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p[:, None]) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
