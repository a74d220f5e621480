"""The serving API's configuration: where it listens, how it logs, how long it waits on a slow streaming client."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="0.0.0.0", min_length=1, description="Address both APIs listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port of the serving API (0: any free port).")
    log_level: LogLevel = Field(default="info", description="Log level of the worker and its HTTP servers.")
    stream_write_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description="A streaming client that accepts no data for this long is dropped and its request aborted.",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value
