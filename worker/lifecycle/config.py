"""The lifecycle manager's configuration: the weights loaded at start, requests while asleep, the group endpoint."""

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
    checkpoint_read_timeout_s: float = Field(
        default=600.0, gt=0,
        description="Deadline of reading one update's checkpoint (disk or streamed), or a level-2 wake's re-read of "
        "the served version; past it the update fails with bad_checkpoint (the wake with weights_unavailable, still "
        "asleep), the worker is no longer busy, and a read still blocked in the kernel keeps host-buffer operations "
        "refused until it returns.",
    )  # fmt: skip
    sleep_settle_timeout_s: float = Field(
        default=2.0, ge=0,
        description="CUDA, level-1 sleeps: longest the sleep waits, after releasing device memory, for "
        "host->device copies to run at full rate again (the driver clears released memory in the background, and "
        "a wake inside that window ran its weights copy at about half rate); 0: answer at once.",
    )  # fmt: skip
    upload_dir: Path | None = Field(default=None, description="Where streamed weight uploads are spooled.")
    stable_device_memory: bool = Field(
        default=True,
        description="CUDA: hold weights and KV cache in virtual-memory regions whose addresses survive a sleep "
        "(off: plain torch allocations, whose addresses can move).",
    )
    group_host: str = Field(
        default="0.0.0.0", description="Expert parallelism: address the group endpoint listens on (the pod's IP)."
    )
    group_port: int = Field(
        default=7100, ge=0, le=65535,
        description="Expert parallelism: port of this rank's group endpoint (epoch rendezvous; peers probe it).",
    )  # fmt: skip
    group_backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto",
        description="Expert parallelism: collectives over NCCL on CUDA and gloo on CPU ('auto'); 'gloo' on CUDA "
        "goes through host memory (several ranks on one GPU, which NCCL refuses).",
    )
    group_timeout_s: float = Field(
        default=10.0, gt=0,
        description="Expert parallelism: deadline of one collective; a peer slower than this breaks the group.",
    )  # fmt: skip
    group_idle_poll_s: float = Field(
        default=0.02, gt=0, le=5,
        description="Expert parallelism: wait between two step headers while the whole group is idle.",
    )  # fmt: skip
