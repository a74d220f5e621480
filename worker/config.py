"""The worker process's one typed configuration: each component's own config, nested, from flags or environment.

`WorkerConfig` holds the engine's, the serving API's, the control API's and the lifecycle's configs as they are;
the composition root (`tidal.worker.process`) hands each to its component, so no field is written or copied twice.
Every leaf is set by the flat environment variable `TIDAL_<FIELD>` (e.g. `TIDAL_PORT`, `TIDAL_MAX_NUM_SEQS`; the
model directory also by `TIDAL_MODEL`) and by the flag `--<field>` (`tidal.worker.cli`), which wins; `WORKER_OPTIONS`
derives both from the models, and refuses two components' fields with one name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from tidal.worker.config_flags import FlatEnvSource, FlatOptions
from tidal.worker.control.config import ControlConfig
from tidal.worker.engine.config import EngineConfig
from tidal.worker.lifecycle.config import LifecycleConfig
from tidal.worker.server.config import ServerConfig

ENV_PREFIX = "TIDAL_"


class WorkerEngineConfig(EngineConfig):
    """The engine's config as the worker process takes it: the model directory must exist when the process starts."""

    @field_validator("model_path")
    @classmethod
    def _model_dir_exists(cls, path: Path) -> Path:
        # Checked here, at start, so a typo is a one-line error rather than a traceback from the loader.
        if path.suffix.lower() == ".gguf" and path.is_file():
            return path  # dequantized into a cached directory before the worker is assembled (model_source.py)
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist")
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json")
        return path


class WorkerConfig(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid", frozen=True)

    engine: WorkerEngineConfig
    server: ServerConfig = Field(default_factory=ServerConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    lifecycle: LifecycleConfig = Field(default_factory=LifecycleConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Init arguments (the flags) over the flat TIDAL_* variables; no nested or dotenv names.
        return init_settings, FlatEnvSource(settings_cls, WORKER_OPTIONS)

    @classmethod
    def from_flat(cls, **values: Any) -> WorkerConfig:
        """From flat field names, as flags name them (`model_path=..., port=0, num_kv_blocks=64`), over the
        environment. For tests and scripts; ValidationError when invalid."""
        return WORKER_OPTIONS.build(values)


WORKER_OPTIONS: FlatOptions[WorkerConfig] = FlatOptions(
    WorkerConfig, env_prefix=ENV_PREFIX, aliases={"model_path": ("model",)}
)
