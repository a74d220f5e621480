"""The worker process's one typed configuration: the engine's settings plus the server's, from flags or environment.

`WorkerConfig` is an `EngineConfig` (so every engine option is a worker option, with the engine's own validation)
extended with what the HTTP layer needs. Each field is read from the environment as `TIDAL_<FIELD>` (e.g.
`TIDAL_PORT`, `TIDAL_MAX_NUM_SEQS`); the model directory is `TIDAL_MODEL` (or `TIDAL_MODEL_PATH`). Command-line
flags (see `tidal.worker.cli`) are passed in as init arguments and win over the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tidal.worker.engine.config import EngineConfig

ENV_PREFIX = "TIDAL_"

LogLevel = Literal["critical", "error", "warning", "info", "debug"]


class WorkerConfig(BaseSettings, EngineConfig):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_by_name=True, protected_namespaces=()
    )

    # Redeclared only to add the short environment name TIDAL_MODEL (an alias bypasses the prefix, so it is spelt out).
    model_path: Path = Field(
        validation_alias="TIDAL_MODEL",
        description="Local Hugging Face model directory (config.json, *.safetensors, tokenizer).",
    )
    host: str = Field(default="0.0.0.0", min_length=1, description="Address the serving API listens on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port of the serving API (0: any free port).")
    log_level: LogLevel = Field(default="info", description="Log level of the worker and its HTTP servers.")
    stream_write_timeout_s: float = Field(
        default=30.0,
        gt=0.0,
        description="A streaming client that accepts no data for this long is dropped and its request aborted.",
    )

    # ----- the control API and the lifecycle (tidal.worker.control, tidal.worker.lifecycle) -----
    control_port: int = Field(
        default=8001, ge=0, le=65535, description="Port of the control API; it starts only when a token is set."
    )
    control_token: SecretStr | None = Field(default=None, description="Bearer token of the control API.")
    control_token_file: Path | None = Field(default=None, description="File holding the control API's token.")
    weights_version: str = Field(
        default="base", min_length=1, max_length=128, description="Version name of the weights loaded at start."
    )
    weights_path: Path | None = Field(
        default=None, description="Load these weights at start instead of the model directory's own."
    )
    asleep_requests: Literal["reject", "wake"] = Field(
        default="reject", description="Requests while asleep: 'reject' (503 + Retry-After) or 'wake' the model."
    )
    asleep_retry_after_s: int = Field(default=30, ge=1, description="Retry-After of requests refused while asleep.")
    upload_dir: Path | None = Field(default=None, description="Where streamed weight uploads are spooled.")
    rank: int = Field(default=0, ge=0, description="This worker's rank in its group.")
    world_size: int = Field(default=1, ge=1, description="Ranks in this worker's group.")

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("model_path")
    @classmethod
    def _model_dir_exists(cls, path: Path) -> Path:
        # Checked here, at start, so a typo is a one-line error rather than a traceback from the loader.
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist")
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json")
        return path

    def engine_config(self) -> EngineConfig:
        """The engine's part, as the engine's own type."""
        return EngineConfig(**self.model_dump(include=set(EngineConfig.model_fields)))


def env_name(field_name: str) -> str:
    """The environment variable that sets a field (the model directory's short name included)."""
    return "TIDAL_MODEL" if field_name == "model_path" else f"{ENV_PREFIX}{field_name.upper()}"
