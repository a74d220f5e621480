"""The operator's one typed configuration, read from TIDAL_OPERATOR_* environment variables (set by the Helm chart).

TIDAL_OPERATOR_NAMESPACE          namespace the operator pod runs in (downward API)
TIDAL_OPERATOR_POD_LABELS         its pod labels, "k=v,k2=v2": worker NetworkPolicies admit exactly these pods
TIDAL_OPERATOR_WATCH_NAMESPACES   comma-separated namespaces to watch; empty watches all
TIDAL_OPERATOR_METRICS_PORT       Prometheus metrics port (default 8080)
TIDAL_OPERATOR_HEALTH_PORT        liveness endpoint /healthz (default 8081)
TIDAL_OPERATOR_LOG_LEVEL          debug, info, warning or error (default info)
TIDAL_OPERATOR_RESYNC_SECONDS     period of the reconcile timer (default 15)
TIDAL_OPERATOR_BIND_ADDRESS       address the metrics and health servers listen on (default 0.0.0.0; the chart sets
                                  the pod IP, so two operator pods on the local dev cluster do not collide)
TIDAL_OPERATOR_POD_NAME           this process's name in the leader-election Lease and on Events (the pod name)
TIDAL_OPERATOR_LEASE_NAME         the coordination.k8s.io Lease in the operator's namespace; one holder reconciles
TIDAL_OPERATOR_LEASE_SECONDS      how long a leader that stopped renewing keeps the Lease (default 15)
"""

import os
import socket
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tidal.operator.builders.networkpolicy import OperatorIdentity

ENV_PREFIX = "TIDAL_OPERATOR_"


class OperatorConfigError(ValueError):
    """The environment does not describe a valid operator configuration."""


def _split(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


class OperatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = Field(min_length=1)
    pod_labels: dict[str, str] = Field(min_length=1)
    watch_namespaces: list[str] = Field(default_factory=list)
    metrics_port: int = Field(8080, ge=1, le=65535)
    health_port: int = Field(8081, ge=1, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    resync_seconds: float = Field(15.0, gt=0, le=3600)
    bind_address: str = Field("0.0.0.0", min_length=1)
    pod_name: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}", min_length=1)
    lease_name: str = Field("tidal-operator", min_length=1, max_length=253)
    lease_seconds: float = Field(15.0, ge=2, le=600)

    @field_validator("pod_labels", mode="before")
    @classmethod
    def _parse_labels(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        labels = {}
        for pair in _split(value):
            key, sep, val = pair.partition("=")
            if not sep or not key:
                raise ValueError(f"expected key=value pairs separated by commas, got {pair!r}")
            labels[key.strip()] = val.strip()
        return labels

    @field_validator("watch_namespaces", mode="before")
    @classmethod
    def _parse_namespaces(cls, value: object) -> object:
        return _split(value) if isinstance(value, str) else value

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "OperatorConfig":
        values = {name: env[ENV_PREFIX + name.upper()] for name in cls.model_fields if ENV_PREFIX + name.upper() in env}
        try:
            return cls.model_validate(values)
        except ValidationError as err:
            lines = [f"{ENV_PREFIX}{'.'.join(map(str, e['loc'])).upper()}: {e['msg']}" for e in err.errors()]
            raise OperatorConfigError("invalid operator configuration:\n  " + "\n  ".join(lines)) from None

    def identity(self) -> OperatorIdentity:
        return OperatorIdentity(namespace=self.namespace, pod_labels=dict(self.pod_labels))
