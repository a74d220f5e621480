"""The lifecycle manager's configuration: the weights loaded at start, requests while asleep, the group rank."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

AsleepRequests = Literal["reject", "wake"]


class LifecycleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weights_version: str = Field(
        default="base", min_length=1, max_length=128, description="Version name of the weights loaded at start."
    )
    weights_path: Path | None = Field(
        default=None, description="Load these weights at start instead of the model directory's own."
    )
    asleep_requests: AsleepRequests = Field(
        default="reject", description="Requests while asleep: 'reject' (503 + Retry-After) or 'wake' the model."
    )
    asleep_retry_after_s: int = Field(default=30, ge=1, description="Retry-After of requests refused while asleep.")
    upload_dir: Path | None = Field(default=None, description="Where streamed weight uploads are spooled.")
    stable_device_memory: bool = Field(
        default=True,
        description="CUDA: hold weights and KV cache in virtual-memory regions whose addresses survive a sleep "
        "(off: plain torch allocations, whose addresses can move).",
    )
    rank: int = Field(default=0, ge=0, description="This worker's rank in its group.")
    world_size: int = Field(default=1, ge=1, description="Ranks in this worker's group.")
