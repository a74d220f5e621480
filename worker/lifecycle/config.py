"""The lifecycle manager's configuration (built from the worker's config by the CLI)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

AsleepRequests = Literal["reject", "wake"]


class LifecycleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    weights_version: str = Field("base", min_length=1, max_length=128)
    weights_path: Path | None = Field(None, description="load these weights at start instead of the model dir's")
    asleep_requests: AsleepRequests = "reject"
    retry_after_s: int = Field(30, ge=1)
    upload_dir: Path | None = None
    stable_device_memory: bool = True
    rank: int = Field(0, ge=0)
    world_size: int = Field(1, ge=1)
