"""Rotary position embedding with its cos/sin cache built once (tidal.kernels.rotary)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tidal.kernels.rotary import apply_rotary, build_cos_sin_cache
from tidal.kernels.rotary_store_kv import HeadNorm, rotary_store_kv


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim]

    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None,
        is_neox: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.is_neox = is_neox
        self._cache_args = (rotary_dim, max_position, base, rope_scaling, dtype)
        # A buffer, not a checkpoint tensor: derived from the config, never loaded. On the meta device (a model
        # whose weights are placed afterwards) only its shape, until `build_buffers`.
        if device.type == "meta":
            cache = torch.empty((max_position, rotary_dim), dtype=dtype, device=device)
        else:
            cache = build_cos_sin_cache(*self._cache_args, device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [max_position, rotary_dim]

    @property
    def rotary_dim(self) -> int:
        """How many dims of each head rotate (all of them unless the config rotates part of a head)."""
        return self.cos_sin_cache.shape[1]

    def build_buffers(self, device: torch.device) -> None:
        """Compute the cos/sin cache on `device` (for a module built on the meta device)."""
        self.cos_sin_cache = build_cos_sin_cache(*self._cache_args, device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim], rotated in place."""
        return apply_rotary(q, k, positions, self.cos_sin_cache, self.is_neox)

    def rotate_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        q_norm: HeadNorm | None = None,
        k_norm: HeadNorm | None = None,
    ) -> torch.Tensor:
        """q rotated in place and returned; k rotated into the cache at `slot_mapping`, v copied there (one kernel
        where a forward would otherwise launch two per layer). `q_norm`/`k_norm` (both or neither): each head of q and
        k RMS-normalised before the rotation, in the same kernel (Qwen3's q/k norm, two launches per layer fewer)."""
        k_cache, v_cache = kv_cache
        return rotary_store_kv(
            q, k, v, positions, self.cos_sin_cache, self.is_neox, k_cache, v_cache, slot_mapping, q_norm, k_norm
        )
