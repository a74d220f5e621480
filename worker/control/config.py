"""The control API's configuration: its address and port and where its bearer token comes from (see `auth`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class ControlConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    control_port: int = Field(
        default=8001, ge=0, le=65535, description="Port of the control API; it starts only when a token is set."
    )
    control_host: str | None = Field(
        default=None,
        description="Address the control API listens on; unset: the serving API's --host (under the operator, the "
        "pod's IP).",
    )
    control_token: SecretStr | None = Field(default=None, description="Bearer token of the control API.")
    control_token_file: Path | None = Field(default=None, description="File holding the control API's token.")
